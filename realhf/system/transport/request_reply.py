"""Request/reply between one master and N workers over ZMQ.

The master (:class:`RequestClient`) binds one ZMQ ROUTER socket and publishes
its address under ``names.request_reply_stream(experiment, trial, stream)``.
Each worker (:class:`ReplyServer`) reads that address from name_resolve,
connects a DEALER socket whose identity is its handler name
(``model_worker/0``), and says hello; the master waits until every expected
handler has said hello, so a request can never be sent into the void.

A request is a :class:`Payload` (handler, handle name, request id, data); the answer
is a :class:`Reply` with the same request id, carrying either data or an
:class:`~realhf.system.transport.errors.ErrorInfo` that the master re-raises as
:class:`~realhf.system.transport.errors.RemoteError` (worker name, handle, remote
traceback).  What a handle means is up to the two ends; the stream only carries it.
Replies are matched by exact request id, so many requests may be in flight and
collected in any order (``gather`` for sync callers, ``gather_async`` for the asyncio
master).

Syn/ack (``no_syn=False``): the worker answers a request with a SYN and holds
it until the master sends the ACK, which the master does only after *every*
handler of the call has SYNed.  Handlers then start together, which keeps
collective operations across workers in the same order.

Every receive has a timeout and its error names what was waited for.  While the
master waits for a handler (its SYN or its reply), it sends that handler a tiny ping
every :data:`LIVENESS_INTERVAL` s: the ROUTER refuses to send to a peer whose
connection is gone, so a worker that died mid-request fails the wait within about a
second (``ConnectionError`` naming it) instead of after the whole reply timeout.
ZMTP heartbeats tear the connection down when a peer's host goes silent without
closing it (a dead node), so the ping catches that too.

Wire format: messages are pickled on purpose.  They carry our own dataclasses
(and tensors' metadata) between processes of one experiment on loopback or a
trusted cluster network; never expose these sockets to untrusted peers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import pickle
import time
import uuid
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Set, Union

import zmq

from realhf.base import logging, name_resolve, names
from realhf.base.net import auth, network
from realhf.system.transport.errors import ErrorInfo, NoMessage, RemoteError, StreamTimeout

logger = logging.getLogger("request_reply_stream")

__all__ = [
    "Payload",
    "Reply",
    "RequestClient",
    "ReplyServer",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_REPLY_TIMEOUT",
]

# Defaults only; the workers pass their config's timeout.  Connecting waits for worker
# processes to start and configure (imports, model loading); a reply may wait for a
# whole MFC call, e.g. generating a large batch.
DEFAULT_CONNECT_TIMEOUT = 120.0
DEFAULT_REPLY_TIMEOUT = 300.0
# Seconds between liveness pings to a handler the master is waiting on.
LIVENESS_INTERVAL = 1.0
# ZMTP heartbeat: ping every 5 s, drop a connection silent for 30 s (dead host).
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class Payload:
    """A request from the master to one worker.

    Attributes:
        handler: the worker that handles it, e.g. ``"model_worker/0"``.
        handle_name: what to do (the worker dispatches on it), e.g. ``"train_step"``.  A
            str-valued :class:`enum.Enum` member is accepted and stored as its value, so
            only plain strings cross the wire and the receiver needs no enum to read them.
        data: the argument; any picklable object (metadata, not big tensors).
        request_id: unique id; the reply carries the same one.
        no_syn: False to use the syn/ack handshake (see module docstring).
    """

    handler: str
    handle_name: str
    data: Any = None
    request_id: str = dataclasses.field(default_factory=_new_id)
    no_syn: bool = True

    def __post_init__(self):
        if isinstance(self.handle_name, enum.Enum):
            object.__setattr__(self, "handle_name", self.handle_name.value)
        for field in ("handler", "handle_name", "request_id"):
            v = getattr(self, field)
            if not isinstance(v, str) or not v:
                raise ValueError(f"Payload.{field} must be a non-empty str, got {v!r}.")


@dataclasses.dataclass(frozen=True)
class Reply:
    """A worker's answer to one :class:`Payload`.

    ``error`` is set (and ``data`` None) when the handle raised.
    """

    request_id: str
    handler: str
    handle_name: str
    data: Any = None
    error: Optional[ErrorInfo] = None

    def result(self) -> Any:
        """``data``, or raise :class:`RemoteError` if the worker failed."""
        if self.error is not None:
            raise RemoteError(self.error)
        return self.data


# Control messages of the stream itself (never seen by users).
@dataclasses.dataclass(frozen=True)
class _Hello:
    handler: str


@dataclasses.dataclass(frozen=True)
class _Syn:
    request_id: str
    handler: str


@dataclasses.dataclass(frozen=True)
class _Ack:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _Ping:
    """Liveness probe from the master; handlers drop it."""


#: The MAC domain of this channel's messages (see :mod:`realhf.base.net.auth`).
STREAM_KIND = b"request_reply"


def _send_signed(sock: zmq.Socket, msg, flags: int = 0, prefix: Sequence[bytes] = ()) -> None:
    """Pickle ``msg`` and send it with the run's MAC (after ``prefix`` frames)."""
    auth.send(sock, STREAM_KIND, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), flags, prefix)


