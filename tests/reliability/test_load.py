"""Load: the generation server and the gserver manager under 1,000 concurrent requests.

Every request is served (200) or refused at once with 503, ``Retry-After`` and a JSON reason;
health checks (and the manager's heartbeats) are answered while a server is saturated, it
serves normally afterwards, and the memory of the process grows by a bounded amount.

Saturation is arranged, not raced, so the counts are exact: the generation server is paused,
so the requests it admits wait in its engine; the manager gets requests whose bodies are
held back, so they stay in flight.  Latency percentiles, the peak memory of each server as
its own process and 1,000 concurrent rollouts are measured by ``benchmark/load.py``.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time

import aiohttp
import psutil
import pytest

from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.api.core.rollout_api import AllocateReply, parse_message
from realhf.api.core.rollout_config import GenerationServerConfig, GserverManagerConfig
from realhf.base.net.http_server import RequestLimit, ServerThread, auth_headers
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.system.rollout.manager.client import ManagerClient, ManagerUnavailable
from realhf.system.rollout.manager.service import create_manager_app
from realhf.system.rollout.manager.state import GserverManager

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "realhf", "assets", "tiny")
N = 1000  # concurrent requests
LIMIT = 100  # max_concurrent_requests of both servers
NEW_TOKENS = 2
#: RSS growth allowed for a 1,000-request flood, client and server in this process together
#: (measured: about 30 MB for the generation server's test, 2 MB for the manager's; a leak or
#: a copy of every request kept would show, noise does not).
RSS_GROWTH_BOUND_MB = 200


@pytest.fixture(scope="module", autouse=True)
def enough_file_descriptors():
    # Client and server share this process: two sockets per connection.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 4 * N
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"needs {need} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class PeakRSS:
    """Samples this process's RSS every 10 ms in a thread; ``growth_mb`` is peak - start."""

    def __init__(self):
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 2**20


@pytest.fixture(scope="module")
def gen_server():
    engine = load_engine(
        ASSETS, EngineConfig(max_running_requests=8, context_length=64, num_threads=1)
    ).start()
    # Compile the kernels first: their memory is not the flood's.
    warm = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    engine.generate([GenerateRequest(input_ids=(3, 4 + i), sampling=warm) for i in range(8)], 60)
    app = create_app(engine, max_concurrent_requests=LIMIT)
    srv = ServerThread(app, name="gen-server").start(60)
    srv.limit = app.state.request_limit
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close()


class Progress:
    def version(self):
        return 0

    def trained_samples(self):
        return 0


async def _until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(0.01)


def _session() -> aiohttp.ClientSession:
    # with the run's token, as the run's own clients (the manager's routes want it)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth_headers())


async def _post(session, url, body):
    """(status, JSON body, Retry-After) of one POST."""
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        return r.status, await r.json(content_type=None), r.headers.get("Retry-After")


def _assert_refused_for_load(answer):
    status, body, retry_after = answer
    assert status == 503 and retry_after == "1", answer
    assert body["error"]["type"] == "overloaded", answer
    assert f"max_concurrent_requests={LIMIT}" in body["error"]["message"], answer


def _generate_body(i: int, new_tokens: int) -> dict:
    return {
        "input_ids": [3 + i % 200, 4, 5],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
    }


def test_generation_server_admits_its_limit_and_refuses_the_rest_with_a_reason(gen_server):
    url, limit = gen_server.url, gen_server.limit

    async def go():
        async with _session() as s:
            # Hold the engine itself: the HTTP /pause_generation would answer /generate at
            # once (as aborted, the weight-update protocol's rule), not keep it in flight.
            await asyncio.to_thread(gen_server.engine.pause)
            try:
                tasks = [
                    asyncio.create_task(_post(s, url + "/generate", _generate_body(i, NEW_TOKENS)))
                    for i in range(N)
                ]
                # The first LIMIT wait in the paused engine; every other one is refused at once.
                await _until(lambda: sum(t.done() for t in tasks) >= N - LIMIT, 60, "refusals")
                refused = [t.result() for t in tasks if t.done()]
                assert len(refused) == N - LIMIT and limit.in_flight == LIMIT
                for answer in refused:
                    _assert_refused_for_load(answer)
                # Saturated, it still answers health checks and metrics (the manager would
                # otherwise declare it dead), and its engine queue holds exactly the admitted.
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    assert r.status == 200
                async with s.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(10)) as r:
                    http = (await r.json())["http"]
                    assert (http["in_flight"], http["refused"]) == (LIMIT, N - LIMIT)

                async def queued():
                    async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(10)) as r:
                        assert r.status == 200
                        line = [x for x in (await r.text()).splitlines() if "num_queue_reqs{" in x]
                        return float(line[0].split()[-1])

                deadline = time.monotonic() + 30
                while await queued() != LIMIT:
                    assert time.monotonic() < deadline, "admitted requests never reached the queue"
                    await asyncio.sleep(0.02)
            finally:
                await asyncio.to_thread(gen_server.engine.resume)
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            served = [a for a in answers if a[0] == 200]
            assert len(served) == LIMIT
            assert all(len(body["output_ids"]) == NEW_TOKENS for _, body, _ in served)

            # Not paused: a flood of one-token requests is served as fast as it can be, and
            # whatever exceeds the limit at that moment is refused; nothing else happens.
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(_post(s, url + "/generate", _generate_body(i, 1)) for i in range(N))
                ),
                120,
            )
            served = [a for a in answers if a[0] == 200]
            for a in answers:
                if a[0] != 200:
                    _assert_refused_for_load(a)
            assert len(served) >= LIMIT  # the first LIMIT to arrive are always admitted
            async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                assert r.status == 200

    with PeakRSS() as rss:
        asyncio.run(go())
    assert gen_server.alive and limit.in_flight == 0 and limit.peak == LIMIT
    assert rss.growth_mb < RSS_GROWTH_BOUND_MB, f"RSS grew {rss.growth_mb:.0f} MB"


