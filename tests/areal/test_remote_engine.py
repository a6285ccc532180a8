"""areal's RemoteInferenceEngine runs realhf's server pool, routing and weight-update protocol:
the defects of the copy it used to have (no wait for an update, no cleanup after a failed
one, a dead server failing every request) are tested here on the shared implementation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_servers import engine_server, greedy, stop_servers, two_model_versions

from areal.engine.remote import RemoteInferenceEngine
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.rollout_api import GenerateGroupRequest
from realhf.base.net import network
from realhf.impl.model.gen.weight_update import WeightUpdateError
from realhf.system.rollout.manager import server_pool

# Neither model version greedily stops (EOS 0, pad 1) within 6 tokens of this prompt.
PROMPT = (10, 11, 12)
GREEDY = GenerationHyperparameters(n=2, max_new_tokens=6, greedy=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_model_versions(tmp_path_factory.mktemp("remote"))


def _engine(servers, **kw):
    return RemoteInferenceEngine(
        [s.url for s in servers], new_tokens_per_chunk=3, health_check_interval_s=0.2, **kw
    )


def _generate(engine, n):
    """``n`` groups, one after another, on a loop of their own (as a workflow's would be)."""

    async def go():
        try:
            return [
                await engine.agenerate(GenerateGroupRequest(f"q{i}", PROMPT, GREEDY))
                for i in range(n)
            ]
        finally:
            await engine.aclose()  # its HTTP session belongs to this loop

    return asyncio.run(go())


@pytest.mark.slow  # two servers, three generated groups (~10 s)
def test_an_update_that_fails_on_one_server_leaves_the_others_serving_the_new_version(dirs):
    def failing_load(model, path):
        raise OSError(f"cannot read {path} (a test fault)")

    good, bad = engine_server(dirs["v0"]), engine_server(dirs["v0"], load_weights=failing_load)
    engine = _engine([good, bad])
    try:
        engine.update_weights(dirs["v1"], 1)
        assert engine.version == 1
        # The failing server is out of service; the good one was continued, not left paused.
        assert [s.url for s in engine.pool.live()] == [good.url]
        assert "update_weights_from_disk" in engine.pool.servers[bad.url].dead_reason
        assert not good.engine.stats()["paused"]
        for g in _generate(engine, 3):
            assert g.version_start == g.version_end == (1, 1)
            assert all(list(o) == greedy(dirs["v1"], PROMPT, 6) for o in g.output_ids)
        with pytest.raises(ValueError, match="not newer"):
            engine.update_weights(dirs["v1"], 1)
    finally:
        engine.close()
        stop_servers(good, bad)


def test_an_update_that_fails_everywhere_names_the_server_and_the_next_one_recovers(
    dirs, tmp_path, monkeypatch
):
    monkeypatch.setattr(server_pool, "REJOIN_RETRY_S", 0.3)
    srv = engine_server(dirs["v0"])
    engine = _engine([srv])
    try:
        with pytest.raises(FileNotFoundError, match="not a directory"):
            engine.update_weights(str(tmp_path / "missing"), 1)
        (tmp_path / "empty").mkdir()  # a directory the server cannot load
        with pytest.raises(WeightUpdateError, match=srv.url) as e:
            engine.update_weights(str(tmp_path / "empty"), 1)
        assert e.value.step == "update_weights_from_disk" and engine.version == 0
        # Not left paused (its gate would refuse every /generate), but out of service: its
        # weights are unknown, so it does not rejoin at version 0...
        assert not srv.engine.stats()["paused"]
        time.sleep(1.0)
        assert engine.pool.live() == [] and engine.pool.servers[srv.url].weights_unknown
        # ...only through the next update, which it then serves.
        engine.update_weights(dirs["v1"], 2)
        (g,) = _generate(engine, 1)
        assert g.version_start == (2, 2)
        assert all(list(o) == greedy(dirs["v1"], PROMPT, 6) for o in g.output_ids)
    finally:
        engine.close()
        stop_servers(srv)


def test_start_up_names_the_servers_it_waited_for():
    nobody = f"http://127.0.0.1:{network.find_free_port()}"
    with pytest.raises(TimeoutError, match=r"0 of 1 generation servers .*check the"):
        RemoteInferenceEngine([nobody], server_wait_timeout_s=0.5)
    with pytest.raises(ValueError, match="listed twice"):
        RemoteInferenceEngine([nobody, nobody])


def test_a_chunk_scheduled_during_an_update_waits_for_it_and_gets_the_new_weights(dirs):
    loading = threading.Event()

    def slow_load(model, path):
        loading.set()
        time.sleep(1.0)
        model.load_hf_weights(path)

    srv = engine_server(dirs["v0"], load_weights=slow_load)
    engine = _engine([srv])
    try:
        updater = threading.Thread(target=engine.update_weights, args=(dirs["v1"], 1))
        updater.start()
        assert loading.wait(30)  # the server is paused and loading now
        (g,) = _generate(engine, 1)
        updater.join(30)
        # Not aborted-and-retried against the paused server, nor recorded as version 0:
        # the chunk waited for the update and ran on the new weights.
        assert g.version_start == (1, 1)
        assert all(list(o) == greedy(dirs["v1"], PROMPT, 6) for o in g.output_ids)
        engine.close()
        with pytest.raises(RuntimeError, match="is closed"):  # a closed engine fails at once
            engine.update_weights(dirs["v0"], 2)
    finally:
        engine.close()
        stop_servers(srv)


@pytest.mark.slow  # waits out a dead server's failed calls and health checks (~4-13 s)
def test_a_server_that_dies_is_dropped_and_generation_goes_on(dirs):
    a, b = engine_server(dirs["v0"]), engine_server(dirs["v0"])
    engine = _engine([a, b], schedule_policy="round_robin")
    try:
        stop_servers(b)
        groups = _generate(engine, 4)
        assert all(list(o) == greedy(dirs["v0"], PROMPT, 6) for g in groups for o in g.output_ids)
        assert [s.url for s in engine.pool.live()] == [a.url]
    finally:
        engine.close()
        stop_servers(a)


def _failing(what):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} failed (a test fault)")

    return fail


