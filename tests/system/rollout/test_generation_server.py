"""generation_server worker: built-in backend, registration, end of experiment, dead backend."""

from __future__ import annotations

import importlib.util

import pytest
import requests
from gen_server_worker import start_generation_server
from tiny_models import make_tiny_hf_model

from realhf.api.core.rollout_config import GenerationBackend, GenerationServerConfig
from realhf.base import name_resolve, names
from realhf.base.net.http_server import auth_headers
from realhf.system.rollout.generation_server import resolve_backend
from realhf.system.worker.base import WorkerStatus, read_error, read_status


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gen_server") / "m")
    make_tiny_hf_model(
        "qwen2",
        path,
        seed=0,
        perturb=0.3,
        vocab_size=268,
        eos_token_id=0,
        pad_token_id=1,
        max_position_embeddings=128,
    )
    return path


def test_serves_registers_and_stops_with_the_experiment(memory_name_resolve, trial, model_dir):
    w = start_generation_server(trial, model_dir)
    try:
        assert name_resolve.get_subtree(names.gen_servers("exp", trial)) == [w.url]
        r = requests.post(
            w.url + "/generate",
            json={
                "input_ids": [3, 4],
                "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                "return_logprob": True,
            },
            timeout=30,
        )
        assert len(r.json()["meta_info"]["output_token_logprobs"]) == 3
        for step in ("pause_generation", "continue_generation"):
            r = requests.post(f"{w.url}/{step}", headers=auth_headers(), timeout=10)
            assert r.json()["status"] == "ok"
        name_resolve.add(names.experiment_status("exp", trial), "RUNNING")
        for _ in range(3):
            assert not w.step().completed
        name_resolve.add(names.experiment_status("exp", trial), "COMPLETE", replace=True)
        results = [w.step() for _ in range(5)]
        assert any(r is not None and r.completed for r in results)
        assert w.status == WorkerStatus.COMPLETED
        assert name_resolve.get_subtree(names.gen_servers("exp", trial)) == []
    finally:
        w._exit_hook()
    with pytest.raises(requests.ConnectionError):
        requests.get(w.url + "/health", timeout=5)


def test_a_dead_engine_fails_the_worker_with_its_url(memory_name_resolve, trial, model_dir):
    w = start_generation_server(trial, model_dir)
    try:
        w.engine.close()
        for _ in range(5):
            w.step()
        assert read_status("exp", trial, "generation_server/0") == WorkerStatus.ERROR
        err = read_error("exp", trial, "generation_server/0")
        assert w.url in err.message and "engine thread died" in err.message
    finally:
        w._exit_hook()


def test_backend_resolution():
    assert resolve_backend("builtin") is GenerationBackend.BUILTIN
    assert resolve_backend(GenerationBackend.BUILTIN) is GenerationBackend.BUILTIN
    assert GenerationServerConfig(model_path="/m", backend="builtin").backend is (
        GenerationBackend.BUILTIN
    )
    if importlib.util.find_spec("sglang") is None:
        assert resolve_backend("auto") == "builtin"
        with pytest.raises(ValueError, match="sglang package is not installed"):
            resolve_backend("sglang")
    with pytest.raises(ValueError, match="backend='tgi'"):
        GenerationServerConfig(model_path="/m", backend="tgi")
    with pytest.raises(ValueError, match="registration_ttl_s=0"):
        GenerationServerConfig(model_path="/m", registration_ttl_s=0)