def _recv_signed(sock: zmq.Socket, where: str, n_prefix: int = 0):
    """The next message, unpickled only after its MAC checks out; None if it was dropped."""
    got = auth.recv(sock, STREAM_KIND, where, n_prefix)
    if got is None:
        return None
    buf = got[1]
    try:
        return pickle.loads(buf)
    except Exception as e:
        raise RuntimeError(
            f"{where}: could not unpickle a message ({len(buf)} bytes): {e!r}. Both "
            "ends must run the same realhf code."
        ) from e


def _ms(timeout: Optional[float]) -> int:
    # zmq polls in whole milliseconds and 0 means "don't wait": round a short positive
    # timeout up to 1 ms so it still waits.
    return 0 if timeout is None or timeout <= 0 else max(1, int(timeout * 1000))


class RequestClient:
    """The master's end: send :class:`Payload` s, collect :class:`Reply` s.

    Args:
        experiment_name, trial_name: the run (keys live under its trial root).
        stream_name: name of this stream (a run may have several).
        handlers: the worker names expected to connect.
        connect_timeout: seconds to wait for every handler's hello.
        reply_timeout: default seconds to wait for replies.
        host: address to bind; default :func:`realhf.base.net.network.gethostip`.
        wait: wait for the handlers in the constructor; pass False to only
            bind and publish (e.g. in ``_configure``, before the workers
            connect) and call :meth:`wait_for_handlers` later.

    Raises:
        StreamTimeout: naming the handlers that never connected.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        stream_name: str,
        handlers: Sequence[str],
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
        host: Optional[str] = None,
        wait: bool = True,
    ):
        handlers = list(handlers)
        if not handlers or len(set(handlers)) != len(handlers):
            raise ValueError(
                f"RequestClient needs a non-empty list of distinct handler names, got {handlers!r}."
            )
        if reply_timeout <= 0:
            raise ValueError(f"reply_timeout must be > 0 seconds, got {reply_timeout!r}.")
        self.stream_name = stream_name
        self.handlers = handlers
        self.reply_timeout = reply_timeout
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Sending to a handler that is not connected raises instead of
        # silently dropping the message.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A worker that reconnects with the same name takes over its identity.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        host = host or network.gethostip()
        self._sock.bind(f"tcp://{host}:*")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._key = names.request_reply_stream(experiment_name, trial_name, stream_name)
        name_resolve.add(self._key, self.address, replace=True)
        self._connected: Set[str] = set()
        self._syns: Set[str] = set()
        self._replies: Dict[str, Reply] = {}
        self._pending: Dict[str, Payload] = {}
        self._last_ping: Dict[str, float] = {}
        self._closed = False
        if wait:
            try:
                self.wait_for_handlers(connect_timeout)
            except BaseException:
                self.close()
                raise

    # ---- receiving ------------------------------------------------------

    def _recv_once(self, timeout: Optional[float]) -> bool:
        """Receive and file one message; False if none came within ``timeout``."""
        if not self._sock.poll(_ms(timeout), zmq.POLLIN):
            return False
        # Every message names its handler itself; the ROUTER's identity frame is not needed.
        msg = _recv_signed(self._sock, f"stream {self.stream_name!r} (master)", n_prefix=1)
        if msg is None:  # dropped: not signed with this run's secret
            pass
        elif isinstance(msg, _Hello):
            if msg.handler not in self.handlers:
                logger.warning(
                    f"Stream {self.stream_name!r}: unexpected handler {msg.handler!r} "
                    f"connected (expected {self.handlers})."
                )
            self._connected.add(msg.handler)
        elif isinstance(msg, _Syn):
            self._syns.add(msg.request_id)
        elif isinstance(msg, Reply):
            # Filed by request id, not handed to a waiter: the reply may belong to a
            # coroutine other than the one whose poll received it (see gather_async).
            self._pending.pop(msg.request_id, None)
            self._replies[msg.request_id] = msg
        else:
            logger.warning(f"Stream {self.stream_name!r}: ignoring unknown message {type(msg)}.")
        return True

    def _drain(self) -> None:
        while self._recv_once(0):
            pass

    def all_connected(self) -> bool:
        """Whether every handler has connected (non-blocking)."""
        self._drain()
        return set(self.handlers) <= self._connected

    def wait_for_handlers(self, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Block until every handler has connected (StreamTimeout names the rest)."""
        deadline = time.monotonic() + timeout
        while not set(self.handlers) <= self._connected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(self.handlers) - self._connected)
                raise StreamTimeout(
                    f"Stream {self.stream_name!r}: handlers {missing} did not connect "
                    f"within {timeout:g}s (address {self.address} under key {self._key!r}). "
                    "Check that those workers started and use the same name-resolve backend.",
                    waited_for=", ".join(missing),
                )
            self._recv_once(min(left, 0.5))

    # ---- sending --------------------------------------------------------

    def _send(self, handler: str, msg, flags: int = 0, waiting_for: str = "") -> None:
        if handler not in self.handlers:
            raise ValueError(
                f"Stream {self.stream_name!r} has no handler {handler!r}; known handlers: "
                f"{self.handlers}."
            )
        try:
            _send_signed(self._sock, msg, flags, prefix=(handler.encode(),))
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                during = f" while the master waited for {waiting_for}" if waiting_for else ""
                raise ConnectionError(
                    f"Stream {self.stream_name!r}: handler {handler!r} is not connected"
                    f"{during} (its process may have exited; see its log)."
                ) from e
            raise

    def _check_alive(self, request_ids: Iterable[str], syn: bool = False) -> None:
        """Ping each handler still owing one of ``request_ids`` (at most once per
        :data:`LIVENESS_INTERVAL`); ConnectionError if its connection is gone."""
        now = time.monotonic()
        for rid in request_ids:
            p = self._pending.get(rid)
            if p is None or (syn and rid in self._syns) or rid in self._replies:
                continue
            if now - self._last_ping.get(p.handler, 0.0) < LIVENESS_INTERVAL:
                continue
            self._last_ping[p.handler] = now
            what = f"{'the SYN of ' if syn else ''}{p.handle_name!r} from {p.handler}"
            try:
                self._send(p.handler, _Ping(), zmq.NOBLOCK, waiting_for=what)
            except zmq.Again:  # its queue is full: connected, just busy
                pass
            except ConnectionError:
                # A handler that answered and then exited (a "stop") is gone from the
                # ROUTER's routing table possibly before its answer was read: read what
                # is queued, and call it lost only if the answer is not there.
                self._drain()
                if rid not in self._replies and not (syn and rid in self._syns):
                    raise

    def post(self, payload: Payload) -> str:
        """Send one request without syn/ack; return its request id."""
        if not payload.no_syn:
            raise ValueError(
                "post() sends without syn/ack; use request(..., no_syn=False) for a "
                "synchronised call over several handlers."
            )
        self._pending[payload.request_id] = payload
        self._send(payload.handler, payload)
        return payload.request_id

    def request(
        self,
        handlers: Sequence[str],
        handle_name: Union[str, enum.Enum],
        datas: Optional[Sequence[Any]] = None,
        *,
        no_syn: bool = True,
        timeout: Optional[float] = None,
    ) -> List[str]:
        """Send ``handle_name`` to each handler; return the request ids in order.

        ``datas`` holds one entry per handler (default: None for each).  With
        ``no_syn=False`` this returns only after every handler has SYNed and been ACKed
        (within ``timeout``, default ``reply_timeout``).
        """
        handlers = list(handlers)
        unknown = [h for h in handlers if h not in self.handlers]
        if unknown:
            raise ValueError(
                f"Stream {self.stream_name!r} has no handler {unknown[0]!r}; known handlers: "
                f"{self.handlers}."
            )
        datas = [None] * len(handlers) if datas is None else list(datas)
        if len(datas) != len(handlers):
            raise ValueError(
                f"request({handle_name!r}): datas has {len(datas)} entries for "
                f"{len(handlers)} handlers; give one per handler."
            )
        payloads = [
            Payload(handler=h, handle_name=handle_name, data=d, no_syn=no_syn)
            for h, d in zip(handlers, datas)
        ]
        for p in payloads:
            self._pending[p.request_id] = p
            self._send(p.handler, p)
        if not no_syn:
            self._syn_ack(payloads, timeout if timeout is not None else self.reply_timeout)
        return [p.request_id for p in payloads]

    def _syn_ack(self, payloads: List[Payload], timeout: float) -> None:
        ids = {p.request_id for p in payloads}
        deadline = time.monotonic() + timeout
        while not ids <= self._syns:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(p.handler for p in payloads if p.request_id not in self._syns)
                raise StreamTimeout(
                    f"Stream {self.stream_name!r}: no SYN for {payloads[0].handle_name!r} "
                    f"from {missing} within {timeout:g}s.",
                    waited_for=", ".join(missing),
                )
            self._check_alive(ids, syn=True)
            self._recv_once(min(left, 0.5))
        # Only now, with every handler holding its request, may any of them start: a
        # handler that started early could enter a collective its peers have not reached.
        self._syns -= ids
        for p in payloads:
            self._send(p.handler, _Ack(p.request_id))

    # ---- collecting -----------------------------------------------------

    def _describe(self, request_ids: Iterable[str]) -> str:
        parts = []
        for rid in request_ids:
            p = self._pending.get(rid)
            parts.append(f"{p.handle_name!r} from {p.handler}" if p else f"request {rid}")
        return "; ".join(parts)

    def _try_collect(self, wanted: Sequence[str], raise_remote: bool) -> Optional[List[Reply]]:
        """Receive what is queued; return the wanted replies if all have arrived."""
        self._drain()
        if raise_remote:
            # Raise on the first error without waiting for the other replies: a worker that
            # failed stops serving, and its peers may hang in a collective with it, so the
            # rest may never come.
            for r in wanted:
                rep = self._replies.get(r)
                if rep is not None and rep.error is not None:
                    del self._replies[r]
                    raise RemoteError(rep.error)
        if all(r in self._replies for r in wanted):
            return [self._replies.pop(r) for r in wanted]
        return None

    def _timeout(self, wanted: Sequence[str], timeout: float) -> StreamTimeout:
        missing = self._describe(r for r in wanted if r not in self._replies)
        return StreamTimeout(
            f"Stream {self.stream_name!r}: no reply within {timeout:g}s for {missing}.",
            waited_for=missing,
        )

    def poll(self, request_id: str, timeout: Optional[float] = None) -> Reply:
        """The reply to ``request_id`` (waits up to ``timeout``; 0 = don't wait).

        A reply carrying an error is returned, not raised (see :meth:`Reply.result`).

        Raises:
            NoMessage: ``timeout == 0`` and the reply has not arrived.
            StreamTimeout: no reply within ``timeout`` (names the handler).
        """
        if timeout == 0:
            got = self._try_collect([request_id], raise_remote=False)
            if got is None:
                raise NoMessage(self._describe([request_id]))
            return got[0]
        return self.gather([request_id], timeout=timeout, raise_remote=False)[0]

    def gather(
        self,
        request_ids: Sequence[str],
        timeout: Optional[float] = None,
        raise_remote: bool = True,
    ) -> List[Reply]:
        """Wait for the replies to ``request_ids``; return them in that order.

        Raises:
            RemoteError: as soon as one reply carries an error (if ``raise_remote``).
            StreamTimeout: naming the handlers still owing a reply.
        """
        timeout = self.reply_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        wanted = list(request_ids)
        while True:
            got = self._try_collect(wanted, raise_remote)
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout(wanted, timeout)
            self._check_alive(wanted)
            self._recv_once(min(left, 0.5))

    async def gather_async(
        self,
        request_ids: Sequence[str],
        timeout: Optional[float] = None,
        raise_remote: bool = True,
    ) -> List[Reply]:
        """:meth:`gather` for asyncio callers: yields to the loop while waiting.

        Many coroutines may await different request ids at once; each reply
        is delivered to whoever asked for its id.
        """
        timeout = self.reply_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        wanted = list(request_ids)
        sleep = 0.001
        while True:
            got = self._try_collect(wanted, raise_remote)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise self._timeout(wanted, timeout)
            self._check_alive(wanted)
            await asyncio.sleep(sleep)
            # Back off to 10 ms so an idle master does not spin.
            sleep = min(sleep * 2, 0.01)

    def call(
        self,
        handlers: Sequence[str],
        handle_name: Union[str, enum.Enum],
        datas: Optional[Sequence[Any]] = None,
        *,
        timeout: Optional[float] = None,
        **request_kwargs,
    ) -> List[Any]:
        """``request`` + ``gather``; return the replies' data (raise remote errors)."""
        ids = self.request(handlers, handle_name, datas, timeout=timeout, **request_kwargs)
        return [r.data for r in self.gather(ids, timeout=timeout)]

    def close(self) -> None:
        """Close the socket and withdraw the published address."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        try:
            name_resolve.delete(self._key)
        except Exception:  # already cleared (e.g. trial teardown)
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ReplyServer:
    """A worker's end: receive :class:`Payload` s addressed to it, send replies.

    Args:
        experiment_name, trial_name, stream_name: as for :class:`RequestClient`.
        handler_name: this worker's name; must be one the master expects.
        connect_timeout: seconds to wait for the master's address in name_resolve.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        stream_name: str,
        handler_name: str,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ):
        if not isinstance(handler_name, str) or not handler_name:
            raise ValueError(f"handler_name must be a non-empty str, got {handler_name!r}.")
        self.stream_name = stream_name
        self.handler_name = handler_name
        key = names.request_reply_stream(experiment_name, trial_name, stream_name)
        try:
            address = name_resolve.wait(key, timeout=connect_timeout)
        except TimeoutError as e:
            raise StreamTimeout(
                f"Worker {handler_name}: the master of stream {stream_name!r} did not "
                f"publish its address (key {key!r}) within {connect_timeout:g}s.",
                waited_for=f"master of stream {stream_name!r}",
            ) from e
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, handler_name.encode())
        self._sock.setsockopt(zmq.LINGER, 1000)  # let the last replies leave on close
        self._sock.connect(address)
        _send_signed(self._sock, _Hello(handler_name))
        self._ready: Deque[Payload] = deque()
        self._held: Dict[str, Payload] = {}
        self._closed = False

    def _recv_once(self, timeout: Optional[float]) -> bool:
        if not self._sock.poll(_ms(timeout), zmq.POLLIN):
            return False
        msg = _recv_signed(self._sock, f"stream {self.stream_name!r} ({self.handler_name})")
        if msg is None:  # dropped: not signed with this run's secret
            pass
        elif isinstance(msg, Payload):
            if msg.no_syn:
                self._ready.append(msg)
            else:
                # Not handed out before the ACK (see the module docstring).
                self._held[msg.request_id] = msg
                _send_signed(self._sock, _Syn(msg.request_id, self.handler_name))
        elif isinstance(msg, _Ack):
            p = self._held.pop(msg.request_id, None)
            if p is None:
                logger.warning(f"{self.handler_name}: ACK for unknown request {msg.request_id}.")
            else:
                self._ready.append(p)
        elif not isinstance(msg, _Ping):
            logger.warning(f"{self.handler_name}: ignoring unknown message {type(msg)}.")
        return True

    def poll(self, timeout: Optional[float] = 0) -> Payload:
        """The next request ready to handle (waits up to ``timeout`` s; 0 = don't wait).

        Raises:
            NoMessage: nothing ready and ``timeout`` is 0/None.
            StreamTimeout: nothing ready within ``timeout``.
        """
        deadline = time.monotonic() + (timeout or 0)
        while True:
            while self._recv_once(0):
                pass
            if self._ready:
                return self._ready.popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                if not timeout:
                    raise NoMessage(self.stream_name)
                raise StreamTimeout(
                    f"{self.handler_name}: no request on stream {self.stream_name!r} "
                    f"within {timeout:g}s.",
                    waited_for=f"master of stream {self.stream_name!r}",
                )
            self._recv_once(min(left, 0.5))

    def reply(self, request: Payload, data: Any = None) -> None:
        """Answer ``request`` with ``data``."""
        _send_signed(
            self._sock, Reply(request.request_id, self.handler_name, request.handle_name, data=data)
        )

    def reply_error(self, request: Payload, exc: BaseException) -> None:
        """Answer ``request`` with ``exc`` (and its traceback) for the master to raise."""
        info = ErrorInfo.from_exception(
            exc,
            worker=self.handler_name,
            handle_name=request.handle_name,
            request_id=request.request_id,
        )
        _send_signed(
            self._sock,
            Reply(request.request_id, self.handler_name, request.handle_name, error=info),
        )

    def close(self) -> None:
        """Close the socket (queued replies get up to 1 s to leave)."""
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