def test_manager_admits_its_limit_refuses_the_rest_and_keeps_heartbeats_flowing(gen_server):
    cap = 64
    cfg = GserverManagerConfig(
        train_batch_size=cap,
        max_concurrent_rollouts=cap,
        max_concurrent_requests=LIMIT,
        server_wait_timeout_s=30,
    )
    manager = GserverManager(cfg, Progress(), lambda: [gen_server.url], lambda v: "")
    app = create_manager_app(manager)
    limit = app.state.request_limit
    srv = ServerThread(app, name="gserver-manager").start(60)
    url = srv.url

    async def held_allocate(s, release: asyncio.Event):
        # Headers now, the rest of the body once released: the request stays in flight.
        async def body():
            yield b'{"worker": "held", '
            await release.wait()
            yield b'"incarnation": "i"}'

        headers = {"Content-Type": "application/json"}
        async with s.post(
            url + "/allocate_rollout",
            data=body(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=120),
        ) as r:
            return r.status, await r.json()

    async def go():
        release = asyncio.Event()
        async with _session() as s:
            # 1,000 at once: each answered, and exactly `cap` rollouts admitted.
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        _post(
                            s,
                            url + "/allocate_rollout",
                            {"worker": f"w{i % 8}", "incarnation": "i"},
                        )
                        for i in range(N)
                    )
                ),
                120,
            )
            replies = [parse_message(AllocateReply, b) for st, b, _ in answers if st == 200]
            for a in answers:
                if a[0] != 200:
                    _assert_refused_for_load(a)
            assert sum(r.success for r in replies) == cap
            assert all(r.reason for r in replies if not r.success)

            # Saturated by LIMIT requests that stay in flight: the rest are refused at once,
            # heartbeats and health checks still pass.
            held = [asyncio.create_task(held_allocate(s, release)) for _ in range(LIMIT)]
            await _until(lambda: limit.in_flight == LIMIT, 30, "held requests in flight")
            answers = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        _post(s, url + "/allocate_rollout", {"worker": "w", "incarnation": "i"})
                        for _ in range(N - LIMIT)
                    )
                ),
                120,
            )
            for a in answers:
                _assert_refused_for_load(a)
            hb = await _post(s, url + "/heartbeat", {"worker": "w0", "incarnation": "i"})
            assert hb[0] == 200 and "n_rollouts" in hb[1]
            async with s.get(url + "/status", timeout=aiohttp.ClientTimeout(total=10)) as r:
                status = await r.json()
                assert r.status == 200 and status["running"] == cap
                assert (
                    status["http"]["in_flight"] == LIMIT and status["http"]["refused"] >= N - LIMIT
                )

            # The client retries a call refused for load: within its timeout it gives up
            # naming the cause, otherwise it gets through once the load is gone.
            client = ManagerClient(url, timeout_s=2)
            with pytest.raises(ManagerUnavailable, match="overloaded"):
                await client.allocate("w", "i")
            await client.close()
            client = ManagerClient(url, timeout_s=60)
            refused_before = limit.refused
            call = asyncio.create_task(client.allocate("w", "i"))
            await _until(lambda: limit.refused > refused_before, 30, "the client was refused")
            release.set()
            reply = await asyncio.wait_for(call, 60)
            await client.close()
            assert not reply.success and reply.reason  # answered: the cap is taken
            assert [st for st, _ in await asyncio.wait_for(asyncio.gather(*held), 60)] == [
                200
            ] * LIMIT

    try:
        with PeakRSS() as rss:
            asyncio.run(go())
        assert srv.alive and limit.in_flight == 0 and limit.peak == LIMIT
        assert rss.growth_mb < RSS_GROWTH_BOUND_MB, f"RSS grew {rss.growth_mb:.0f} MB"
    finally:
        srv.stop()


def test_the_bound_is_a_validated_option():
    with pytest.raises(ValueError, match="max_concurrent_requests=0 is invalid"):
        GserverManagerConfig(max_concurrent_requests=0)
    with pytest.raises(ValueError, match="max_concurrent_requests=-1 is invalid"):
        GenerationServerConfig(model_path="/m", max_concurrent_requests=-1)
    with pytest.raises(ValueError, match="max_concurrent_requests=0 is invalid"):
        RequestLimit(0)
