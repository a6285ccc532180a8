"""Push/pull streams: many producers -> many consumers over ZMQ.

Used by rollout workers (producers) to stream finished trajectories to the
trainer's data heads (consumers).  Producers are split into contiguous groups,
one group per consumer (:func:`grouping`); with fewer producers than consumers
each producer instead feeds a contiguous block of consumers in turn.

Each consumer (:class:`PullerStream`) binds a PULL socket and publishes its
address under ``names.push_pull_stream(exp, trial, stream)/puller{index}``;
producers (:class:`PusherStream`) wait for the addresses of their consumers and
connect one PUSH socket per consumer.

Buffers are bounded: ``hwm`` messages per socket (send and receive side), so a
producer that outruns its consumer blocks, and ``push`` raises after
``timeout`` seconds naming the consumer that did not take the message.

Messages are arbitrary picklable objects, normally frozen dataclasses; a
consumer can pass ``message_types`` to reject anything else with a clear error.
A producer ends with :meth:`PusherStream.close` which sends
:class:`EndOfStream` to each of its consumers, so :meth:`PullerStream.iterate`
knows when every producer of its group is done.  Pickle is used on purpose:
both ends are processes of the same experiment on a trusted network.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import zmq

from realhf.base import logging, name_resolve, names
from realhf.base.net import auth, network
from realhf.system.transport.errors import NoMessage, StreamTimeout

logger = logging.getLogger("push_pull_stream")

__all__ = [
    "EndOfStream",
    "grouping",
    "consumers_of",
    "producers_of",
    "PusherStream",
    "PullerStream",
]

DEFAULT_HWM = 1000
DEFAULT_TIMEOUT = 300.0
#: The MAC domain of this channel's messages (see :mod:`realhf.base.net.auth`).
STREAM_KIND = b"push_pull"


@dataclasses.dataclass(frozen=True)
class EndOfStream:
    """Sent by producer ``producer_index`` after its last message.

    ``n_sent`` counts the messages that producer sent to this consumer.
    """

    producer_index: int
    n_sent: int


def _check_counts(n_producers: int, n_consumers: int) -> None:
    for name, v in (("n_producers", n_producers), ("n_consumers", n_consumers)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")


def grouping(n_producers: int, n_consumers: int) -> Dict[int, List[int]]:
    """Map each consumer to the contiguous block of producers that feed it.

    With ``n_producers >= n_consumers`` blocks differ in size by at most one
    (``grouping(5, 2) == {0: [0, 1], 1: [2, 3, 4]}``).  With fewer producers,
    consumer ``c`` is fed by the producer whose consumer block contains it
    (see :func:`consumers_of`), so every consumer has exactly one producer.
    """
    _check_counts(n_producers, n_consumers)
    groups: Dict[int, List[int]] = {c: [] for c in range(n_consumers)}
    for p in range(n_producers):
        for c in consumers_of(p, n_producers, n_consumers):
            groups[c].append(p)
    return groups


def consumers_of(producer_index: int, n_producers: int, n_consumers: int) -> List[int]:
    """The consumers producer ``producer_index`` sends to (a contiguous range)."""
    _check_counts(n_producers, n_consumers)
    if not 0 <= producer_index < n_producers:
        raise ValueError(
            f"producer_index {producer_index} is out of range for {n_producers} producers."
        )
    if n_producers >= n_consumers:
        return [_block_of(producer_index, n_producers, n_consumers)]
    lo = producer_index * n_consumers // n_producers
    hi = (producer_index + 1) * n_consumers // n_producers
    return list(range(lo, hi))


def _block_of(p: int, n_producers: int, n_consumers: int) -> int:
    # Consumer c takes producers [c*P//Q, (c+1)*P//Q); find the block holding p,
    # starting from the estimate p*Q//P (off by at most one).
    c = p * n_consumers // n_producers
    while (c + 1) * n_producers // n_consumers <= p:
        c += 1
    while c * n_producers // n_consumers > p:
        c -= 1
    return c


def producers_of(consumer_index: int, n_producers: int, n_consumers: int) -> List[int]:
    """The producers that send to consumer ``consumer_index``."""
    groups = grouping(n_producers, n_consumers)
    if consumer_index not in groups:
        raise ValueError(
            f"consumer_index {consumer_index} is out of range for {n_consumers} consumers."
        )
    return groups[consumer_index]


def _puller_key(experiment_name: str, trial_name: str, stream_name: str, index: int) -> str:
    return f"{names.push_pull_stream(experiment_name, trial_name, stream_name)}/puller{index}"


class PullerStream:
    """Consumer end: bind a PULL socket and publish its address.

    Args:
        consumer_index: this consumer's index in ``[0, n_consumers)``.
        hwm: receive buffer bound (messages).
        message_types: if given, any other message type is an error.
        host: address to bind; default :func:`realhf.base.net.network.gethostip`.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        stream_name: str,
        consumer_index: int,
        *,
        hwm: int = DEFAULT_HWM,
        message_types: Optional[Sequence[Type]] = None,
        host: Optional[str] = None,
    ):
        if not isinstance(consumer_index, int) or consumer_index < 0:
            raise ValueError(f"consumer_index must be an int >= 0, got {consumer_index!r}.")
        if not isinstance(hwm, int) or hwm < 1:
            raise ValueError(f"hwm must be a positive int (messages), got {hwm!r}.")
        self.stream_name = stream_name
        self.consumer_index = consumer_index
        self.message_types = tuple(message_types) if message_types else None
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host or network.gethostip()}:*")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._key = _puller_key(experiment_name, trial_name, stream_name, consumer_index)
        name_resolve.add(self._key, self.address, replace=True)
        self.ended: Dict[int, EndOfStream] = {}
        self.n_received = 0
        self._closed = False

    def pull(self, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Any:
        """The next message (an :class:`EndOfStream` marks a finished producer).

        Raises:
            NoMessage: ``timeout`` is 0/None and nothing is queued.
            StreamTimeout: nothing arrived within ``timeout``.
            TypeError: the message is not one of ``message_types``.
        """
        deadline = time.monotonic() + (timeout or 0)
        where = f"consumer {self.consumer_index} of stream {self.stream_name!r}"
        while True:
            left = deadline - time.monotonic()
            if not timeout:
                ready = self._sock.poll(0, zmq.POLLIN)
            else:
                ready = left > 0 and self._sock.poll(max(1, int(left * 1000)), zmq.POLLIN)
            if not ready:
                if not timeout:
                    raise NoMessage(self.stream_name)
                raise StreamTimeout(
                    f"Consumer {self.consumer_index} of stream {self.stream_name!r}: no "
                    f"message within {timeout:g}s.",
                    waited_for=f"producers of stream {self.stream_name!r}",
                )
            # A message without this run's MAC is dropped unread: wait on for a real one.
            got = auth.recv(self._sock, STREAM_KIND, where)
            if got is not None:
                break
        msg = pickle.loads(got[1])
        if isinstance(msg, EndOfStream):
            self.ended[msg.producer_index] = msg
            return msg
        if self.message_types is not None and not isinstance(msg, self.message_types):
            raise TypeError(
                f"Stream {self.stream_name!r} received a {type(msg).__name__}; consumer "
                f"{self.consumer_index} accepts only "
                f"{[t.__name__ for t in self.message_types]}."
            )
        self.n_received += 1
        return msg

    def iterate(
        self, producers: Sequence[int], timeout: Optional[float] = DEFAULT_TIMEOUT
    ) -> Iterator[Any]:
        """Yield messages until every producer in ``producers`` has ended.

        ``timeout`` bounds the wait for each message; the error names the
        producers that have not ended.
        """
        waiting = set(producers) - set(self.ended)
        while waiting:
            try:
                msg = self.pull(timeout)
            except StreamTimeout as e:
                raise StreamTimeout(
                    f"{e} Producers {sorted(waiting)} have not finished.",
                    waited_for=f"producers {sorted(waiting)}",
                ) from e
            if isinstance(msg, EndOfStream):
                waiting.discard(msg.producer_index)
            else:
                yield msg

    def close(self) -> None:
        """Close the socket and withdraw the published address."""
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        try:
            name_resolve.delete(self._key)
        except Exception:  # already cleared by trial teardown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class PusherStream:
    """Producer end: connect to this producer's consumers and push messages.

    Messages go round-robin over the producer's consumers (one, unless there
    are fewer producers than consumers).

    Args:
        producer_index, n_producers, n_consumers: place in the grouping.
        hwm: send buffer bound per consumer (messages).
        connect_timeout: seconds to wait for the consumers' addresses.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        stream_name: str,
        producer_index: int,
        n_producers: int,
        n_consumers: int,
        *,
        hwm: int = DEFAULT_HWM,
        connect_timeout: float = DEFAULT_TIMEOUT,
    ):
        if not isinstance(hwm, int) or hwm < 1:
            raise ValueError(f"hwm must be a positive int (messages), got {hwm!r}.")
        self.stream_name = stream_name
        self.producer_index = producer_index
        self.consumers = consumers_of(producer_index, n_producers, n_consumers)
        ctx = zmq.Context.instance()
        self._socks: List[Tuple[int, zmq.Socket]] = []
        deadline = time.monotonic() + connect_timeout
        try:
            for c in self.consumers:
                key = _puller_key(experiment_name, trial_name, stream_name, c)
                try:
                    addr = name_resolve.wait(key, timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError as e:
                    raise StreamTimeout(
                        f"Producer {producer_index} of stream {stream_name!r}: consumer {c} "
                        f"did not publish its address (key {key!r}) within "
                        f"{connect_timeout:g}s.",
                        waited_for=f"consumer {c} of stream {stream_name!r}",
                    ) from e
                s = ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.SNDHWM, hwm)
                s.setsockopt(zmq.LINGER, 5000)  # deliver the tail (and EndOfStream) on close
                s.connect(addr)
                self._socks.append((c, s))
        except BaseException:
            for _, s in self._socks:
                s.close(linger=0)
            raise
        self._next = 0
        self.n_sent = 0
        self._sent_to = {c: 0 for c in self.consumers}
        self._closed = False

    def push(self, msg: Any, timeout: Optional[float] = DEFAULT_TIMEOUT) -> None:
        """Send ``msg`` to the next consumer; blocks while its buffer is full.

        Raises:
            StreamTimeout: the consumer did not take it within ``timeout``.
        """
        if self._closed:
            raise RuntimeError(f"Producer {self.producer_index} of {self.stream_name!r} is closed.")
        c, sock = self._socks[self._next]
        self._next = (self._next + 1) % len(self._socks)
        self._send(c, sock, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), timeout)
        self.n_sent += 1
        self._sent_to[c] += 1

    def _send(self, consumer: int, sock: zmq.Socket, buf: bytes, timeout) -> None:
        # A PUSH socket at its high-water mark blocks send() with no timeout: wait for room
        # with a bounded poll, then send without blocking.  None means the default, not
        # forever: a consumer that died must surface as an error.
        ms = max(1, int((timeout or DEFAULT_TIMEOUT) * 1000))
        if not sock.poll(ms, zmq.POLLOUT):
            raise StreamTimeout(
                f"Producer {self.producer_index} of stream {self.stream_name!r}: consumer "
                f"{consumer} did not accept a message within {timeout:g}s (its buffer is "
                "full or it is gone).",
                waited_for=f"consumer {consumer} of stream {self.stream_name!r}",
            )
        auth.send(sock, STREAM_KIND, buf, zmq.NOBLOCK)

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Send :class:`EndOfStream` to every consumer of this producer, then close."""
        if self._closed:
            return
        try:
            for c, sock in self._socks:
                eos = pickle.dumps(EndOfStream(self.producer_index, self._sent_to[c]))
                self._send(c, sock, eos, timeout)
        finally:
            self._closed = True
            for _, sock in self._socks:
                sock.close()

    def abort(self) -> None:
        """Close without :class:`EndOfStream` and drop unsent messages."""
        if self._closed:
            return
        self._closed = True
        for _, sock in self._socks:
            sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
