"""The SGLang launcher: the command line it builds, config checks, and process handling.

SGLang itself needs a GPU; the process-handling tests run the launcher's
``start``/``wait_healthy``/``stop`` against the built-in server (same /health)
and against a process that dies.
"""

import importlib.util
import os
import shutil
import signal
import socket
import sys
import time

import psutil
import pytest

from realhf.system.rollout.sglang_launcher import (
    SGLangConfig,
    SGLangServer,
    build_command,
    wait_healthy,
)


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


# A stand-in for SGLang's process tree: the server spawns a child (as SGLang spawns its
# scheduler and detokenizer) that ignores SIGTERM, so only the kill fallback can end it,
# and that outlives the server if nobody kills it.  The child writes its pid once it
# ignores SIGTERM; the server answers /health only after that, so stop() never races it.
_FAKE_SERVER = r"""
import http.server, os, signal, subprocess, sys, time
port, pid_file, server_ignores_term = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
subprocess.Popen([sys.executable, "-c",
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)", pid_file])
deadline = time.monotonic() + 30
while not os.path.exists(pid_file) and time.monotonic() < deadline:
    time.sleep(0.02)
if server_ignores_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _alive(pid: int) -> bool:
    # Orphans are reparented to an init that may never reap them: a zombie is dead.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("server_ignores_term", [False, True], ids=["term", "kill-fallback"])
def test_stop_ends_the_servers_children(tmp_path, no_leftover_processes, server_ignores_term):
    """stop() ends the whole process group, not only the server's own pid."""
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    pid_file = str(tmp_path / "child.pid")
    port = _free_port()
    server = SGLangServer(SGLangConfig(model_path="m", port=port), log_path=str(tmp_path / "s.log"))
    server.command = [
        sys.executable,
        str(script),
        str(port),
        pid_file,
        str(int(server_ignores_term)),
    ]
    child = None
    try:
        server.start(health_timeout=30)
        child = int(open(pid_file).read())
        leader = server.process.pid
        # its own session: Ctrl-C or a killpg aimed at the launcher's group is not what
        # stops it, stop() is, and stop() can reach every process it spawned
        assert os.getsid(leader) == leader and os.getpgid(child) == leader
        t0 = time.monotonic()
        code = server.stop(timeout=1.0)
        assert time.monotonic() - t0 < 15
        assert code == (-signal.SIGKILL if server_ignores_term else -signal.SIGTERM)
        assert not _alive(child), "the server's child survived stop()"
    finally:
        server.stop(timeout=1.0)
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)  # only the pid this test's server spawned


def test_a_server_that_dies_while_starting_leaves_no_children(tmp_path, no_leftover_processes):
    """The server exits before /health answers; the child it left behind is stopped too."""
    pid_file = str(tmp_path / "child.pid")
    server = SGLangServer(
        SGLangConfig(model_path="m", port=_free_port()), log_path=str(tmp_path / "s.log")
    )
    server.command = [
        sys.executable,
        "-c",
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "open(sys.argv[1], 'w').write(str(c.pid))\n"
        "sys.exit(3)",
        pid_file,
    ]
    child = None
    try:
        with pytest.raises(RuntimeError, match="exited with code 3"):
            server.start(health_timeout=30)
        child = int(open(pid_file).read())
        assert not _alive(child), "the child of a server that died while starting survived"
    finally:
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)  # only the pid this test's server spawned


@pytest.mark.slow
def test_start_waits_for_health_and_stop_ends_the_process(tmp_path):
    """The launcher lifecycle against a real server process (the built-in one)."""
    from tiny_models import make_tiny_hf_model

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
    from tiny_models import make_tiny_hf_model

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