@pytest.mark.slow  # three servers (~10 s)
def test_a_server_failing_its_pause_or_its_continue_leaves_the_others_updated(dirs):
    """The review's case: pausing server k fails. Every other server is still paused,
    loaded and continued (none is left paused), and one whose continue fails does not stop
    the others from being continued either; each failing server is named with its step."""
    good, bad_pause, bad_continue = (engine_server(dirs["v0"]) for _ in range(3))
    bad_pause.engine.pause = _failing("pause")
    bad_continue.engine.resume = _failing("resume")
    engine = _engine([good, bad_pause, bad_continue])
    try:
        engine.update_weights(dirs["v1"], 1)
        assert engine.version == 1 and [s.url for s in engine.pool.live()] == [good.url]
        assert "POST /pause_generation" in engine.pool.servers[bad_pause.url].dead_reason
        assert "POST /continue_generation" in engine.pool.servers[bad_continue.url].dead_reason
        assert not good.engine.stats()["paused"]
        (g,) = _generate(engine, 1)
        assert g.version_start == (1, 1)
        assert all(list(o) == greedy(dirs["v1"], PROMPT, 6) for o in g.output_ids)
    finally:
        engine.close()
        stop_servers(good, bad_pause, bad_continue)


def test_a_failing_continue_does_not_mask_the_error_that_stopped_the_update(dirs, tmp_path):
    """Loading fails, and so does the continue sent afterwards: the update's error is the
    load's (what went wrong first), not the continue's."""

    def failing_load(model, path):
        raise OSError(f"cannot read {path} (a test fault)")

    srv = engine_server(dirs["v0"], load_weights=failing_load)
    srv.engine.resume = _failing("resume")
    engine = _engine([srv])
    try:
        with pytest.raises(WeightUpdateError, match="cannot read") as e:
            engine.update_weights(dirs["v1"], 1)
        assert (e.value.url, e.value.step) == (srv.url, "update_weights_from_disk")
        assert engine.version == 0
    finally:
        engine.close()
        stop_servers(srv)


