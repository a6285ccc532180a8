"""Install realhf and its sibling packages areal/, functioncall/, evaluation/ and training/.

Build without isolation so the C++ extension compiles against the torch that is
already installed (`make install` puts the CPU wheel of torch 2.13.0 there first):

    pip install --no-build-isolation -e .

The C++ kernels in csrc/ are optional at run time: when they were not built the
Python side falls back to pure-PyTorch references (realhf.impl.kernels).
"""

import os

from setuptools import find_packages, setup


def _ext_modules():
    """C++ (and, with a CUDA toolkit and CUDA torch, CUDA) kernels from csrc/.

    Set REALHF_NO_EXT=1 to skip them (the pure-PyTorch fallbacks are used).
    """
    if os.environ.get("REALHF_NO_EXT") == "1":
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:  # torch absent: install it first (see Makefile)
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    cpu_sources = sorted(
        os.path.join("csrc", f)
        for f in os.listdir(os.path.join(here, "csrc"))
        if f.endswith(".cpp")
    )
    if not cpu_sources:
        return [], {}
    exts = [
        cpp_extension.CppExtension(
            "realhf._C",
            cpu_sources,
            extra_compile_args={"cxx": ["-O3", "-fopenmp"]},
            extra_link_args=["-fopenmp"],
        )
    ]
    # CUDA kernels live in csrc/cuda/ with their own host-side bindings (a .cpp, so
    # pybind11 is compiled by the host compiler, not nvcc) and build `realhf._C_cuda`.
    cuda_dir = os.path.join(here, "csrc", "cuda")
    cuda_sources = sorted(
        os.path.join("csrc", "cuda", f)
        for f in (os.listdir(cuda_dir) if os.path.isdir(cuda_dir) else [])
        if f.endswith((".cu", ".cpp"))
    )
    import torch

    if (
        any(f.endswith(".cu") for f in cuda_sources)
        and torch.version.cuda
        and cpp_extension.CUDA_HOME
    ):
        exts.append(
            cpp_extension.CUDAExtension(
                "realhf._C_cuda",
                cuda_sources,
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
            )
        )
    return exts, {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _ext_modules()

setup(
    name="realhf",
    version="0.1.0",
    description="Reinforcement learning for language models: PPO, GRPO, SFT and "
    "fully asynchronous PPO, runnable on CPU and GPU.",
    packages=find_packages(
        include=["realhf*", "areal*", "functioncall*", "evaluation*", "training*"]
    ),
    package_data={
        "realhf": ["assets/**/*"],
        "training": ["configs/*.yaml"],
        "evaluation": ["data/**/*"],
    },
    include_package_data=True,
    python_requires=">=3.11",  # asyncio.TaskGroup, ExceptionGroup
    install_requires=[
        # torch is installed by `make install` as the CPU wheel 2.13.0 before this
        # runs; a bare `torch` here with no torch present would pull several GB of
        # CUDA wheels, so only a floor is given and the Makefile does the pinning.
        # The C++ extension builds with torch's own pybind11 headers, and with ninja
        # when present (the Makefile installs it first: a --no-build-isolation build
        # cannot use build requirements listed here).
        "torch>=2.3",
        "transformers>=4.50",
        "safetensors",
        "pyzmq",
        "numba",
        # numba's LLVM binding: the decode kernel emits a prefetch intrinsic through it
        "llvmlite",
        "hydra-core",
        "omegaconf",
        "numpy",
        "psutil",
        # forked worker processes show their own command line in ps and /proc (forkserver)
        "setproctitle",
        "rich",
        # the math verifier (it brings sympy, which only it uses)
        "math-verify",
        # process pool whose tasks can time out: a hung sympy check is killed, not waited on
        "pebble",
        "fastapi",
        "pydantic>=2",
        "uvicorn",
        # uvicorn parses HTTP with it when present (else pure-Python h11): ~15 % less event
        # loop CPU per generation request (benchmark/results/peers.md)
        "httptools",
        "aiohttp",
        # serialises the generation server's long log-prob lists several times faster
        "orjson",
        # reads the servers' /metrics (Prometheus text) for the load-based routing policies
        "prometheus_client",
        # every run writes curves.png and tensorboard/ (README, "Outputs"); they stay core
        # so that a default run never silently lacks an output.
        "matplotlib",
        "tensorboard",
        # dataset and request images (vision-language models): decoding, checks, and the
        # HF image processor's PIL backend (no torchvision)
        "pillow",
    ],
    extras_require={
        # etcd-sdk-python (module `pyetcd`, the maintained fork of etcd3 with the same
        # API; etcd3 0.12 needs protobuf<=3.20.3, which conflicts with ray) is needed only
        # with name_resolve=etcd3://..., i.e. on clusters; it pulls grpc, so one machine
        # runs without it.
        "etcd": ["etcd-sdk-python"],
        # mode=ray (realhf.scheduler.ray) and name_resolve=ray://; core only (no dashboard)
        "ray": ["ray==2.60.0"],
        # wandb.mode=offline|online: the master logs every step to Weights & Biases
        "wandb": ["wandb==0.30.0"],
        # allocation_mode=sglang.*: SGLang generation servers. GPU machines only (SGLang
        # needs CUDA) and it pins its own torch build: install it where that torch is the
        # one you train with, or give the servers their own environment.
        "sglang": ["sglang[srt]>=0.5"],
        # allocation_mode=vllm.* on GPU machines, in this environment. On CPU machines vLLM's
        # CPU build pins other torch/transformers versions: it goes in a venv of its own
        # (make vllm-venv), found by the servers.
        "vllm": ["vllm>=0.32"],
        "test": [
            "pytest",
            "pytest-timeout",
            # `make test` runs on two workers
            "pytest-xdist",
            "openai",
            "requests",
            "tokenizers",
            "etcd-sdk-python",
            # the Ray launcher's tests start a real two-node Ray cluster
            "ray==2.60.0",
            # tests write W&B runs offline (no account or network)
            "wandb==0.30.0",
            # LoRA adapters are checked against PEFT's own loading of the files we write
            "peft==0.21.2",
            # `make lint`; pinned because formatter output changes between releases
            "ruff==0.17.6",
        ],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
