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
