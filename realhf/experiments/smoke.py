"""The smoke experiment: the system plumbing end to end, with no model.

Workers (real processes when launched by ``realhf.apps.smoke``):

* ``smoke_master/0`` — a master-like worker.  For ``n_rounds`` rounds it sends
  a typed :class:`SquareRequest` to every ``smoke_model`` worker over the
  request/reply stream (round 0 with syn/ack) and checks each
  :class:`SquareReply`; then it sends a request that fails remotely and checks
  that the :class:`~realhf.system.transport.errors.RemoteError` names the worker and
  carries the remote traceback; then it tells the model workers to finish.
* ``smoke_model/{i}`` — model-like workers answering those requests.
* ``smoke_producer/{p}`` -> ``smoke_consumer/{c}`` — producers push
  ``n_messages`` typed :class:`Rollout` messages each over a push/pull
  stream; consumers check that they got all of them, in order per producer.

Every worker writes what it did to ``{result_dir}/{type}_{index}.json``.
``crash_worker`` / ``crash_after`` make one worker raise after serving that
many polls-with-work, to exercise ERROR reporting.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Dict, List, Optional, Tuple

from realhf.api.core.system_api import ExperimentConfig, register_experiment
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.system.transport.errors import NoMessage, RemoteError, StreamTimeout
from realhf.system.transport.push_pull import EndOfStream, PullerStream, PusherStream, producers_of
from realhf.system.transport.request_reply import ReplyServer, RequestClient
from realhf.system.worker.base import PollResult, Worker, register_worker

REQUEST_STREAM = "smoke_requests"
PUSH_STREAM = "smoke_rollouts"
CONFIGURE_ORDER = ("smoke_consumer", "smoke_model", "smoke_master", "smoke_producer")


# ---- messages ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SquareRequest:
    """Master -> model worker: square these integers."""

    round: int
    values: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SquareReply:
    """Model worker -> master: the squares, and who computed them."""

    worker: str
    round: int
    squares: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Producer -> consumer: a fake trajectory."""

    producer: int
    seq: int
    tokens: Tuple[int, ...]


# ---- configs ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SmokeModelConfig:
    result_dir: str
    crash_after: Optional[int] = None
    connect_timeout: float = 60.0


@dataclasses.dataclass(frozen=True)
class SmokeMasterConfig:
    result_dir: str
    handlers: Tuple[str, ...]
    n_rounds: int = 3
    round_interval_s: float = 0.0
    reply_timeout: float = 30.0
    connect_timeout: float = 60.0
    crash_after: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class SmokeProducerConfig:
    result_dir: str
    n_producers: int
    n_consumers: int
    n_messages: int
    crash_after: Optional[int] = None
    connect_timeout: float = 60.0


@dataclasses.dataclass(frozen=True)
class SmokeConsumerConfig:
    result_dir: str
    n_producers: int
    n_consumers: int
    n_messages: int
    crash_after: Optional[int] = None


def _write_result(result_dir: str, worker_name: str, result: dict) -> None:
    os.makedirs(result_dir, exist_ok=True)
    path = os.path.join(result_dir, worker_name.replace("/", "_") + ".json")
    write_json_atomic(path, result, indent=2)


class _Crashable(Worker):
    """Raises on the ``crash_after``-th unit of work (failure injection)."""

    _work_done = 0

    def _count_work(self) -> None:
        self._work_done += 1
        limit = getattr(self.config, "crash_after", None)
        if limit is not None and self._work_done >= limit:
            raise RuntimeError(
                f"injected failure in {self.worker_name} after {self._work_done} units of work"
            )


# ---- workers ----------------------------------------------------------------


