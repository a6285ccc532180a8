"""The gserver manager over HTTP: the FastAPI app, the thread that serves it, and the client.

Endpoints (JSON bodies are the messages of :mod:`realhf.api.core.rollout_api`):

=========================  =====================  ======================  ====================
route                      body                   answer                  errors
=========================  =====================  ======================  ====================
POST /allocate_rollout     AllocateRequest        AllocateReply
POST /schedule_request     ScheduleRequest        ScheduleReply           409 not running,
                                                                          503 no live server
POST /finish_rollout       FinishRequest          FinishReply (held up    409 not running
                                                  to ``wait_s``)
POST /heartbeat            HeartbeatRequest       HeartbeatReply
POST /report_server_failure ServerFailureReport   ``{"dead": bool}``
GET  /status                                      counters and servers
GET  /health                                      200
=========================  =====================  ======================  ====================

Malformed bodies get 400 naming the field.  :class:`ManagerService` runs the app (uvicorn)
and the manager's background loops in one event loop on a thread, so a sync worker can host
it; :class:`ManagerClient` is what rollout workers use (every call has a timeout and its
errors name the manager's URL and the endpoint).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from typing import Any, Callable, Dict, Optional, Type, TypeVar

import aiohttp
import fastapi
import uvicorn
from fastapi.responses import JSONResponse

from realhf.api.core.rollout_api import (
    AllocateReply,
    AllocateRequest,
    FinishReply,
    FinishRequest,
    HeartbeatReply,
    HeartbeatRequest,
    MessageError,
    ScheduleReply,
    ScheduleRequest,
    ServerFailureReport,
    from_json,
)
from realhf.base import logging
from realhf.impl.model.gen.http_app import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
from realhf.system.gserver_manager import GserverManager, NoServerAvailable
from realhf.system.staleness import RolloutNotRunning

logger = logging.getLogger("gserver_http", "system")

__all__ = ["create_manager_app", "ManagerService", "ManagerUnavailable", "ManagerClient"]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_manager_app(manager: GserverManager) -> fastapi.FastAPI:
    """The FastAPI app of ``manager`` (which must already be started on the same loop)."""
    app = fastapi.FastAPI(title="realhf gserver manager")

    def route(path: str, msg_cls: Optional[type], fn: Callable) -> None:
        """Serve ``fn(message)`` (POST) or ``fn()`` (GET when ``msg_cls`` is None) at ``path``."""

        async def handler(request: fastapi.Request):
            try:
                if msg_cls is None:
                    out = fn()
                else:
                    raw = await request.body()
                    try:
                        body = json.loads(raw) if raw else {}
                    except json.JSONDecodeError as e:
                        raise MessageError(f"the request body is not valid JSON: {e}") from None
                    out = fn(from_json(msg_cls, body))
                if asyncio.iscoroutine(out):
                    out = await out
            except MessageError as e:
                return _error(400, str(e))
            except RolloutNotRunning as e:
                return _error(409, str(e))
            except NoServerAvailable as e:
                return _error(503, str(e))
            return out.to_json() if hasattr(out, "to_json") else out

        handler.__name__ = path.strip("/")
        if msg_cls is None:
            app.get(path)(handler)
        else:
            app.post(path)(handler)

    route("/allocate_rollout", AllocateRequest, manager.allocate)
    route("/schedule_request", ScheduleRequest, manager.schedule)
    route("/finish_rollout", FinishRequest, manager.finish)
    route("/heartbeat", HeartbeatRequest, manager.heartbeat)
    route("/report_server_failure", ServerFailureReport, manager.report_failure)
    route("/status", None, manager.status)
    route("/health", None, lambda: {"status": "ok"})
    return app


class ManagerService:
    """Serve a :class:`GserverManager` on ``host:port`` from a background thread.

    ``start`` returns once the manager found its servers and the socket accepts connections
    (or raises why not); :meth:`check` re-raises a failure of the background loops (e.g. a
    :class:`~realhf.system.gserver_manager.WeightUpdateError`); :meth:`call` runs a function
    on the service's loop; :meth:`stop` shuts everything down.
    """

    def __init__(
        self,
        manager: GserverManager,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ):
        self.manager = manager
        self.host, self._port, self.log_level = host, port, log_level
        self._thread = threading.Thread(target=self._run, name="gserver-manager", daemon=True)
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._server: Optional[uvicorn.Server] = None
        self._bound_port = port

    @property
    def port(self) -> int:
        """The bound port (known once started)."""
        return self._bound_port

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout: float = 360.0) -> "ManagerService":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the gserver manager did not start serving within {timeout:g}s")
        self.check()
        return self

    def check(self) -> None:
        """Raise the error that stopped the service, if any."""
        if self._error is not None:
            raise self._error
        if self._ready.is_set() and not self._thread.is_alive():
            raise RuntimeError("the gserver manager's service thread exited")

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn()`` on the service's event loop and return its result."""
        if self._loop is None or not self._thread.is_alive():
            return fn()

        async def run():
            return fn()

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the gserver manager's loop did not run {fn} within {timeout:g}s"
            ) from None

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the gserver manager did not stop within {timeout:g}s")

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # kept for check(); the worker reports it
            if not isinstance(e, asyncio.CancelledError):
                self._error = e
                logger.error(f"gserver manager stopped: {e!r}", exc_info=e)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.manager.start()
            config = uvicorn.Config(
                create_manager_app(self.manager),
                host=self.host,
                port=self._port,
                log_level=self.log_level,
                lifespan="off",
                timeout_keep_alive=SERVER_KEEPALIVE_S,  # longer than clients keep theirs
            )
            self._server = uvicorn.Server(config)
            serve = asyncio.create_task(self._server.serve())
            while not self._server.started:
                if serve.done():
                    await serve
                    raise RuntimeError(f"uvicorn exited before serving on {self.host}:{self._port}")
                await asyncio.sleep(0.01)
            self._bound_port = self._server.servers[0].sockets[0].getsockname()[1]
            background = asyncio.create_task(self.manager.run_background())
            stopping = asyncio.create_task(self._stop.wait())
            self._ready.set()
            done, _ = await asyncio.wait(
                {serve, background, stopping}, return_when=asyncio.FIRST_COMPLETED
            )
            self._server.should_exit = True
            for t in (background, stopping):
                t.cancel()
            await asyncio.gather(serve, background, stopping, return_exceptions=True)
            if background in done and not background.cancelled():
                background.result()  # re-raise what stopped the loops
        finally:
            await self.manager.close()


