"""Fault injection: $REALHF_FAULTS parsing, and the faults a server's app then shows."""

from __future__ import annotations

import time

import fastapi
import pytest
import requests

from realhf.base import worker_faults
from realhf.base.net.http_server import ServerThread


def test_parse_and_lookup(monkeypatch):
    spec = (
        "generation_server/0:slow_generate=0.5, generation_server/0:drop_generate=3,"
        "x/1:fail_update=2"
    )
    assert worker_faults.parse(spec) == {
        "generation_server/0": {"slow_generate": 0.5, "drop_generate": 3.0},
        "x/1": {"fail_update": 2.0},
    }
    monkeypatch.setenv(worker_faults.ENV, spec)
    assert (
        worker_faults.faults_of("x/1") == {"fail_update": 2.0}
        and worker_faults.faults_of("x/0") == {}
    )
    monkeypatch.delenv(worker_faults.ENV)
    assert worker_faults.faults_of("x/1") == {}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("slow_generate=1", "is not of the form"),
        ("w/0:melt=1", "unknown fault 'melt'"),
        ("w/0:drop_generate=x", "is not a number"),
        ("w/0:fail_update=1.5", "a count for fail_update"),
        ("w/0:slow_generate=-1", "a number >= 0"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        worker_faults.parse(spec)


def test_no_faults_leave_the_app_alone():
    app = fastapi.FastAPI()
    assert worker_faults.wrap_asgi(app, {}) is app


def test_the_injected_faults_reach_clients():
    app = fastapi.FastAPI()
    calls = []

    @app.post("/generate")
    async def generate():
        calls.append("generate")
        return {"output_ids": [1, 2]}

    @app.post("/update_weights_from_disk")
    async def update():
        calls.append("update")
        return {"success": True}

    @app.post("/update_weights_from_shm")
    async def update_shm():
        calls.append("update_shm")
        return {"success": True}

    wrapped = worker_faults.wrap_asgi(
        app,
        {"slow_generate": 0.3, "drop_generate": 2, "fail_update": 1, "slow_update": 0.3},
        "test",
    )
    srv = ServerThread(wrapped).start()
    try:
        t = time.monotonic()
        assert requests.post(srv.url + "/generate", timeout=10).json() == {"output_ids": [1, 2]}
        assert time.monotonic() - t >= 0.3
        with pytest.raises(requests.exceptions.RequestException):
            requests.post(srv.url + "/generate", timeout=10)  # the 2nd answer is cut off
        assert requests.post(srv.url + "/generate", timeout=10).status_code == 200
        r = requests.post(srv.url + "/update_weights_from_disk", json={}, timeout=10)
        assert r.status_code == 500 and r.json()["success"] is False
        t = time.monotonic()
        assert requests.post(srv.url + "/update_weights_from_disk", timeout=10).json() == {
            "success": True
        }
        # Both load routes count as updates and wait slow_update seconds first.
        assert requests.post(srv.url + "/update_weights_from_shm", timeout=10).status_code == 200
        assert time.monotonic() - t >= 0.6
        # the failed update never reached it
        assert calls == ["generate"] * 3 + ["update", "update_shm"]
    finally:
        srv.stop()
