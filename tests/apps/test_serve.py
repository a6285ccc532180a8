"""`python -m realhf.apps.serve`: argument errors, and a real server process end to end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import quickstart_runs
import requests
from heap_probe import WHERE_A_LARGE_TENSOR_LIVES

from realhf.apps.serve import READY_LINE, main
from realhf.base.net import auth
from realhf.base.net.http_server import auth_headers

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "realhf", "assets", "tiny")


def test_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["--model-path", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_dir_without_config_is_a_clear_error(tmp_path, capsys):
    assert main(["--model-path", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_bad_engine_option_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model-path", str(tmp_path), "--dtype", "int3"]) == 2
    assert "EngineConfig.dtype='int3'" in capsys.readouterr().err


_HEAP_PROBE = (
    WHERE_A_LARGE_TENSOR_LIVES
    + r"""
import sys
from realhf.apps import serve

def report_instead_of_loading(*args, **kwargs):
    print(where_a_large_tensor_lives())
    raise SystemExit(0)

serve.load_engine = report_instead_of_loading
serve.main(["--model-path", sys.argv[1]])
"""
)


def test_the_server_keeps_the_memory_its_steps_free():
    """The serving process keeps freed tensors for its next step (gcutil.keep_freed_memory)
    from before the model loads: a 64 MB tensor comes from glibc's heap, not from a
    mapping of its own that the next prefill would fault in again."""
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, ASSETS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["heap"]


@pytest.mark.slow
def test_cli_subprocess_exit_code(tmp_path):
    p = quickstart_runs.run_module("realhf.apps.serve", ["--model-path", str(tmp_path / "x")], 120)
    assert p.returncode == 2 and "--model-path" in p.stderr


@pytest.mark.slow
def test_serve_process_end_to_end(tmp_path):
    from tiny_models import make_tiny_hf_model

    model = make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=268, perturb=0.3)
    for f in [os.path.join(ASSETS, f) for f in TOKENIZER_FILES]:
        shutil.copy(f, model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = quickstart_runs.popen_module(
        "realhf.apps.serve",
        [
            "--model-path",
            model,
            "--port",
            str(port),
            "--max-running-requests",
            "4",
            "--context-length",
            "128",
            "--weights-root",
            str(tmp_path / "weights"),
            "--api-key",
            "sk-test",
        ],
        env={auth.SECRET_ENV: auth.run_secret().hex()},  # this process's secret
    )
    try:
        deadline = time.monotonic() + 120
        lines = []
        while True:
            line = proc.stdout.readline()
            lines.append(line)
            if READY_LINE in line:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/health", timeout=10).status_code == 200
        key = {"Authorization": "Bearer sk-test"}
        body = {"text": "Compute 1+2.", "sampling_params": {"max_new_tokens": 4}}
        assert requests.post(url + "/generate", json=body, timeout=60).status_code == 401
        d = requests.post(
            url + "/generate", json={**body, "return_logprob": True}, headers=key, timeout=60
        ).json()
        assert len(d["meta_info"]["output_token_logprobs"]) == len(d["output_ids"]) <= 4
        assert isinstance(d["text"], str)
        r = requests.post(url + "/generate", json={"input_ids": [1] * 200}, headers=key, timeout=60)
        assert r.status_code == 400
        models = requests.get(url + "/v1/models", headers=auth_headers(), timeout=10).json()
        assert models["data"][0]["id"] == "m"  # the run's token is a key too
        # control routes: the run's token only (the api key is for generation)
        assert requests.post(url + "/pause_generation", headers=key, timeout=10).status_code == 401
        r = requests.post(url + "/pause_generation", headers=auth_headers(), timeout=10)
        assert r.status_code == 200
        r = requests.post(
            url + "/update_weights_from_disk",
            json={"model_path": model},
            headers=auth_headers(),
            timeout=10,
        )
        assert r.status_code == 403 and str(tmp_path / "weights") in r.json()["message"]
        r = requests.post(url + "/continue_generation", headers=auth_headers(), timeout=10)
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode is not None
