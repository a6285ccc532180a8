"""Who may call a generation server worker's HTTP face: the built-in backend as the worker
configures it (weights from the run's publication directory only), and the vLLM adapter
(control routes want the run's token, ``/generate`` the api key; vLLM itself gets the token
through its environment).  The attacker is a process on the same host without the run's
secret (tests/helpers/engine_servers.py: as_another_run)."""

from __future__ import annotations

import requests
from engine_servers import as_another_run
from gen_server_worker import start_generation_server
from tiny_models import make_tiny_hf_model

from realhf.base import constants
from realhf.base.net import auth, network
from realhf.base.net.http_server import ServerThread, auth_headers, generation_api_keys
from realhf.system.rollout import vllm_backend

KEY = {"Authorization": "Bearer sk-adapter"}


def test_the_worker_loads_weights_from_the_runs_publication_directory_only(
    memory_name_resolve, trial, tmp_path
):
    model = make_tiny_hf_model("qwen2", tmp_path / "m", vocab_size=268, perturb=0.3)
    w = start_generation_server(trial, model)
    try:
        root = constants.weight_publication_root("exp", trial)
        r = requests.post(
            w.url + "/update_weights_from_disk",
            json={"model_path": model},  # readable, but not published by this run
            headers=auth_headers(),
            timeout=30,
        )
        assert r.status_code == 403 and root in r.json()["message"], r.text
        assert as_another_run(w.url, [("POST", "/pause_generation", {})]) == [401, 401]
    finally:
        w._exit_hook()


def test_the_vllm_adapter_wants_the_token_and_the_publication_directory(tmp_path):
    dead = f"http://127.0.0.1:{network.find_free_port()}"  # no vLLM: what passes gets 502
    app = vllm_backend.create_adapter_app(
        dead,
        "policy",
        weights_root=str(tmp_path),
        api_keys=generation_api_keys("sk-adapter", "127.0.0.1"),  # as the worker makes them
    )
    http = ServerThread(app, host="127.0.0.1", port=0).start(timeout=30)
    generate = {"input_ids": [[3, 4]], "sampling_params": {"max_new_tokens": 2}}
    control = [
        ("POST", "/pause_generation", {}),
        ("POST", "/continue_generation", {}),
        ("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "v1")}),
    ]
    # what each answers past the token: no vLLM to pause, no v1 published
    passed = {
        "/pause_generation": 502,
        "/continue_generation": 502,
        "/update_weights_from_disk": 400,
    }
    try:
        statuses = as_another_run(http.url, control + [("POST", "/generate", generate)])
        assert statuses == [401] * 8, statuses
        # /generate first: a pause that vLLM could not take still gates the adapter
        for headers in (KEY, auth_headers()):
            r = requests.post(http.url + "/generate", json=generate, headers=headers, timeout=30)
            assert r.status_code == 502, r.text
        for _, path, body in control:
            r = requests.post(http.url + path, json=body, headers=KEY, timeout=30)
            assert r.status_code == 401, path  # the api key is no control token
            r = requests.post(http.url + path, json=body, headers=auth_headers(), timeout=30)
            assert r.status_code == passed[path], (path, r.text)
        r = requests.post(
            http.url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / ".." / "elsewhere")},
            headers=auth_headers(),
            timeout=30,
        )
        assert r.status_code == 403 and str(tmp_path) in r.json()["message"], r.text
        assert requests.get(http.url + "/health", timeout=10).status_code == 503  # open
    finally:
        http.stop()


def test_vllm_gets_the_token_in_its_environment_not_its_command_line():
    cfg = vllm_backend.VLLMConfig(model_path="/m", port=1234)
    server = vllm_backend.VLLMServer(cfg, python="/venv/bin/python", log_path="/tmp/x.log")
    assert server.env["VLLM_API_KEY"] == auth.http_token()
    assert auth.http_token() not in " ".join(vllm_backend.build_command(cfg, "p"))
