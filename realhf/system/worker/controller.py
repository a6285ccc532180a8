"""The controller: configure workers in order, start them, watch them, stop them.

:class:`WorkerControlPanel` holds one ZMQ REQ socket per worker (addresses from
``names.worker``) and sends control commands with a timeout; while it waits it
also checks that the workers it waits on are alive (their keepalive'd address
keys), so a worker that dies mid-``configure`` is reported at once.

:class:`Controller` runs an :class:`~realhf.api.core.system_api.ExperimentConfig`:

1. publish its own status (workers exit when it disappears) and
   ``names.experiment_status`` = RUNNING (COMPLETE or ABORTED at the end);
2. connect to every worker;
3. ``configure`` worker types in ``configure_order`` (all workers of one type
   at once), sending each its ``WorkerInformation`` and config;
4. ``start`` every worker;
5. every ``poll_interval`` seconds read all statuses: ERROR or LOST stops the
   run (after ``failure_settle`` seconds more to catch related failures),
   raising :class:`~realhf.system.transport.errors.ExperimentFailed` that names each
   failed worker and why (the remote traceback for ERROR); when every worker of
   ``completion_types`` is COMPLETED the run succeeded;
   A ``names.stop_request`` key (``python -m realhf.apps.main stop``) ends the run
   with :class:`~realhf.system.transport.errors.StopRequested` and status STOPPED;
6. in every case send ``exit`` to the workers still alive.

Partial restarts: a worker of ``experiment.restartable_types`` (generation servers and
rollout workers hold no training state) that is LOST or ERROR, or whose control address
changed (the launcher already replaced its process), does not stop the run.  The controller
asks the launcher to kill the old process if it still runs (``names.restart_request`` with
its pid: a hung process is killed, a dead one is already gone), waits up to
``restart_timeout`` for a new process of that worker to register (a ping answers with
another pid), then configures it with the same config and starts it, while every other
worker keeps running.  Each worker gets ``experiment.max_worker_restarts`` restarts; the
next failure stops the run as any other.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import zmq

from realhf.api.core.system_api import ExperimentConfig
from realhf.base import logging, name_resolve, names
from realhf.base.net import auth
from realhf.system.transport.errors import (
    ExperimentFailed,
    RemoteError,
    StopRequested,
    StreamTimeout,
    format_error,
)
from realhf.system.worker.base import (
    CONTROL_KIND,
    CONTROLLER_NAME,
    DEFAULT_STATUS_TTL,
    ControlCommand,
    ControlReply,
    ControlRequest,
    ExperimentStatus,
    WorkerStatus,
    clear_error,
    read_error,
    read_status,
)

logger = logging.getLogger("controller", "system")

__all__ = [
    "WorkerControlPanel",
    "Controller",
    "RunSummary",
    "WorkerLost",
]


class WorkerLost(ConnectionError):
    """A worker's keepalive'd keys vanished while a command waited on it."""

    def __init__(self, worker: str, during: str):
        self.worker, self.during = worker, during
        super().__init__(
            f"{worker} is LOST: its keepalive entry expired while waiting for {during!r} "
            "(the process died or hung); see its log file."
        )


class WorkerControlPanel:
    """Send control commands to workers over ZMQ REQ sockets, with timeouts.

    Args:
        worker_names: ``type/index`` names of the workers to control.
        connect_timeout: seconds to wait for every worker's address.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        worker_names: Sequence[str],
        *,
        connect_timeout: float = 120.0,
    ):
        self.experiment_name = experiment_name
        self.trial_name = trial_name
        self.worker_names = list(worker_names)
        self._ctx = zmq.Context.instance()
        self._addresses: Dict[str, str] = {}
        deadline = time.monotonic() + connect_timeout
        for w in self.worker_names:
            key = names.worker(experiment_name, trial_name, w)
            try:
                self._addresses[w] = name_resolve.wait(
                    key, timeout=max(0.0, deadline - time.monotonic())
                )
            except TimeoutError:
                missing = [
                    x
                    for x in self.worker_names
                    if x not in self._addresses and not self.is_alive(x)
                ]
                raise StreamTimeout(
                    f"Workers {missing} did not register their control address within "
                    f"{connect_timeout:g}s. Check that they were launched and look at their "
                    "log files for start-up errors.",
                    waited_for=", ".join(missing),
                ) from None
        self._socks: Dict[str, zmq.Socket] = {w: self._new_socket(w) for w in self.worker_names}

    def is_alive(self, worker: str) -> bool:
        """Whether ``worker``'s keepalive'd control address is still registered."""
        try:
            name_resolve.get(names.worker(self.experiment_name, self.trial_name, worker))
            return True
        except name_resolve.NameEntryNotFoundError:
            return False

    def registered_address(self, worker: str) -> Optional[str]:
        """The control address ``worker`` registered now (None when there is none)."""
        try:
            return name_resolve.get(names.worker(self.experiment_name, self.trial_name, worker))
        except name_resolve.NameEntryNotFoundError:
            return None

    def address(self, worker: str) -> str:
        """The address this panel talks to for ``worker``."""
        return self._addresses[worker]

    def reconnect(self, worker: str, address: str) -> None:
        """Talk to ``worker`` at ``address`` from now on (a restarted process of it)."""
        self._addresses[worker] = address
        self._reset_socket(worker)

    def _new_socket(self, worker: str) -> zmq.Socket:
        s = self._ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self._addresses[worker])
        return s

    def _reset_socket(self, worker: str) -> None:
        # A REQ socket that sent and got no answer refuses to send again; the
        # only way out is a fresh socket.
        self._socks[worker].close(linger=0)
        self._socks[worker] = self._new_socket(worker)

    def request(
        self,
        command: ControlCommand | str,
        workers: Optional[Sequence[str]] = None,
        kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
        *,
        timeout: float = 30.0,
        raise_errors: bool = True,
    ) -> Dict[str, ControlReply]:
        """Send ``command`` to ``workers`` (default all) at once; collect the replies.

        ``kwargs`` maps a worker name to its command arguments.  ``command`` is sent as
        given: the workers refuse an unknown one (a :class:`RemoteError`).

        Raises:
            RemoteError: a worker answered with an error (first one, if ``raise_errors``).
            WorkerLost: a worker's address key expired while we waited.
            StreamTimeout: naming the workers that did not answer in ``timeout`` s.
        """
        workers = list(self.worker_names if workers is None else workers)
        unknown = [w for w in workers if w not in self._socks]
        if unknown:
            raise ValueError(f"Unknown workers {unknown}; this panel controls {self.worker_names}.")
        kwargs = kwargs or {}
        for w in workers:
            req = ControlRequest(command, dict(kwargs.get(w, {})))
            auth.send(
                self._socks[w], CONTROL_KIND, pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
            )
        replies: Dict[str, ControlReply] = {}
        poller = zmq.Poller()
        for w in workers:
            poller.register(self._socks[w], zmq.POLLIN)
        by_sock = {self._socks[w]: w for w in workers}
        deadline = time.monotonic() + timeout
        while len(replies) < len(workers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [w for w in workers if w not in replies]
                for w in missing:
                    self._reset_socket(w)
                raise StreamTimeout(
                    f"Workers {missing} did not answer control command {str(command)!r} "
                    f"within {timeout:g}s.",
                    waited_for=", ".join(missing),
                )
            # At most 1 s per wait, so a worker that died is noticed within a second or so.
            for sock, _ in poller.poll(int(min(left, 1.0) * 1000)):
                w = by_sock[sock]
                got = auth.recv(sock, CONTROL_KIND, f"the controller's socket to {w}")
                if got is None:  # not from the worker: keep waiting for its answer
                    continue
                replies[w] = pickle.loads(got[1])
                poller.unregister(sock)
            # A worker that answered and then exited (``exit``) has no key any
            # more: read a pending answer before calling it lost.
            lost = [
                w
                for w in workers
                if w not in replies
                and not self.is_alive(w)
                and not self._socks[w].poll(0, zmq.POLLIN)
            ]
            if lost:
                for w in workers:
                    if w not in replies:
                        self._reset_socket(w)
                raise WorkerLost(lost[0], str(command))
        if raise_errors:
            for w in workers:
                if replies[w].error is not None:
                    raise RemoteError(replies[w].error)
        return replies

    def close(self) -> None:
        """Close all sockets."""
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()


@dataclasses.dataclass
class RunSummary:
    """What the controller saw in a successful run."""

    experiment_name: str
    trial_name: str
    configure_order: List[str]
    statuses: Dict[str, str]
    configure_seconds: float
    run_seconds: float


@dataclasses.dataclass
class _Restart:
    """A restart in progress: since when, the process it replaces, why."""

    since: float
    process: tuple
    why: str


class Controller:
    """Runs one trial of an experiment; see the module docstring.

    Args:
        poll_interval: seconds between status checks.
        connect_timeout: seconds to wait for all workers to register.
        configure_timeout: seconds each worker type may take to configure.
        command_timeout: seconds for ``start``/``exit`` replies.
        status_ttl: keepalive TTL of the controller's own status key.
        failure_settle: after the first failure, keep watching this long
            (default: ``status_ttl`` + ``poll_interval``) to also catch the
            workers whose death caused it, then stop everything.
        restart_timeout: seconds a restartable worker may take to come back (a new
            process registered, configured and started).
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        *,
        poll_interval: float = 1.0,
        connect_timeout: float = 120.0,
        configure_timeout: float = 600.0,
        command_timeout: float = 30.0,
        status_ttl: float = DEFAULT_STATUS_TTL,
        failure_settle: Optional[float] = None,
        restart_timeout: float = 300.0,
    ):
        for name, v in (
            ("poll_interval", poll_interval),
            ("connect_timeout", connect_timeout),
            ("configure_timeout", configure_timeout),
            ("command_timeout", command_timeout),
            ("status_ttl", status_ttl),
            ("restart_timeout", restart_timeout),
        ):
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(
                    f"Controller {name} must be a positive number of seconds, got {v!r}."
                )
        self.experiment_name = experiment_name
        self.trial_name = trial_name
        self.poll_interval = poll_interval
        self.connect_timeout = connect_timeout
        self.configure_timeout = configure_timeout
        self.command_timeout = command_timeout
        self.status_ttl = status_ttl
        self.failure_settle = (
            status_ttl + poll_interval if failure_settle is None else failure_settle
        )
        if self.failure_settle < 0:
            raise ValueError(
                f"Controller failure_settle must be >= 0 seconds, got {failure_settle!r}."
            )
        self.restart_timeout = restart_timeout
        self._panel: Optional[WorkerControlPanel] = None
        self._restarts: Dict[str, int] = {}
        self._restarting: Dict[str, _Restart] = {}
        #: restartable worker -> (host, pid) of its current process
        self._processes: Dict[str, tuple] = {}

    def _status_key(self) -> str:
        return names.worker_status(self.experiment_name, self.trial_name, CONTROLLER_NAME)

    def run(self, experiment: ExperimentConfig, timeout: Optional[float] = None) -> RunSummary:
        """Run ``experiment`` to completion; see the module docstring.

        Raises:
            ExperimentFailed: naming every failed worker and why.
            TimeoutError: the run exceeded ``timeout`` seconds (workers are stopped).
        """
        name_resolve.add(
            self._status_key(),
            WorkerStatus.RUNNING.value,
            keepalive_ttl=self.status_ttl,
            replace=True,
        )
        worker_names = experiment.worker_names()
        t0 = time.monotonic()
        self._set_experiment_status(ExperimentStatus.RUNNING)
        outcome = ExperimentStatus.ABORTED
        try:
            self._panel = WorkerControlPanel(
                self.experiment_name,
                self.trial_name,
                worker_names,
                connect_timeout=self.connect_timeout,
            )
            self._configure_all(experiment)
            t_conf = time.monotonic() - t0
            self._panel.request(ControlCommand.START, timeout=self.command_timeout)
            logger.info(f"started {len(worker_names)} workers")
            self._note_processes(experiment, worker_names)
            statuses = self._watch(experiment, worker_names, timeout, t0)
            outcome = ExperimentStatus.COMPLETE
            return RunSummary(
                self.experiment_name,
                self.trial_name,
                experiment.ordered_types,
                {w: s.value for w, s in statuses.items()},
                t_conf,
                time.monotonic() - t0,
            )
        except StopRequested:
            outcome = ExperimentStatus.STOPPED
            raise
        except (RemoteError, WorkerLost, StreamTimeout) as e:
            raise self._failure_from(e, worker_names) from None
        finally:
            self._set_experiment_status(outcome)
            self._shutdown()
            try:
                name_resolve.delete(self._status_key())
            except Exception:
                pass

    def _set_experiment_status(self, status: ExperimentStatus) -> None:
        # Kept after exit so launchers (and recovery) can tell a finished run
        # from an aborted one; launch_experiment clears the trial's keys.
        name_resolve.add(
            names.experiment_status(self.experiment_name, self.trial_name),
            status.value,
            replace=True,
            delete_on_exit=False,
        )

    def _configure_all(self, experiment: ExperimentConfig) -> None:
        for wtype in experiment.ordered_types:
            group = [f"{wtype}/{i}" for i in range(len(experiment.workers[wtype]))]
            kwargs = {
                f"{wtype}/{i}": dict(
                    worker_info=experiment.worker_info(
                        self.experiment_name, self.trial_name, wtype, i
                    ),
                    config=cfg,
                )
                for i, cfg in enumerate(experiment.workers[wtype])
            }
            t = time.monotonic()
            self._panel.request(
                ControlCommand.CONFIGURE, group, kwargs, timeout=self.configure_timeout
            )
            logger.info(f"configured {len(group)} x {wtype} in {time.monotonic() - t:.2f}s")

    def _watch(
        self,
        experiment: ExperimentConfig,
        worker_names: List[str],
        timeout: Optional[float],
        t0: float,
    ) -> Dict[str, WorkerStatus]:
        done_types = experiment.completion_types or tuple(experiment.workers)
        must_complete = [w for w in worker_names if w.split("/")[0] in done_types]
        failures: Dict[str, str] = {}
        settle_until = None
        while True:
            self._check_stop_request()
            statuses = {
                w: read_status(self.experiment_name, self.trial_name, w) for w in worker_names
            }
            back = set()
            if not failures:
                for w, reason in self._tend_restarts(experiment, statuses).items():
                    if reason is None:
                        back.add(w)  # configured and started again since statuses were read
                        continue
                    failures[w] = reason
                    logger.error(f"{w}: {reason.splitlines()[0]}")
            for w, s in statuses.items():
                if w in self._restarting or w in back:
                    continue
                if s in (WorkerStatus.ERROR, WorkerStatus.LOST) and w not in failures:
                    failures[w] = self._reason(w, s)
                    logger.error(f"{w}: {failures[w].splitlines()[0]}")
            if failures:
                # One failure often causes others: a peer's stream breaks at
                # once (ERROR) while the dead worker's key takes up to a TTL
                # to expire (LOST).  Keep watching that long so the report
                # names the root cause too, then stop everything.
                if settle_until is None:
                    settle_until = time.monotonic() + self.failure_settle
                if time.monotonic() >= settle_until:
                    raise ExperimentFailed(self.experiment_name, self.trial_name, failures)
            elif all(statuses[w] == WorkerStatus.COMPLETED for w in must_complete):
                logger.info(f"all of {must_complete} COMPLETED")
                return statuses
            if timeout is not None and time.monotonic() - t0 > timeout:
                pending = [w for w in must_complete if statuses[w] != WorkerStatus.COMPLETED]
                raise TimeoutError(
                    f"experiment {self.experiment_name!r} trial {self.trial_name!r} did not "
                    f"complete within {timeout:g}s; still not COMPLETED: {pending}."
                )
            time.sleep(self.poll_interval)

    # ---- partial restarts ---------------------------------------------------------

    def _note_processes(self, experiment: ExperimentConfig, worker_names: List[str]) -> None:
        ws = [w for w in worker_names if w.split("/")[0] in experiment.restartable_types]
        if not ws:
            return
        try:
            replies = self._panel.request(
                ControlCommand.PING, ws, timeout=self.command_timeout, raise_errors=False
            )
        except (WorkerLost, StreamTimeout) as e:
            # Lost right after start: the watch loop restarts it (any new pid will do).
            logger.warning(f"could not ask every restartable worker for its pid: {e}")
            return
        for w, r in replies.items():
            if r.error is None:
                self._processes[w] = (r.result["host"], r.result["pid"])

    def _tend_restarts(
        self, experiment: ExperimentConfig, statuses: Dict[str, WorkerStatus]
    ) -> Dict[str, Optional[str]]:
        """Start and finish restarts of restartable workers.

        Returns the workers whose restart ended in this call: None for those running again,
        the failure for those that cannot be restarted (the run stops).
        """
        ended: Dict[str, Optional[str]] = {}
        for w, status in statuses.items():
            if w.split("/")[0] not in experiment.restartable_types:
                continue
            if w in self._restarting:
                reason = self._continue_restart(experiment, w)
                if reason is None and w not in self._restarting:
                    ended[w] = None
            else:
                why = self._why_restart(w, status)
                if why is None:
                    continue
                reason = self._begin_restart(experiment, w, status, why)
            if reason is not None:
                self._restarting.pop(w, None)
                ended[w] = reason
        return ended

    def _why_restart(self, w: str, status: WorkerStatus) -> Optional[str]:
        if status in (WorkerStatus.ERROR, WorkerStatus.LOST):
            return self._reason(w, status)
        addr = self._panel.registered_address(w)
        if addr is not None and addr != self._panel.address(w):
            return "its process was replaced (it exited and the launcher started it again)"
        return None

    def _begin_restart(
        self, experiment: ExperimentConfig, w: str, status: WorkerStatus, why: str
    ) -> Optional[str]:
        n = self._restarts.get(w, 0)
        if n >= experiment.max_worker_restarts:
            return (
                f"{why}\n(not restarted again: it was restarted {n} times already, "
                f"max_worker_restarts={experiment.max_worker_restarts})"
            )
        self._restarts[w] = n + 1
        host, pid = self._processes.get(w, (None, None))
        logger.warning(
            f"{w}: {why.splitlines()[0]} — restarting it alone "
            f"({n + 1}/{experiment.max_worker_restarts}); the other workers keep running"
        )
        name_resolve.add(
            names.restart_request(self.experiment_name, self.trial_name, w),
            json.dumps({"pid": pid, "host": host, "reason": why.splitlines()[0]}),
            replace=True,
            delete_on_exit=False,
        )
        clear_error(self.experiment_name, self.trial_name, w)
        self._restarting[w] = _Restart(time.monotonic(), (host, pid), why)
        return None

    def _continue_restart(self, experiment: ExperimentConfig, w: str) -> Optional[str]:
        r = self._restarting[w]
        waited = time.monotonic() - r.since
        addr = self._panel.registered_address(w)
        if addr is not None:
            self._panel.reconnect(w, addr)
            try:
                reply = self._panel.request(ControlCommand.PING, [w], timeout=2.0)[w]
            except (StreamTimeout, WorkerLost, RemoteError):
                reply = None  # the old process on its way out, or the new one not serving yet
            if reply is not None and (reply.result["host"], reply.result["pid"]) != r.process:
                return self._bring_back(experiment, w, reply, r.since)
        if waited > self.restart_timeout:
            return (
                f"{r.why}\n(restart: no new process registered within "
                f"{self.restart_timeout:g}s; see the launcher's output and the worker's log)"
            )
        return None

    def _bring_back(self, experiment: ExperimentConfig, w: str, ping, since: float):
        wtype, index = w.split("/")
        kwargs = {
            w: dict(
                worker_info=experiment.worker_info(
                    self.experiment_name, self.trial_name, wtype, int(index)
                ),
                config=experiment.workers[wtype][int(index)],
            )
        }
        try:
            self._panel.request(
                ControlCommand.CONFIGURE, [w], kwargs, timeout=self.configure_timeout
            )
            self._panel.request(ControlCommand.START, [w], timeout=self.command_timeout)
        except (RemoteError, WorkerLost, StreamTimeout) as e:
            failure = self._failure_from(e, [w]).failures
            return f"restart failed: {next(iter(failure.values()), e)}"
        self._processes[w] = (ping.result["host"], ping.result["pid"])
        del self._restarting[w]
        logger.info(
            f"{w} restarted (pid {ping.result['pid']}): running again "
            f"{time.monotonic() - since:.1f}s after it was found lost"
        )
        return None

    def _check_stop_request(self) -> None:
        try:
            who = name_resolve.get(names.stop_request(self.experiment_name, self.trial_name))
        except name_resolve.NameEntryNotFoundError:
            return
        logger.warning(f"stop requested ({who}); stopping every worker")
        raise StopRequested(
            f"experiment {self.experiment_name!r} trial {self.trial_name!r} stopped on request "
            f"({who})"
        )

    def _reason(self, worker: str, status: WorkerStatus) -> str:
        if status == WorkerStatus.LOST:
            return (
                "LOST: its status key expired (no heartbeat within its keepalive TTL); "
                "the process died or was killed. See its log file."
            )
        info = read_error(self.experiment_name, self.trial_name, worker)
        return f"ERROR during {info.handle_name if info else '?'}: {format_error(info)}"

    def _failure_from(self, e: Exception, worker_names: List[str]) -> ExperimentFailed:
        if isinstance(e, RemoteError):
            w = e.info.worker
            return ExperimentFailed(
                self.experiment_name,
                self.trial_name,
                {w: f"ERROR during {e.info.handle_name}: {format_error(e.info)}"},
            )
        if isinstance(e, WorkerLost):
            return ExperimentFailed(self.experiment_name, self.trial_name, {e.worker: f"LOST: {e}"})
        who = [w for w in (e.waited_for or "").split(", ") if w in worker_names] or ["workers"]
        return ExperimentFailed(
            self.experiment_name, self.trial_name, {w: f"TIMEOUT: {e}" for w in who}
        )

    def _shutdown(self) -> None:
        """Send ``exit`` to every worker that is still alive (best effort)."""
        panel, self._panel = self._panel, None
        if panel is None:
            return
        alive = [w for w in panel.worker_names if panel.is_alive(w)]
        if alive:
            try:
                replies = panel.request(
                    ControlCommand.EXIT, alive, timeout=self.command_timeout, raise_errors=False
                )
                logger.info(f"sent exit to {sorted(replies)}")
            except (StreamTimeout, WorkerLost) as e:
                logger.warning(f"some workers did not acknowledge exit: {e}")
        panel.close()