@pytest.mark.slow  # two servers, retried generations (~6 s)
def test_a_server_answering_5xx_is_retried_elsewhere_and_loads_are_released(dirs):
    """What StaticServers got wrong: one 5xx ended the generation (and the executor with
    it); the server that failed was tried again; load assigned to a server only grew.
    Here one server answers every /generate with 500 while its /health stays fine."""
    from realhf.base.net.http_server import ServerThread
    from realhf.impl.model.gen.http_app import create_app

    flaky, steady = engine_server(dirs["v0"]), engine_server(dirs["v0"])
    inner = create_app(flaky.engine)
    refused = []

    async def generate_fails(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate":
            refused.append(1)
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": "a test fault"}'})
            return
        await inner(scope, receive, send)

    front = ServerThread(generate_fails).start()
    engine = _engine([front, steady])  # least_requests: it reads /metrics at health checks
    try:
        groups = _generate(engine, 3)
        assert refused, "no request reached the failing server: the test proved nothing"
        assert all(list(o) == greedy(dirs["v0"], PROMPT, 6) for g in groups for o in g.output_ids)
        # Still in service (it is healthy), and what was scheduled on it was not kept
        # against it forever: the next /metrics read replaced the estimate.
        assert sorted(s.url for s in engine.pool.live()) == sorted([front.url, steady.url])
        time.sleep(0.6)
        assert [s.assigned_requests for s in engine.pool.servers.values()] == [0, 0]
        assert engine.partial.stats["server_failures"] >= len(refused)
    finally:
        engine.close()
        front.stop()
        stop_servers(flaky, steady)


def test_the_engine_takes_every_generate_setting_of_its_config():
    """InferenceEngineConfig.request_timeout_s never reached the engine of the lite example
    (only new_tokens_per_chunk was passed); from_config passes all of them, and the example
    uses it."""
    import ast
    import dataclasses
    import inspect
    import os

    import fastapi
    from fastapi.responses import PlainTextResponse

    from areal.api import workflow_api
    from areal.api.cli_args import InferenceEngineConfig
    from realhf.base.net.http_server import ServerThread

    async def ok(request):
        return PlainTextResponse("")

    app = fastapi.FastAPI()  # a server that is healthy and idle
    for path in ("/health", "/metrics"):
        app.router.add_route(path, ok)
    srv = ServerThread(app).start()
    config = InferenceEngineConfig(request_timeout_s=7.5, new_tokens_per_chunk=5)
    engine = RemoteInferenceEngine.from_config([srv.url], config, seed=3)
    try:
        assert engine.partial.request_timeout_s == 7.5
        assert engine.partial.chunk == 5
    finally:
        engine.close()
        srv.stop()
    # Every field is read by the engine or by the workflow executor: none is dropped.
    readers = inspect.getsource(RemoteInferenceEngine.from_config) + inspect.getsource(
        workflow_api.WorkflowExecutor
    )
    for f in dataclasses.fields(InferenceEngineConfig):
        assert f"config.{f.name}" in readers, f"InferenceEngineConfig.{f.name} is read nowhere"
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lite")
    with open(os.path.join(example, "grpo_tiny.py")) as f:
        calls = [
            ast.unparse(node)
            for node in ast.walk(ast.parse(f.read()))
            if isinstance(node, ast.Call) and "RemoteInferenceEngine" in ast.unparse(node.func)
        ]
    assert calls and all("from_config" in c and "cfg.rollout" in c for c in calls), (
        f"examples/lite/grpo_tiny.py builds its engine without its config: {calls}"
    )
