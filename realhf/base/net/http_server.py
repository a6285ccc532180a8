"""Serve an ASGI app (FastAPI) under uvicorn: in a background thread or on the caller's loop.

One helper for every HTTP service of the system (generation servers, the gserver manager,
``python -m realhf.apps.serve``), so all of them share the same settings:

- **keep-alive**: servers keep idle connections :data:`SERVER_KEEPALIVE_S` (75 s), clients drop
  theirs after :data:`CLIENT_KEEPALIVE_S` (30 s).  With uvicorn's 5 s default the server closed
  pooled connections that a client was just reusing, and requests failed with "server
  disconnected"; the server must always be the side that waits longer.
- **lifespan on**: an app's FastAPI ``lifespan`` runs before the socket serves and after it
  stops, so a service can start and close what its routes need there.  A lifespan that fails
  fails the start with its error (uvicorn itself only logs it and exits the process).
- **bounded waits**: start-up (lifespan plus listening) and shutdown (graceful drain of open
  requests) each have a timeout, and a timeout names what was being waited for.
- **bind first**: the listening socket is bound in the caller, so a taken port is an
  ``OSError`` naming the address right away, and ``port`` is known even after ``stop``.
- **bounded requests**: an app bounds the requests it handles at once with
  :class:`RequestLimit`; beyond the bound a request is answered ``503`` at once, with
  ``Retry-After`` and a JSON reason, before its body is read (uvicorn's own
  ``limit_concurrency`` also counts idle keep-alive connections and answers in plain text).
- **authentication**: a route that changes a run's state or reveals its internals wants the
  run's token (:func:`require_run_token`, a FastAPI dependency); a generation route wants
  the app's api key when it has one (:func:`require_api_key`, :func:`generation_api_keys`:
  on by default when the server listens beyond loopback).  Either answers ``401`` otherwise.
  The run's own clients send :func:`auth_headers`.  Health checks and metrics stay open:
  they change nothing and reveal load figures only, and a load balancer or Prometheus
  must be able to read them without the run's secret.

:class:`ServerThread` runs a server in a daemon thread with its own event loop;
:func:`serve_until_started` starts one on the running loop (for a process whose main job is
serving, or for a service whose other tasks share the loop).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import threading
import time
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import httptools  # noqa: F401  (uvicorn runs it: http="httptools" below)
import uvicorn
from fastapi import HTTPException, Request

from realhf.base import logging
from realhf.base.net import auth

logger = logging.getLogger("http_server", "system")

__all__ = [
    "SERVER_KEEPALIVE_S",
    "CLIENT_KEEPALIVE_S",
    "GRACEFUL_SHUTDOWN_S",
    "OVERLOADED_RETRY_AFTER_S",
    "StartupError",
    "RequestLimit",
    "auth_headers",
    "is_loopback",
    "generation_api_keys",
    "bearer_refusal",
    "run_token_refusal",
    "require_run_token",
    "require_api_key",
    "listen_socket",
    "make_server",
    "serve_until_started",
    "ServerThread",
]

#: seconds an idle HTTP connection stays open on the server; clients must drop theirs sooner
SERVER_KEEPALIVE_S = 75
#: seconds a client keeps an idle pooled connection (below SERVER_KEEPALIVE_S)
CLIENT_KEEPALIVE_S = 30
#: seconds a stopping server lets open requests finish before cancelling them; long-polls
#: (the manager's held ``/finish_rollout``) would otherwise delay a shutdown by their full wait
GRACEFUL_SHUTDOWN_S = 5.0


#: the ``Retry-After`` of a request refused by a :class:`RequestLimit`
OVERLOADED_RETRY_AFTER_S = 1


class StartupError(RuntimeError):
    """The server exited before it served (its lifespan start-up failed, or uvicorn did)."""


class RequestLimit:
    """At most ``max_requests`` HTTP requests of an app in flight; more are refused with 503.

    Every request in flight holds memory until it is answered (its body, the parsed request,
    a task, in a generation server its place in the engine's queue), so a server without a
    bound grows with its clients' concurrency.  Beyond the bound a request is answered at
    once, before its body is read, with ``503``, ``Retry-After:``
    :data:`OVERLOADED_RETRY_AFTER_S` and ``{"error": {"message": <why>, "type":
    "overloaded"}}``.  The app never saw it, so a client may send it again unchanged (a 503
    with ``Retry-After`` means exactly that; the gserver manager's client does).

    ``exempt_paths`` are served whatever the load: health checks (a refused one would get an
    overloaded server declared dead) and control calls (a refused weight update would fail
    the run).  They are cheap and come from few callers.

    Install with :meth:`install` before the app serves; the counters (``in_flight``,
    ``peak``, ``refused``) are read on the app's loop, or racily from elsewhere for reports.
    """

    def __init__(self, max_requests: int, exempt_paths: Iterable[str] = (), name: str = "server"):
        if not isinstance(max_requests, int) or isinstance(max_requests, bool) or max_requests < 1:
            raise ValueError(
                f"max_concurrent_requests={max_requests!r} is invalid: use an integer >= 1"
            )
        self.max_requests = max_requests
        self.exempt_paths = frozenset(exempt_paths)
        self.name = name
        self.in_flight = 0
        self.peak = 0
        self.refused = 0
        self._warned_at = -float("inf")

    def install(self, app: Any) -> "RequestLimit":
        """Add the limit to a Starlette/FastAPI ``app`` (outside its routing); returns self."""
        app.add_middleware(_RequestLimitMiddleware, limit=self)
        return self

    def stats(self) -> dict:
        """The counters and the bound, for reports."""
        return {
            "max_concurrent_requests": self.max_requests,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak,
            "refused": self.refused,
        }

    def _refusal(self) -> bytes:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= 10.0:  # a flood must not become a flood of log lines
            logger.warning(
                f"{self.name} is overloaded: {self.in_flight} requests in flight, more are "
                f"refused with 503 (max_concurrent_requests={self.max_requests}; "
                f"{self.refused} refused so far)"
            )
            self._warned_at = now
        message = (
            f"{self.name} is overloaded: {self.in_flight} requests are in flight "
            f"(max_concurrent_requests={self.max_requests}); "
            f"retry in {OVERLOADED_RETRY_AFTER_S} s"
        )
        return json.dumps({"error": {"message": message, "type": "overloaded"}}).encode()


class _RequestLimitMiddleware:
    """The ASGI side of :class:`RequestLimit` (one app, one event loop: no lock needed)."""

    def __init__(self, app: Any, limit: RequestLimit):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        limit = self.limit
        if scope["type"] != "http" or scope["path"] in limit.exempt_paths:
            return await self.app(scope, receive, send)
        if limit.in_flight >= limit.max_requests:
            body = limit._refusal()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(OVERLOADED_RETRY_AFTER_S).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        limit.in_flight += 1
        limit.peak = max(limit.peak, limit.in_flight)
        try:
            await self.app(scope, receive, send)
        finally:
            limit.in_flight -= 1


# ---- authentication ---------------------------------------------------------------


def auth_headers() -> Dict[str, str]:
    """``{"Authorization": "Bearer <the run's token>"}``: what the run's own clients send to
    its HTTP servers (control routes need it; generation routes accept it as an api key)."""
    return {"Authorization": f"Bearer {auth.http_token()}"}


def is_loopback(host: Optional[str]) -> bool:
    """Whether a server listening on ``host`` can be reached from this machine only.

    ``""`` and ``0.0.0.0`` listen everywhere; a host name counts as loopback only when every
    address it resolves to is (``localhost`` usually; a name that does not resolve does not).
    """
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def generation_api_keys(api_key: Optional[str], host: Optional[str]) -> Optional[Tuple[str, ...]]:
    """The keys a server's generation routes accept (``None``: they are open).

    ``api_key`` as in ``GenerationServerConfig.api_key``: ``None`` is the default — the run's
    token on a server that listens beyond loopback (anyone on the network could generate
    otherwise), open on loopback (only this machine's users, who reach the run's files
    anyway); ``""`` opens them wherever the server listens; any other string is a key that
    external clients may send, and the run's token stays accepted so that the run's own
    clients need not know it.
    """
    if api_key == "":
        return None
    if api_key is None:
        return None if is_loopback(host) else (auth.http_token(),)
    return (auth.http_token(), api_key)


def _bearer_matches(authorization: Optional[str], keys: Sequence[str]) -> bool:
    # Every key is compared (no early exit): the time taken says nothing about which matched.
    ok = False
    for key in keys:
        ok |= auth.bearer_ok(authorization, key)
    return ok


def bearer_refusal(
    authorization: Optional[str], keys: Optional[Sequence[str]], what: str
) -> Optional[str]:
    """Why a request with this ``Authorization`` header is refused, or None if it may pass.

    ``keys`` are the accepted bearer tokens (None or empty: no check); ``what`` names what
    the route wants (for the message).  The message says how to get in, never a key.
    """
    if not keys or _bearer_matches(authorization, keys):
        return None
    got = "no Authorization header" if not authorization else "a wrong or malformed token"
    return (
        f"{what} is required ({got}): send 'Authorization: Bearer <token>'; the run's own "
        "processes send realhf.base.net.auth.http_token(), derived from the run's secret "
        f"(${auth.SECRET_FILE_ENV} or ${auth.SECRET_ENV}); a process started without that "
        "secret, or with another run's, is refused"
    )


def _unauthorized(message: str) -> HTTPException:
    # FastAPI answers it as {"detail": message}, the shape of its own 4xx answers.
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def run_token_refusal(request: Request) -> Optional[HTTPException]:
    """The 401 for a request without the run's token, None for one with it.

    What :func:`require_run_token` raises; an app's handler of malformed bodies calls it
    first, because FastAPI parses a JSON body before it runs the route's dependencies, and
    a request without the token must learn nothing about what its body should be.
    """
    why = bearer_refusal(
        request.headers.get("authorization"), (auth.http_token(),), "this run's token"
    )
    return None if why is None else _unauthorized(f"{request.method} {request.url.path}: {why}")


async def _check_run_token(request: Request) -> None:
    # async: FastAPI runs a plain ``def`` dependency in its thread pool.
    refused = run_token_refusal(request)
    if refused is not None:
        raise refused


async def _check_api_key(request: Request) -> None:
    keys = getattr(request.app.state, "api_keys", None)
    why = bearer_refusal(request.headers.get("authorization"), keys, "this server's api key")
    if why is not None:
        raise _unauthorized(f"{request.method} {request.url.path}: {why}")


def require_run_token() -> Any:
    """A FastAPI dependency (``APIRouter(dependencies=[require_run_token()])``): the request
    must carry the run's token (:func:`auth_headers`), else ``401`` with the reason.

    For every route that changes a run's state or reveals its internals (pause, weight
    updates, rollout allocation, status): without it anyone who reaches the port could
    stall the run or load weights of their choosing.
    """
    import fastapi

    return fastapi.Depends(_check_run_token)


def require_api_key() -> Any:
    """A FastAPI dependency for generation routes: when the app has keys
    (``app.state.api_keys``, from :func:`generation_api_keys`; None or unset: open), the
    request must carry one of them as a bearer token, else ``401``."""
    import fastapi

    return fastapi.Depends(_check_api_key)


def fastapi_app(**kwargs):
    """``fastapi.FastAPI(**kwargs)`` without FastAPI's native OpenTelemetry hooks (0.165+).

    With no telemetry provider configured they still looked three providers up per request,
    each an environment lookup that raises and catches ``KeyError``: about a third of the
    generation server's event-loop time at ~200 requests/s (py-spy, 2026-11-26).
    """
    import inspect

    import fastapi

    if "telemetry" in inspect.signature(fastapi.FastAPI.__init__).parameters:
        kwargs.setdefault("telemetry", {"tracing": False, "metrics": False, "logs": False})
    return fastapi.FastAPI(**kwargs)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0 = any free one), not yet listening.

    Raises ``OSError`` naming the address when it cannot be bound.
    """
    try:
        infos = socket.getaddrinfo(
            host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise OSError(
            f"cannot listen on {host}:{port}: the host does not resolve ({e}); "
            "pass an IP address or a resolvable host name"
        ) from None
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        # A restarted server must be able to take its port back while connections of its
        # previous incarnation linger in TIME_WAIT (Linux still refuses a second listener).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"cannot listen on {host}:{port}: {e.strerror}; "
            "pick another port, or 0 for any free one",
        ) from None
    return sock


class _StartupProbe:
    """ASGI wrapper that remembers why the app's lifespan start-up failed.

    Starlette reports a failing lifespan to uvicorn as a ``lifespan.startup.failed`` message
    with the traceback; uvicorn only logs it, so without this the caller would learn nothing
    but "exited".
    """

    def __init__(self, app: Any):
        self.app = app
        self.failure: Optional[str] = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def probe(message):
            if message["type"] == "lifespan.startup.failed":
                self.failure = message.get("message") or "no message"
            await send(message)

        return await self.app(scope, receive, probe)


def make_server(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    log_level: str = "warning",
    graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S,
) -> uvicorn.Server:
    """A uvicorn server of ``app`` with the shared settings (see the module docstring)."""
    config = uvicorn.Config(
        _StartupProbe(app),
        host=host,
        port=port,
        log_level=log_level,
        interface="asgi3",
        # C parser (httptools, a dependency) rather than the pure-Python h11 that "auto"
        # falls back to silently: ~15 % less event-loop CPU per generation request.
        http="httptools",
        lifespan="on",
        timeout_keep_alive=SERVER_KEEPALIVE_S,  # longer than clients keep theirs, see above
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    return uvicorn.Server(config)


def _describe(server: uvicorn.Server, sock: socket.socket) -> str:
    try:
        host, port = sock.getsockname()[:2]
    except OSError:  # closed already
        host, port = server.config.host, server.config.port
    return f"{host}:{port}"


async def serve_until_started(
    server: uvicorn.Server,
    sock: socket.socket,
    timeout: float,
    name: str = "HTTP server",
) -> "asyncio.Task[None]":
    """Start ``server`` on ``sock`` (from :func:`listen_socket`) on the running loop.

    Returns the serving task once the app's lifespan start-up finished and the socket
    accepts connections; ``server.should_exit = True`` then stops it (the task ends after a
    graceful drain).  Raises :class:`StartupError` (with the lifespan's error) when the
    server exited first and ``TimeoutError`` when it did not come up within ``timeout``
    seconds; either way the start is cancelled and ``sock`` closed.
    """
    where = _describe(server, sock)
    probe = server.config.app if isinstance(server.config.app, _StartupProbe) else None

    async def serve() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit:
            # uvicorn exits the process when start-up fails; in a library that must become
            # an ordinary error (a SystemExit would also tear down the whole event loop).
            failure = probe.failure if probe is not None else None
            raise StartupError(
                f"{name} exited before serving on {where}: "
                + (
                    # the last line is the exception; uvicorn logged the whole traceback
                    f"its lifespan start-up failed with {failure.strip().splitlines()[-1]}"
                    if failure
                    else "uvicorn failed to start (see its log above)"
                )
            ) from None

    loop = asyncio.get_running_loop()
    task = loop.create_task(serve(), name=f"serve {name}")
    deadline = loop.time() + timeout
    # uvicorn offers no event for "serving", only the `started` flag that it
    # sets after the lifespan start-up and listen(); 10 ms polling is cheap.
    try:
        while not server.started:
            if task.done():
                await task  # raises StartupError (or what uvicorn raised)
                raise StartupError(f"{name} returned before serving on {where}")
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"{name} did not start serving on {where} within {timeout:g} s "
                    "(waited for the app's lifespan start-up and the listening socket); "
                    "give start-up a longer timeout or find what its lifespan waits for"
                )
            await asyncio.sleep(0.01)
    except BaseException:
        if not task.done():
            task.cancel()
            # A lifespan that ignores cancellation must not turn this into a hang too.
            await asyncio.wait({task}, timeout=5.0)
        sock.close()
        raise
    return task


class ServerThread:
    """Serve an ASGI app under uvicorn in a daemon thread with its own event loop.

    ``start(timeout)`` returns once the app's lifespan start-up ran and the socket accepts
    connections, and raises why not (``OSError`` for the address, :class:`StartupError`,
    ``TimeoutError``).  ``stop(timeout)`` asks uvicorn to exit (open requests get
    ``graceful_shutdown_s`` to finish, then the lifespan shutdown runs) and joins the thread.

    Attributes:
        server: the ``uvicorn.Server``; ``config`` its ``uvicorn.Config``.
        loop: the thread's event loop once started (for ``run_coroutine_threadsafe``).
        error: what stopped the thread, if it failed.
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        name: str = "http-server",
        graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S,
    ):
        self.name = name
        self.host = host
        self._port = port
        self.server = make_server(
            app, host, port, log_level=log_level, graceful_shutdown_s=graceful_shutdown_s
        )
        self.config = self.server.config
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[BaseException] = None
        self._sock: Optional[socket.socket] = None
        self._timeout = 30.0
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def port(self) -> int:
        """The bound port (with ``port=0``, the one picked at start; kept after stop)."""
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        """Whether the serving thread is running."""
        return self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Bind, start the thread and wait until it serves (see the class docstring)."""
        if self._thread.ident is not None:
            raise RuntimeError(f"{self.name} on {self.url} was started already; make a new one")
        self._sock = listen_socket(self.host, self._port)
        self._port = self._sock.getsockname()[1]
        self._timeout = timeout
        self._thread.start()
        # The loop enforces `timeout` itself; the margin covers a loop too stuck to notice.
        if not self._up.wait(timeout + 10.0):
            self.server.should_exit = True
            raise TimeoutError(
                f"{self.name} did not start serving on {self.host}:{self.port} within "
                f"{timeout:g} s, and its event loop does not respond"
            )
        if self.error is not None:
            self._thread.join(10.0)
            raise self.error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the server down and join its thread; ``TimeoutError`` if it does not end."""
        if self._thread.ident is None:  # never started
            if self._sock is not None:
                self._sock.close()
            return
        self.server.should_exit = True  # uvicorn polls it every 0.1 s
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"{self.name} on {self.url} did not stop within {timeout:g} s "
                f"(open requests get {self.config.timeout_graceful_shutdown:g} s, then the "
                "app's lifespan shutdown runs; one of them hangs)"
            )

    def _run(self) -> None:
        try:
            # the loop uvicorn would pick itself (uvloop where installed)
            with asyncio.Runner(loop_factory=self.config.get_loop_factory()) as runner:
                runner.run(self._main())
        except BaseException as e:  # kept for start() / the owner's health checks
            if self.error is None and not isinstance(e, asyncio.CancelledError):
                self.error = e
        finally:
            self._up.set()
            if self._sock is not None:
                self._sock.close()  # uvicorn closes it after serving, not after a failed start

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            task = await serve_until_started(self.server, self._sock, self._timeout, self.name)
        except BaseException as e:
            self.error = e
            raise
        finally:
            # Set on failure too: start() waits on the event and then reads
            # self.error to tell a failed start from a successful one.
            self._up.set()
        await task
