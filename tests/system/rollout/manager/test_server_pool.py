"""Server pool: discovery, health, load metrics and dead servers, against real servers."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import make_tiny_hf_model

from realhf.api.core.rollout_api import ScheduleRequest
from realhf.api.core.rollout_config import GserverManagerConfig
from realhf.base.net.http_server import ServerThread
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.impl.model.gen.weight_update import WeightUpdateError
from realhf.system.rollout.manager.routing import NoServerAvailable
from realhf.system.rollout.manager.server_pool import ServerPool


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pool") / "m")
    make_tiny_hf_model("qwen2", path, seed=0, vocab_size=268, max_position_embeddings=64)
    return path


def _server(model_dir):
    engine = load_engine(model_dir, EngineConfig(max_running_requests=2, num_threads=1)).start()
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    return srv


def test_discovery_health_metrics_and_dead_servers(model_dir):
    servers = [_server(model_dir) for _ in range(3)]
    urls = [s.url for s in servers]  # (a stopped ServerThread no longer knows its port)
    registered = list(urls)
    cfg = GserverManagerConfig(
        schedule_policy="least_token_usage", max_health_failures=2, health_timeout_s=2
    )
    pool = ServerPool(cfg, lambda: list(registered), lambda v: "")

    async def go():
        await pool.open()
        try:
            await pool.check()
            assert [s.url for s in pool.live()] == sorted(registered)
            req = ScheduleRequest("r", prompt_len=10, new_token_budget=100)
            first = pool.pick(req)
            pool.assign(first, req)  # 10 + 0.4 * 100 tokens counted until the next metrics read
            assert first.token_load == 50 and pool.pick(req) is not first
            group = ScheduleRequest("r", prompt_len=80, new_token_budget=800, n_sequences=8)
            pool.assign(first, group)  # a group's call counts its 8 sequences
            assert first.assigned_requests == 9 and first.token_load == 50 + 80 + 320
            await pool.check()  # metrics read: idle servers use no tokens
            assert first.token_load == 0 and first.assigned_requests == 0
            # one server stops answering: dead after max_health_failures checks
            servers[0].stop()
            servers[0].engine.close()
            await pool.check()
            assert pool.servers[urls[0]].live  # one failure is tolerated
            await pool.check()
            dead = pool.servers[urls[0]]
            assert not dead.live and "2 health checks" in dead.dead_reason
            # another one's registration expires
            registered.remove(urls[1])
            await pool.check()
            assert "registration" in pool.servers[urls[1]].dead_reason
            assert {pool.pick(req).url for _ in range(3)} == {urls[2]}
            # exclusion is a preference: the last live server is still used...
            assert pool.pick(ScheduleRequest("r", 1, 1, exclude=(urls[2],))).url == urls[2]
            # ...and with none live the error names why each one is out
            pool.mark_dead(pool.servers[urls[2]], "test")
            with pytest.raises(NoServerAvailable, match="registration"):
                pool.pick(ScheduleRequest("r", 1, 1, exclude=(urls[2],)))
        finally:
            await pool.close()

    try:
        asyncio.run(go())
    finally:
        for s in servers[1:]:
            s.stop()
            s.engine.close()


def _front(engine: dict):
    """A server in front of an engine (as the vLLM adapter is): its control steps answer 502;
    its health check says whether the engine behind it lives (``engine["alive"]``)."""
    import fastapi
    from fastapi.responses import JSONResponse

    app = fastapi.FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({}, status_code=200 if engine["alive"] else 503)

    @app.post("/pause_generation")
    async def pause():
        return JSONResponse({"success": False, "message": "engine did not answer"}, 502)

    return ServerThread(app).start()


@pytest.mark.parametrize("engine_alive", [False, True], ids=["engine-dead", "engine-alive"])
def test_a_5xx_step_from_a_server_whose_health_fails_counts_as_gone(tmp_path, engine_alive):
    engine = {"alive": True}
    srv = _front(engine)
    pool = ServerPool(GserverManagerConfig(health_timeout_s=5), lambda: [srv.url], lambda v: "")

    async def go():
        await pool.open()
        try:
            await pool.check()
            assert [s.url for s in pool.live()] == [srv.url]
            pool.weight_dir = lambda v: str(tmp_path)
            engine["alive"] = engine_alive
            if engine_alive:  # it may hold the old weights: the update fails, naming it
                with pytest.raises(WeightUpdateError, match="pause_generation answered HTTP 502"):
                    await pool.update_weights(1)
            else:  # gone, as an unreachable server is: no error, its replacement joins later
                await pool.update_weights(1)
                dead = pool.servers[srv.url]
                assert not dead.live and "unreachable" in dead.dead_reason
        finally:
            await pool.close()

    try:
        asyncio.run(go())
    finally:
        srv.stop()