class ManagerUnavailable(ConnectionError):
    """The gserver manager did not answer (in time)."""


R = TypeVar("R")


class UncappedSession:
    """A lazily created aiohttp session with no connection cap, closed by :meth:`close`.

    No cap because requests may be held open on purpose (held /finish_rollout calls,
    one generate request per running group member) and must never queue behind each other.
    """

    _session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ManagerClient(UncappedSession):
    """Async client of the manager's endpoints (one aiohttp session; close it when done).

    Args:
        url: ``http://host:port`` of the manager.
        timeout_s: limit of each call (a held ``/finish_rollout`` gets its ``wait_s`` on top).
    """

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _call(
        self, path: str, msg: Any, reply_cls: Optional[Type[R]], timeout: Optional[float] = None
    ) -> R:
        t = timeout or self.timeout_s
        try:
            req = (
                self.session.post(
                    self.url + path, json=msg.to_json(), timeout=aiohttp.ClientTimeout(total=t)
                )
                if msg is not None
                else self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=t))
            )
            async with req as r:
                status, text = r.status, await r.text()
        except asyncio.TimeoutError:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} did not answer {path} within {t:g}s"
            ) from None
        except aiohttp.ClientError as e:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} could not be reached for {path}: {e!r}"
            ) from None
        try:
            body = json.loads(text)
        except ValueError:
            body = {"error": {"message": text}}
        if status != 200:
            message = body.get("error", {}).get("message", text) if isinstance(body, dict) else text
            if status == 409:
                raise RolloutNotRunning(message)
            if status == 503:
                raise NoServerAvailable(message)
            raise RuntimeError(
                f"gserver manager at {self.url}: {path} answered HTTP {status}: {message}"
            )
        return body if reply_cls is None else from_json(reply_cls, body)

    async def allocate(self, worker: str, incarnation: str, qid: str = "") -> AllocateReply:
        return await self._call(
            "/allocate_rollout", AllocateRequest(worker, incarnation, qid), AllocateReply
        )

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        return await self._call("/schedule_request", req, ScheduleReply)

    async def finish(self, rollout_id: str, accepted: bool, wait_s: float = 10.0) -> FinishReply:
        return await self._call(
            "/finish_rollout",
            FinishRequest(rollout_id, accepted, float(wait_s)),
            FinishReply,
            timeout=self.timeout_s + wait_s,
        )

    async def heartbeat(self, worker: str, incarnation: str) -> HeartbeatReply:
        return await self._call("/heartbeat", HeartbeatRequest(worker, incarnation), HeartbeatReply)

    async def report_failure(self, url: str, error: str) -> Dict[str, bool]:
        return await self._call(
            "/report_server_failure", ServerFailureReport(url, error[:1000]), None
        )

    async def status(self) -> Dict[str, Any]:
        return await self._call("/status", None, None)
