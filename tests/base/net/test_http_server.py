"""The shared uvicorn helper: lifespan, serving, stopping, and clear start-up failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import fastapi
import pytest
import requests

from realhf.base.net.http_server import (
    SERVER_KEEPALIVE_S,
    ServerThread,
    StartupError,
    listen_socket,
    make_server,
    serve_until_started,
)


def _app(events=None, lifespan=None) -> fastapi.FastAPI:
    @contextlib.asynccontextmanager
    async def record(app):
        events.append("startup")
        yield
        events.append("shutdown")

    app = fastapi.FastAPI(lifespan=lifespan or (record if events is not None else None))

    @app.get("/ping")
    async def ping():
        return {"pong": True}

    return app


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_settings_keep_connections_longer_than_clients_and_run_the_lifespan():
    config = make_server(_app()).config
    assert config.timeout_keep_alive == SERVER_KEEPALIVE_S == 75
    assert config.lifespan == "on"
    assert config.timeout_graceful_shutdown is not None  # stopping never waits forever


def test_starts_serves_and_stops_freeing_the_port_and_joining_the_thread():
    events = []
    srv = ServerThread(_app(events), name="test-server").start(timeout=10)
    port = srv.port
    assert port > 0 and srv.url == f"http://127.0.0.1:{port}"
    assert events == ["startup"]  # the lifespan ran before start() returned
    with requests.Session() as s:  # a pooled keep-alive connection must not block stop()
        assert s.get(srv.url + "/ping", timeout=10).json() == {"pong": True}
        srv.stop(timeout=10)
    assert not srv.alive and srv.error is None
    assert events == ["startup", "shutdown"]
    assert _refused(port) and srv.port == port  # the port is kept for messages
    again = ServerThread(_app(), port=port).start(timeout=10)  # ... and free to take again
    try:
        assert requests.get(again.url + "/ping", timeout=10).status_code == 200
    finally:
        again.stop(timeout=10)


def test_a_lifespan_that_does_not_finish_times_out_naming_what_it_waited_for():
    @contextlib.asynccontextmanager
    async def stuck(app):
        await asyncio.sleep(3600)
        yield

    srv = ServerThread(_app(lifespan=stuck), name="stuck-server")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        srv.start(timeout=0.5)
    assert time.monotonic() - t0 < 8
    msg = str(e.value)
    assert "stuck-server" in msg and f"127.0.0.1:{srv.port}" in msg and "0.5 s" in msg
    assert "lifespan start-up" in msg
    srv._thread.join(10)
    assert not srv.alive and _refused(srv.port)


def test_a_failing_lifespan_fails_start_with_its_error():
    @contextlib.asynccontextmanager
    async def broken(app):
        raise RuntimeError("the database is gone")
        yield

    srv = ServerThread(_app(lifespan=broken), name="broken-server")
    with pytest.raises(StartupError) as e:
        srv.start(timeout=10)
    assert "broken-server" in str(e.value) and "RuntimeError: the database is gone" in str(e.value)
    assert not srv.alive and _refused(srv.port)


def test_a_taken_port_is_an_os_error_naming_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}.*another port"):
            ServerThread(_app(), port=port).start(timeout=10)


def test_stop_before_start_and_double_start():
    srv = ServerThread(_app())
    srv.stop()  # nothing to do
    srv.start(timeout=10)
    try:
        with pytest.raises(RuntimeError, match="started already"):
            srv.start()
    finally:
        srv.stop(timeout=10)


def test_serve_until_started_on_the_running_loop():
    async def main():
        sock = listen_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = make_server(_app())
        task = await serve_until_started(server, sock, timeout=10, name="loop-server")
        reply = await asyncio.to_thread(requests.get, f"http://127.0.0.1:{port}/ping", timeout=10)
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        return reply.json(), port

    body, port = asyncio.run(main())
    assert body == {"pong": True} and _refused(port)
