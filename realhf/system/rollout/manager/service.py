"""The gserver manager over HTTP: the FastAPI app and the thread that serves it.

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
GET  /status                                      counters, servers, HTTP load
GET  /health                                      200
=========================  =====================  ======================  ====================

Every route but ``/health`` wants the run's token (``Authorization: Bearer``,
:func:`~realhf.base.net.http_server.require_run_token`) and answers 401 without it: allocating
and finishing rollouts drives the run's data, and ``/status`` lists its servers and counters.
``/health`` stays open (it says "ok" and nothing else) for probes that hold no secret.

Bodies are validated by FastAPI against the pydantic message classes: a malformed one gets
400 naming every wrong field (type, tuple item, range, unknown or missing field).  Errors
of the manager map to statuses through exception handlers: :class:`RolloutNotRunning` 409,
:class:`NoServerAvailable` 503.  All errors answer ``{"error": {"message": ...}}``.

Load: beyond ``GserverManagerConfig.max_concurrent_requests`` requests in flight, a request is
answered 503 with ``Retry-After`` and ``{"error": {"message", "type": "overloaded"}}`` before
it is read (:class:`~realhf.base.net.http_server.RequestLimit`; the client retries it), except
:data:`UNLIMITED_PATHS`: a refused heartbeat would cost a worker its leases.

:class:`ManagerService` serves the app from a :class:`~realhf.base.net.http_server.ServerThread`;
the app's lifespan starts the manager (it waits for its generation servers), runs its
background loops on the same event loop and closes it, so a sync worker can host it.
Rollout workers talk to it through :class:`~realhf.system.rollout.manager.client.ManagerClient`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Annotated, Any, Callable, Optional

import fastapi
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from realhf.api.core.rollout_api import (
    AllocateRequest,
    FinishRequest,
    HeartbeatRequest,
    MessageError,
    ScheduleRequest,
    ServerFailureReport,
    describe_errors,
)
from realhf.base import logging
from realhf.base.net.http_server import (
    RequestLimit,
    ServerThread,
    StartupError,
    fastapi_app,
    require_run_token,
    run_token_refusal,
)
from realhf.system.rollout.manager.routing import NoServerAvailable
from realhf.system.rollout.manager.state import GserverManager
from realhf.system.rollout.staleness import RolloutNotRunning

logger = logging.getLogger("manager_service", "system")

__all__ = ["create_manager_app", "ManagerService", "UNLIMITED_PATHS"]

#: Routes never refused for load (see the module docstring): cheap, one caller each or few.
UNLIMITED_PATHS = ("/heartbeat", "/report_server_failure", "/status", "/health")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


#: route -> its body's message class, so a 400 names the message and its field
_BODIES = {
    "/allocate_rollout": "AllocateRequest",
    "/schedule_request": "ScheduleRequest",
    "/finish_rollout": "FinishRequest",
    "/heartbeat": "HeartbeatRequest",
    "/report_server_failure": "ServerFailureReport",
}


def create_manager_app(
    manager: GserverManager,
    on_exit: Optional[Callable[[Optional[BaseException]], None]] = None,
) -> fastapi.FastAPI:
    """The FastAPI app of ``manager``; serve it on one event loop (e.g. a ServerThread).

    Its lifespan starts the manager (which waits for its generation servers), runs the
    manager's background loops while the app serves, and closes the manager at shutdown.
    ``on_exit(error)`` is called when start-up fails or the background loops end (``error``
    is None when they were cancelled or returned), so the host can stop serving and report:
    routes of a manager whose loops died would answer from stale state.
    ``app.state.request_limit`` counts the requests refused for load.
    """
    app = fastapi_app(title="realhf gserver manager", lifespan=_lifespan(manager, on_exit))
    app.state.manager = manager
    app.state.request_limit = RequestLimit(
        manager.config.max_concurrent_requests, UNLIMITED_PATHS, name="the gserver manager"
    ).install(app)
    _add_error_handlers(app)
    app.include_router(router)
    app.include_router(open_router)
    return app


def _lifespan(manager: GserverManager, on_exit):
    @contextlib.asynccontextmanager
    async def lifespan(app: fastapi.FastAPI):
        background: Optional[asyncio.Task] = None
        try:
            try:
                await manager.start()
            except BaseException as e:
                if on_exit is not None:
                    on_exit(e)
                raise
            background = asyncio.create_task(
                manager.run_background(), name="gserver manager background loops"
            )
            if on_exit is not None:
                background.add_done_callback(
                    lambda t: on_exit(None if t.cancelled() else t.exception())
                )
            yield
        finally:
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
            await manager.close()

    return lifespan


def _add_error_handlers(app: fastapi.FastAPI) -> None:
    """Errors to statuses: bad bodies 400 (401 without the run's token), rollout not running
    409, no live server 503."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: fastapi.Request, e: RequestValidationError):
        refused = run_token_refusal(request)  # see run_token_refusal: JSON is parsed first
        if refused is not None:
            return await http_exception_handler(request, refused)
        return _error(400, describe_errors(_BODIES.get(request.url.path, "request"), e.errors()))

    @app.exception_handler(MessageError)
    async def invalid_message(request: fastapi.Request, e: MessageError):
        return _error(400, str(e))

    @app.exception_handler(RolloutNotRunning)
    async def not_running(request: fastapi.Request, e: RolloutNotRunning):
        return _error(409, str(e))

    @app.exception_handler(NoServerAvailable)
    async def no_server(request: fastapi.Request, e: NoServerAvailable):
        return _error(503, str(e))


def _manager(request: fastapi.Request) -> GserverManager:
    return request.app.state.manager


Manager = Annotated[GserverManager, fastapi.Depends(_manager)]

# Handlers are `async def` on purpose: the manager is not thread-safe, and FastAPI runs
# sync handlers in a thread pool; on the loop they run between its background steps.
router = fastapi.APIRouter(dependencies=[require_run_token()])
#: routes without the token (see the module docstring)
open_router = fastapi.APIRouter()


@router.post("/allocate_rollout")
async def allocate_rollout(req: AllocateRequest, manager: Manager):
    return manager.allocate(req).to_json()


@router.post("/schedule_request")
async def schedule_request(req: ScheduleRequest, manager: Manager):
    return (await manager.schedule(req)).to_json()


@router.post("/finish_rollout")
async def finish_rollout(req: FinishRequest, manager: Manager):
    return (await manager.finish(req)).to_json()


@router.post("/heartbeat")
async def heartbeat(req: HeartbeatRequest, manager: Manager):
    return manager.heartbeat(req).to_json()


@router.post("/report_server_failure")
async def report_server_failure(req: ServerFailureReport, manager: Manager):
    return await manager.report_failure(req)


@router.get("/status")
async def status(request: fastapi.Request, manager: Manager):
    # the manager's counters, and the HTTP layer's (requests in flight, refused for load)
    return {**manager.status(), "http": request.app.state.request_limit.stats()}


@open_router.get("/health")
async def health():
    return {"status": "ok"}


class ManagerService:
    """Serve a :class:`GserverManager` on ``host:port`` from a background thread.

    ``start`` returns once the manager found its servers and the socket accepts connections
    (or raises why not: the manager's own start-up error, or a timeout); :meth:`check`
    re-raises a failure of the background loops (e.g. a
    :class:`~realhf.impl.model.gen.weight_update.WeightUpdateError`, which also stops serving);
    :meth:`call` runs a function on the service's loop; :meth:`stop` shuts everything down.
    """

    def __init__(
        self,
        manager: GserverManager,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
    ):
        self.manager = manager
        self.host = host
        self._error: Optional[BaseException] = None
        self._http = ServerThread(
            create_manager_app(manager, on_exit=self._on_exit),
            host,
            port,
            log_level=log_level,
            name="gserver-manager",
        )

    @property
    def port(self) -> int:
        """The bound port (known once started)."""
        return self._http.port

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def alive(self) -> bool:
        """Whether the service thread (HTTP and background loops) is running."""
        return self._http.alive

    def _on_exit(self, error: Optional[BaseException]) -> None:
        # Runs on the service's loop: start-up failed, or the background loops ended.
        if error is not None and self._error is None:
            self._error = error
            logger.error(f"gserver manager stopped: {error!r}", exc_info=error)
        self._http.server.should_exit = True

    def start(self, timeout: float = 360.0) -> "ManagerService":
        """Start serving; ``timeout`` covers waiting for the generation servers."""
        try:
            self._http.start(timeout)
        except StartupError:
            if self._error is not None:
                raise self._error from None  # the manager's own reason, not uvicorn's summary
            raise
        except TimeoutError as e:
            raise TimeoutError(
                f"the gserver manager did not start serving within {timeout:g}s "
                f"(it waits for its generation servers first): {e}"
            ) from None
        self.check()
        return self

    def check(self) -> None:
        """Raise the error that stopped the service, if any."""
        if self._error is not None:
            raise self._error
        if self._http.error is not None:
            raise self._http.error
        if self._http.loop is not None and not self._http.alive:
            raise RuntimeError("the gserver manager's service thread exited")

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn()`` on the service's event loop and return its result."""
        loop = self._http.loop
        if loop is None or not self._http.alive:
            return fn()

        async def run():
            return fn()

        fut = asyncio.run_coroutine_threadsafe(run(), loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the gserver manager's loop did not run {fn} within {timeout:g}s"
            ) from None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving, cancel the background loops, close the manager, join the thread."""
        self._http.stop(timeout)