@register_worker("smoke_model")
class SmokeModelWorker(_Crashable):
    """Answers ``square``, ``fail`` (raises on purpose) and ``finish``."""

    config_class = SmokeModelConfig

    def _configure(self, config: SmokeModelConfig) -> None:
        self.server: Optional[ReplyServer] = None
        self.served: Dict[str, int] = {}

    def _poll(self) -> PollResult:
        if self.server is None:  # the master binds after we are configured
            self.server = ReplyServer(
                self.experiment_name,
                self.trial_name,
                REQUEST_STREAM,
                self.worker_name,
                connect_timeout=self.config.connect_timeout,
            )
        try:
            req = self.server.poll(timeout=0.1)
        except (NoMessage, StreamTimeout):
            return PollResult()
        self.served[req.handle_name] = self.served.get(req.handle_name, 0) + 1
        if req.handle_name == "square":
            self._count_work()
            data: SquareRequest = req.data
            self.server.reply(
                req, SquareReply(self.worker_name, data.round, tuple(v * v for v in data.values))
            )
        elif req.handle_name == "fail":
            try:
                raise ValueError(f"requested failure (data={req.data!r})")
            except ValueError as e:
                self.server.reply_error(req, e)
        elif req.handle_name == "finish":
            _write_result(self.config.result_dir, self.worker_name, {"served": self.served})
            self.server.reply(req, self.served)
            return PollResult(batch_count=1, completed=True)
        else:
            self.server.reply_error(req, ValueError(f"unknown handle {req.handle_name!r}"))
        return PollResult(batch_count=1)

    def _exit_hook(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()


@register_worker("smoke_master")
class SmokeMasterWorker(_Crashable):
    """Drives the model workers through rounds of typed requests."""

    config_class = SmokeMasterConfig

    def _configure(self, config: SmokeMasterConfig) -> None:
        # Bind and publish now; the model workers connect once started.
        self.client = RequestClient(
            self.experiment_name,
            self.trial_name,
            REQUEST_STREAM,
            list(config.handlers),
            reply_timeout=config.reply_timeout,
            wait=False,
        )
        self.round = 0
        self.pending: Optional[List[str]] = None
        self.sent_at = 0.0
        self.next_round_at = 0.0
        self.started_at = time.monotonic()
        self.log: List[str] = []

    def _poll(self) -> PollResult:
        cfg = self.config
        if self.round == 0 and self.pending is None and not self.client.all_connected():
            if time.monotonic() - self.started_at > cfg.connect_timeout:
                self.client.wait_for_handlers(0)  # raises, naming who is missing
            time.sleep(0.01)
            return PollResult()
        if self.pending is not None:
            return self._collect()
        if self.round < cfg.n_rounds:
            if time.monotonic() < self.next_round_at:
                time.sleep(min(0.05, self.next_round_at - time.monotonic()))
                return PollResult()
            datas = [
                SquareRequest(self.round, tuple(range(self.round, self.round + 3 + i)))
                for i in range(len(cfg.handlers))
            ]
            # Round 0 uses syn/ack: every handler holds the request until all got it.
            self.pending = self.client.request(
                cfg.handlers, "square", datas, no_syn=(self.round != 0)
            )
            self.sent_at = time.monotonic()
            return PollResult()
        return self._finish()

    def _collect(self) -> PollResult:
        try:
            replies = self.client.gather(self.pending, timeout=0.1)
        except StreamTimeout:
            if time.monotonic() - self.sent_at > self.config.reply_timeout:
                raise
            return PollResult()
        for handler, rep in zip(self.config.handlers, replies):
            sq: SquareReply = rep.result()
            base = self.round
            expected = tuple(v * v for v in range(base, base + len(sq.squares)))
            if sq.worker != handler or sq.round != self.round or sq.squares != expected:
                raise RuntimeError(f"wrong reply from {handler} in round {self.round}: {sq}")
        self.log.append(f"round {self.round}: {len(replies)} replies checked")
        self._count_work()
        self.round += 1
        self.pending = None
        self.next_round_at = time.monotonic() + self.config.round_interval_s
        return PollResult(batch_count=1)

    def _finish(self) -> PollResult:
        target = self.config.handlers[-1]
        try:
            self.client.call([target], "fail", ["please"])
        except RemoteError as e:
            if e.info.worker != target or "ValueError" not in e.info.traceback:
                raise RuntimeError(f"remote error lacks worker/traceback: {e}") from e
            remote_error = {
                "worker": e.info.worker,
                "handle": e.info.handle_name,
                "error": e.info.summary(),
            }
        else:
            raise RuntimeError(f"{target} did not raise on the 'fail' request")
        served = self.client.call(self.config.handlers, "finish")
        _write_result(
            self.config.result_dir,
            self.worker_name,
            {
                "rounds": self.round,
                "handlers": list(self.config.handlers),
                "log": self.log,
                "remote_error": remote_error,
                "served": dict(zip(self.config.handlers, served)),
            },
        )
        return PollResult(batch_count=1, completed=True)

    def _exit_hook(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()


@register_worker("smoke_producer")
class SmokeProducerWorker(_Crashable):
    """Pushes ``n_messages`` :class:`Rollout` s, then ends its stream."""

    config_class = SmokeProducerConfig

    def _configure(self, config: SmokeProducerConfig) -> None:
        self.pusher: Optional[PusherStream] = None
        self.seq = 0

    def _poll(self) -> PollResult:
        cfg = self.config
        if self.pusher is None:
            self.pusher = PusherStream(
                self.experiment_name,
                self.trial_name,
                PUSH_STREAM,
                self.worker_index,
                cfg.n_producers,
                cfg.n_consumers,
                connect_timeout=cfg.connect_timeout,
            )
        if self.seq < cfg.n_messages:
            self._count_work()
            self.pusher.push(
                Rollout(self.worker_index, self.seq, tuple(range(self.seq % 7 + 1))), timeout=30
            )
            self.seq += 1
            return PollResult(sample_count=1)
        self.pusher.close()
        _write_result(
            cfg.result_dir,
            self.worker_name,
            {
                "pushed": self.seq,
                "consumers": self.pusher.consumers,
            },
        )
        return PollResult(completed=True)

    def _exit_hook(self) -> None:
        if getattr(self, "pusher", None) is not None:
            self.pusher.abort()  # no-op after a normal close()


@register_worker("smoke_consumer")
class SmokeConsumerWorker(_Crashable):
    """Pulls until all its producers ended; checks count and order."""

    config_class = SmokeConsumerConfig

    def _configure(self, config: SmokeConsumerConfig) -> None:
        self.puller = PullerStream(
            self.experiment_name,
            self.trial_name,
            PUSH_STREAM,
            self.worker_index,
            message_types=[Rollout],
        )
        self.producers = producers_of(self.worker_index, config.n_producers, config.n_consumers)
        self.last_seq: Dict[int, int] = {p: -1 for p in self.producers}
        self.received = 0

    def _poll(self) -> PollResult:
        try:
            msg = self.puller.pull(timeout=0.1)
        except StreamTimeout:
            return PollResult()
        if isinstance(msg, EndOfStream):
            if set(self.puller.ended) >= set(self.producers):
                return self._finish()
            return PollResult()
        self._count_work()
        if msg.seq <= self.last_seq[msg.producer]:
            raise RuntimeError(f"out-of-order message from producer {msg.producer}: {msg.seq}")
        self.last_seq[msg.producer] = msg.seq
        self.received += 1
        return PollResult(sample_count=1)

    def _finish(self) -> PollResult:
        expected = sum(e.n_sent for p, e in self.puller.ended.items() if p in self.producers)
        if self.received != expected:
            raise RuntimeError(f"received {self.received} rollouts, producers sent {expected}")
        _write_result(
            self.config.result_dir,
            self.worker_name,
            {
                "received": self.received,
                "producers": self.producers,
            },
        )
        return PollResult(completed=True)

    def _exit_hook(self) -> None:
        if getattr(self, "puller", None) is not None:
            self.puller.close()


# ---- the experiment -----------------------------------------------------------


def smoke_experiment(
    *,
    result_dir: str,
    n_model_workers: int = 2,
    n_rounds: int = 3,
    n_producers: int = 1,
    n_consumers: int = 1,
    n_messages: int = 20,
    round_interval_s: float = 0.0,
    reply_timeout: float = 30.0,
    crash_worker: Optional[str] = None,
    crash_after: int = 1,
) -> ExperimentConfig:
    """Build the smoke experiment (see the module docstring)."""
    for name, v in (
        ("n_model_workers", n_model_workers),
        ("n_rounds", n_rounds),
        ("n_producers", n_producers),
        ("n_consumers", n_consumers),
        ("n_messages", n_messages),
    ):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"smoke experiment: {name} must be an int >= 1, got {v!r}.")
    handlers = tuple(f"smoke_model/{i}" for i in range(n_model_workers))
    workers = {
        "smoke_consumer": [
            SmokeConsumerConfig(result_dir, n_producers, n_consumers, n_messages)
            for _ in range(n_consumers)
        ],
        "smoke_model": [SmokeModelConfig(result_dir) for _ in handlers],
        "smoke_master": [
            SmokeMasterConfig(result_dir, handlers, n_rounds, round_interval_s, reply_timeout)
        ],
        "smoke_producer": [
            SmokeProducerConfig(result_dir, n_producers, n_consumers, n_messages)
            for _ in range(n_producers)
        ],
    }
    if crash_worker is not None:
        wtype, _, idx = crash_worker.partition("/")
        if wtype not in workers or not idx.isdigit() or int(idx) >= len(workers[wtype]):
            raise ValueError(
                f"smoke experiment: crash_worker {crash_worker!r} is not one of "
                f"{[f'{t}/{i}' for t, c in workers.items() for i in range(len(c))]}."
            )
        cfgs = workers[wtype]
        cfgs[int(idx)] = dataclasses.replace(cfgs[int(idx)], crash_after=crash_after)
    return ExperimentConfig(workers=workers, configure_order=CONFIGURE_ORDER)


register_experiment("smoke", smoke_experiment)
