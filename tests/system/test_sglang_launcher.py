"""The SGLang launcher: the command line it builds, config checks, and process handling.

SGLang itself needs a GPU; the process-handling tests run the launcher's
``start``/``wait_healthy``/``stop`` against the built-in server (same /health)
and against a process that dies.
"""

import importlib.util
import shutil
import socket
import sys

import pytest

from realhf.system.sglang_launcher import SGLangConfig, SGLangServer, build_command, wait_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_command_line():
    cmd = build_command(SGLangConfig(model_path="/ckpt/actor"), python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    args = cmd[3:]
    # flag/value pairs and bare flags as SGLang's argparse expects them
    assert args == [
        "--model-path",
        "/ckpt/actor",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--dtype",
        "auto",
        "--tp-size",
        "1",
        "--dp-size",
        "1",
        "--base-gpu-id",
        "0",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--random-seed",
        "1",
        "--mem-fraction-static",
        "0.8",
        "--schedule-policy",
        "lpm",
        "--enable-metrics",
        "--log-level",
        "warning",
    ]


def test_areal_style_options_and_extra_args():
    cfg = SGLangConfig(
        model_path="m",
        port=31001,
        skip_tokenizer_init=True,
        tp_size=2,
        base_gpu_id=4,
        random_seed=7,
        mem_fraction_static=0.5,
        context_length=4096,
        max_running_requests=256,
        disable_radix_cache=True,
        enable_metrics=False,
        attention_backend="triton",
        extra_args=["--chunked-prefill-size", "-1"],
    )
    cmd = build_command(cfg, python="py")
    joined = " ".join(cmd)
    assert "--skip-tokenizer-init" in cmd and "--disable-radix-cache" in cmd
    assert "--enable-metrics" not in cmd  # False flags are left out
    assert "--tp-size 2" in joined and "--base-gpu-id 4" in joined
    assert "--random-seed 7" in joined and "--mem-fraction-static 0.5" in joined
    assert "--context-length 4096" in joined and "--max-running-requests 256" in joined
    assert "--attention-backend triton" in joined
    assert "--dist-init-addr" not in cmd  # None values are left out
    assert cmd[-2:] == ["--chunked-prefill-size", "-1"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(port=0), "port"),
        (dict(dp_size=2), "dp_size"),
        (dict(tp_size=0), "tp_size"),
        (dict(mem_fraction_static=1.5), "mem_fraction_static"),
        (dict(dtype="fp8"), "dtype"),
        (dict(schedule_policy="sjf"), "schedule_policy"),
        (dict(nnodes=2), "dist_init_addr"),
        (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank"),
        (dict(max_running_requests=0), "max_running_requests"),
        (dict(extra_args="--foo 1"), "extra_args"),
        (dict(log_level="loud"), "log_level"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SGLangConfig.{field}="):
        SGLangConfig(model_path="m", **kwargs)


def test_dead_process_is_reported_with_exit_code_and_log(tmp_path):
    port = _free_port()
    server = SGLangServer(SGLangConfig(model_path="m", port=port), log_path=str(tmp_path / "s.log"))
    server.command = [sys.executable, "-c", "import sys; print('no GPU here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3") as info:
        server.start(health_timeout=30)
    assert "no GPU here" in str(info.value)


def test_wait_healthy_times_out():
    port = _free_port()
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}/health did not answer"):
        wait_healthy(f"http://127.0.0.1:{port}", timeout=0.5, interval=0.1)


@pytest.mark.slow
def test_start_waits_for_health_and_stop_ends_the_process(tmp_path):
    """The launcher lifecycle against a real server process (the built-in one)."""
    from realhf.impl.model.testing import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2", tmp_path / "m")
    port = _free_port()
    cfg = SGLangConfig(model_path=model, port=port)
    server = SGLangServer(cfg, log_path=str(tmp_path / "s.log"))
    server.command = [
        sys.executable,
        "-m",
        "realhf.apps.serve",
        "--model-path",
        model,
        "--port",
        str(port),
        "--max-running-requests",
        "2",
    ]
    server.start(health_timeout=120)
    try:
        assert server.process.poll() is None
        wait_healthy(cfg.url, timeout=5)
    finally:
        code = server.stop()
    assert code is not None and server.process.poll() is not None


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="SGLang needs a CUDA GPU")
def test_real_sglang_server_serves_generate(tmp_path):
    import requests

    from realhf.impl.model.testing import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2", tmp_path / "m")
    cfg = SGLangConfig(
        model_path=model,
        port=_free_port(),
        skip_tokenizer_init=True,
        mem_fraction_static=0.3,
        disable_cuda_graph=True,
    )
    server = SGLangServer(cfg, log_path=str(tmp_path / "sglang.log")).start(health_timeout=600)
    try:
        r = requests.post(
            cfg.url + "/generate",
            json={
                "input_ids": [1, 2, 3],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True,
            },
            timeout=60,
        )
        meta = r.json()["meta_info"]
        assert len(meta["output_token_logprobs"]) == 4
        assert meta["finish_reason"]["type"] == "length"
    finally:
        server.stop()
