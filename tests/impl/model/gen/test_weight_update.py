"""The weight-update protocol: the server's gate rules, and the client's sequence against a
real built-in server (a step that fails is named; a server that is gone is told apart)."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
import requests
from engine_servers import engine_server, generate_greedy, greedy, stop_servers, two_model_versions

from realhf.api.core.gen_api import FinishReason, GenerateOutput
from realhf.base.net import network
from realhf.base.net.http_server import auth_headers
from realhf.impl.model.gen.weight_update import (
    PauseGate,
    ServerGone,
    WeightUpdateError,
    update_server,
)


def test_the_gate_keeps_only_tokens_of_the_weights_a_request_was_admitted_under():
    g = PauseGate()
    t0 = g.ticket()
    done = GenerateOutput("r", 3, (5, 6), (-0.1, -0.2), FinishReason("length", length=2))
    aborted = dataclasses.replace(done, finish_reason=FinishReason("abort"))
    assert g.checked(t0, done) is done  # no pause meanwhile
    g.pause()
    assert g.ticket() is None  # rule 1: nothing is admitted while paused
    # Rule 2: aborted by that pause -> its tokens were all made before it: kept.
    assert g.checked(t0, aborted) is aborted
    # Finished normally although a pause began during it: it was queued across the pause
    # and ran (in part) on the new weights -> emptied, answered as aborted.
    emptied = g.checked(t0, done)
    assert (emptied.rid, emptied.prompt_len, emptied.output_ids) == ("r", 3, ())
    assert emptied.finish_reason.type == "abort" and g.discarded == 1
    g.resume()
    t1 = g.ticket()
    assert t1 == 1 and g.checked(t1, done) is done
    g.pause()
    g.resume()
    # Two pauses (a whole update) overlapped it: even an abort keeps nothing.
    assert g.checked(t0, aborted).output_ids == ()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_model_versions(tmp_path_factory.mktemp("wu"))


async def _update(url, version, path, timeout=30.0):
    async with aiohttp.ClientSession() as session:

        async def healthy(u):
            try:
                async with session.get(u + "/health", timeout=aiohttp.ClientTimeout(5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return False

        await update_server(session, url, version, path, timeout, healthy)


def _post(url, route, body=None):
    return requests.post(f"{url}/{route}", json=body or {}, headers=auth_headers(), timeout=30)


def test_the_sequence_moves_a_server_to_the_new_weights_and_leaves_it_serving(dirs):
    srv = engine_server(dirs["v0"])
    try:
        prompt = (7, 8, 9)
        assert generate_greedy(srv.url, prompt, 6) == greedy(dirs["v0"], prompt, 6)
        asyncio.run(_update(srv.url, 1, dirs["v1"]))
        st = srv.engine.stats()
        assert st["weight_version"] == 1 and not st["paused"]
        assert generate_greedy(srv.url, prompt, 6) == greedy(dirs["v1"], prompt, 6)
    finally:
        stop_servers(srv)


def test_a_failing_step_is_named_and_a_dead_server_is_told_apart(dirs, tmp_path):
    srv = engine_server(dirs["v0"])
    try:
        with pytest.raises(WeightUpdateError) as e:
            asyncio.run(_update(srv.url, 3, str(tmp_path / "missing")))
        assert (e.value.url, e.value.step, e.value.version) == (
            srv.url,
            "update_weights_from_disk",
            3,
        )
        assert "answered HTTP 400" in str(e.value) and "missing" in str(e.value)
    finally:
        stop_servers(srv)
    nobody = f"http://127.0.0.1:{network.find_free_port()}"
    with pytest.raises(ServerGone):
        asyncio.run(_update(nobody, 1, dirs["v1"], timeout=5))


def test_generate_while_paused_is_answered_at_once_as_aborted_with_no_tokens(dirs):
    srv = engine_server(dirs["v0"])
    try:
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4}}
        assert _post(srv.url, "pause_generation").status_code == 200
        r = _post(srv.url, "generate", body).json()
        assert r["output_ids"] == [] and r["meta_info"]["finish_reason"]["type"] == "abort"
        # a bad request is still refused for what it is
        bad = _post(srv.url, "generate", {"input_ids": [3], "sampling_params": {"top_p": 7}})
        assert bad.status_code == 400
        assert _post(srv.url, "continue_generation").status_code == 200
        assert len(_post(srv.url, "generate", body).json()["output_ids"]) == 4
    finally:
        stop_servers(srv)


def test_a_chunk_that_reaches_a_paused_server_is_sent_again_under_the_new_version(dirs):
    """The review's race on the built-in engine: a chunk scheduled under version 0 reaches
    the server just after the pause of an update. Held until the continue, it ran on the new
    weights while its rollout recorded version 0. The gate answers it at once as aborted
    with no tokens, so the rollout schedules it again and records the version that made it."""
    import threading
    import time

    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.api.core.rollout_api import GenerateGroupRequest, ScheduleReply
    from realhf.system.rollout.partial_rollout import PartialRolloutManager

    prompt = (10, 11, 12)
    assert greedy(dirs["v0"], prompt, 6) != greedy(dirs["v1"], prompt, 6)  # else proves nothing
    srv = engine_server(dirs["v0"])
    updated = threading.Event()

    def finish_update():
        time.sleep(0.3)  # the chunk reaches the paused server meanwhile
        assert _post(srv.url, "update_weights_from_disk", {"model_path": dirs["v1"]}).ok
        assert _post(srv.url, "continue_generation").ok
        updated.set()

    class RacingManager:
        """Schedules the first chunk under version 0 and pauses the server right after, as
        an update that begins then would; later chunks wait for the update, as the
        manager's do, and are told version 1."""

        calls = 0

        async def schedule(self, req):
            self.calls += 1
            if self.calls == 1:
                assert (await asyncio.to_thread(_post, srv.url, "pause_generation")).ok
                threading.Thread(target=finish_update, daemon=True).start()
                return ScheduleReply(srv.url, 0)
            assert await asyncio.to_thread(updated.wait, 60)
            return ScheduleReply(srv.url, 1)

        async def report_failure(self, url, error):
            return {"dead": False}

    async def rollout():
        prm = PartialRolloutManager(RacingManager(), request_timeout_s=60)
        try:
            gconfig = GenerationHyperparameters(n=1, max_new_tokens=6, greedy=True)
            return await prm.generate_member("r0", GenerateGroupRequest("q", prompt, gconfig), 0)
        finally:
            await prm.close()

    try:
        m = asyncio.run(rollout())
        # Every token is the new weights' and recorded as theirs (held and run after the
        # continue, the chunk came back as version 0's). The empty first answer still counts
        # as the start: an older start only makes the staleness bound stricter.
        assert list(m.output_ids) == greedy(dirs["v1"], prompt, 6)
        assert (m.version_start, m.version_end, m.n_interrupted) == (0, 1, 1)
    finally:
        stop_servers(srv)
