"""Worker processes: a poll loop behind a control socket.

Every realhf worker (master, model worker, generation server, gserver manager,
rollout worker) is a subclass of :class:`Worker` (or :class:`AsyncWorker` for
asyncio workers).  A subclass implements

* ``_configure(config)`` — build what it needs from its config dataclass;
* ``_poll() -> PollResult`` (or ``async _poll_async()``) — do one unit of work;
  return ``PollResult(completed=True)`` when the worker's job is done;

and optionally ``_on_start``, ``_on_pause``, ``_on_interrupt``, ``_exit_hook``.

:meth:`Worker.run` is the process's loop.  Between polls it serves control
requests from the controller on a ZMQ REP socket (:class:`WorkerControlServer`,
address published under ``names.worker(exp, trial, worker_name)``):

========== ===================================================== ===========
command    effect                                                status after
========== ===================================================== ===========
configure  ``_configure(config)`` (kwargs ``worker_info, config``) READY
start      begin polling                                          RUNNING
pause      stop polling, keep serving control                     PAUSED
interrupt  ``_on_interrupt()``, stop polling                      INTERRUPTED
ping       reply with pid, host, status, poll count               unchanged
exit       leave the loop; the process ends with code 0           (removed)
========== ===================================================== ===========

The status lives in name_resolve under ``names.worker_status(...)`` with a
keepalive TTL (:data:`DEFAULT_STATUS_TTL`): a worker that dies without
cleaning up (SIGKILL, OOM) loses its key within the TTL and the controller
reads it as LOST.  When ``_configure`` or ``_poll`` raises, or a control request
cannot be unpickled (e.g. a config class the worker cannot import), the worker
logs the error, writes ERROR (without TTL, so it outlives the process) and the
error with its traceback (:func:`read_error`), then leaves the loop with exit
code 1.  ``_exit_hook`` runs whenever the loop ends, from whatever state.

Workers are registered by type name (:func:`register_worker`) so that
``python -m realhf.apps.remote worker --type T ...`` can build one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import json
import os
import pickle
import time
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Type

import zmq

from realhf.api.core.system_api import WorkerInformation
from realhf.base import logging, name_resolve, names
from realhf.base.net import auth, network
from realhf.system.transport.errors import ErrorInfo

__all__ = [
    "ExperimentStatus",
    "experiment_ended",
    "DEFAULT_STATUS_TTL",
    "CONTROLLER_NAME",
    "CONTROL_COMMANDS",
    "ControlCommand",
    "WorkerStatus",
    "PollResult",
    "ControlRequest",
    "ControlReply",
    "ControlCommandError",
    "UnreadableControlRequest",
    "WorkerControlServer",
    "Worker",
    "AsyncWorker",
    "read_status",
    "read_error",
    "clear_error",
    "register_worker",
    "make_worker",
    "registered_worker_types",
]

# Seconds after its last refresh (every TTL/3) that a dead worker's status
# disappears.  With the controller polling every second, a SIGKILLed worker is
# reported LOST within about TTL + 1 s.
DEFAULT_STATUS_TTL = 6.0

#: The MAC domain of control messages (see :mod:`realhf.base.net.auth`).
CONTROL_KIND = b"control"
# The controller publishes its own status under this worker name, so workers
# can notice that it is gone and exit instead of lingering as orphans.
CONTROLLER_NAME = "controller/0"
# Seconds a RUNNING worker pauses after a poll that did no work: bounds the
# idle spin to ~1000 polls/s without adding noticeable latency.
NO_WORK_WAIT = 0.001


class ControlCommand(enum.StrEnum):
    """A command of the control channel (see the module docstring's table).

    The values are the command names that travel in a :class:`ControlRequest`; a plain
    string with the same value is accepted wherever a command is (``"start"``).
    """

    CONFIGURE = "configure"
    START = "start"
    PAUSE = "pause"
    INTERRUPT = "interrupt"
    PING = "ping"
    EXIT = "exit"


#: the command names, in the order of :class:`ControlCommand`
CONTROL_COMMANDS = tuple(c.value for c in ControlCommand)


class WorkerStatus(str, enum.Enum):
    """A worker's lifecycle state as stored in name_resolve."""

    READY = "READY"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    ERROR = "ERROR"
    INTERRUPTED = "INTERRUPTED"
    #: not stored: the key is missing (never written, expired, or removed)
    LOST = "LOST"


@dataclasses.dataclass(frozen=True)
class PollResult:
    """What one poll did; ``completed=True`` ends the worker's job."""

    sample_count: int = 0
    batch_count: int = 0
    completed: bool = False


@dataclasses.dataclass(frozen=True)
class ControlRequest:
    """A control command sent by the controller (pickled over ZMQ REQ/REP).

    ``command`` is not checked here: an unknown one must reach the worker, which refuses
    it in its reply (:class:`ControlCommandError`) rather than the sender failing alone.
    """

    command: ControlCommand | str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ControlReply:
    """A worker's answer to a :class:`ControlRequest`.

    ``command`` echoes the request's command for the logs (``"?"`` when the request could
    not be read); nothing dispatches on it.
    """

    worker: str
    command: ControlCommand | str
    result: Any = None
    error: Optional[ErrorInfo] = None


def _did_nothing(result: Optional[PollResult]) -> bool:
    return result is not None and result.sample_count == 0 and result.batch_count == 0


def _error_key(experiment_name: str, trial_name: str, worker_name: str) -> str:
    return names.worker_key(experiment_name, trial_name, f"error/{worker_name}")


def read_status(experiment_name: str, trial_name: str, worker_name: str) -> WorkerStatus:
    """The status of ``worker_name``; LOST when its key is missing."""
    try:
        value = name_resolve.get(names.worker_status(experiment_name, trial_name, worker_name))
    except name_resolve.NameEntryNotFoundError:
        return WorkerStatus.LOST
    try:
        return WorkerStatus(value)
    except ValueError:
        raise ValueError(
            f"Worker {worker_name} has an invalid status {value!r} in name_resolve; "
            f"expected one of {[s.value for s in WorkerStatus]}."
        ) from None


def read_error(experiment_name: str, trial_name: str, worker_name: str) -> Optional[ErrorInfo]:
    """The error a failed worker published, or None."""
    try:
        text = name_resolve.get(_error_key(experiment_name, trial_name, worker_name))
    except name_resolve.NameEntryNotFoundError:
        return None
    return ErrorInfo(**json.loads(text))


def clear_error(experiment_name: str, trial_name: str, worker_name: str) -> None:
    """Forget a failed worker's ERROR status and error (before restarting it alone)."""
    for key in (
        _error_key(experiment_name, trial_name, worker_name),
        names.worker_status(experiment_name, trial_name, worker_name),
    ):
        try:
            name_resolve.delete(key)
        except name_resolve.NameEntryNotFoundError:
            pass


class WorkerControlServer:
    """The worker's end of the control channel: a ZMQ REP socket.

    The address is published under ``names.worker(exp, trial, worker_name)``
    with a keepalive TTL, so it also tells the controller the process is alive.
    """

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        worker_name: str,
        *,
        host: Optional[str] = None,
        keepalive_ttl: float = DEFAULT_STATUS_TTL,
    ):
        self.worker_name = worker_name
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.bind(f"tcp://{host or network.gethostip()}:*")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._key = names.worker(experiment_name, trial_name, worker_name)
        name_resolve.add(self._key, self.address, keepalive_ttl=keepalive_ttl, replace=True)
        self._closed = False

    def recv(self, timeout: float) -> Any:
        """The next request, or None if none arrives within ``timeout`` s.

        A message that cannot be unpickled comes back as an
        :class:`UnreadableControlRequest` (caused by the unpickling error) instead of
        raising: the worker must still answer it, or the controller's REQ socket
        hangs, and the answer should carry the real error.
        """
        if not self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN):
            return None
        got = auth.recv(self._sock, CONTROL_KIND, f"{self.worker_name}'s control socket")
        if got is None:
            # Dropped (no valid MAC): a REP socket must answer before it can receive again;
            # the sender gets an empty frame, never a pickle.
            self._sock.send(b"")
            return None
        buf = got[1]
        try:
            return pickle.loads(buf)
        except Exception as e:
            err = UnreadableControlRequest(
                f"{self.worker_name} could not unpickle a control request ({len(buf)} bytes): "
                f"{e!r}. A configure request carries the experiment's worker config, whose "
                "classes must be importable in the worker process too: define them in a "
                "module (not the launcher's __main__) and pass it to the worker with "
                "`--import MODULE` (realhf.apps.remote), or put it on the workers' PYTHONPATH."
            )
            err.__cause__ = e
            return err

    def send(self, reply: ControlReply) -> None:
        """Answer the request last received."""
        auth.send(self._sock, CONTROL_KIND, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self) -> None:
        """Close the socket and withdraw the address."""
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        try:
            name_resolve.delete(self._key)
        except Exception:  # expired or cleared already
            pass


class ControlCommandError(Exception):
    """A control request that is invalid in the worker's current state."""


class UnreadableControlRequest(Exception):
    """A control request the worker could not unpickle (see :meth:`WorkerControlServer.recv`).

    Unlike a :class:`ControlCommandError` it fails the worker: the request was meant
    for it (usually ``configure``), and it cannot carry it out in this process.
    """


class Worker:
    """Base class of every worker (sync poll loop); see the module docstring.

    Args:
        experiment_name, trial_name: the run.
        worker_type, worker_index: who this worker is (``model_worker``, 3).
        status_ttl: keepalive TTL of the status key (seconds).
        controller_watch_interval: if set, every this many seconds after
            configure, check that the controller is alive and exit (code 1)
            when it is gone.  ``realhf.apps.remote`` sets it; in-process tests
            drive workers without a controller and leave it None.
    """

    #: the config dataclass ``_configure`` expects (checked on configure)
    config_class: ClassVar[Optional[type]] = None

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        worker_type: str,
        worker_index: int,
        *,
        status_ttl: float = DEFAULT_STATUS_TTL,
        controller_watch_interval: Optional[float] = None,
    ):
        if status_ttl <= 0:
            raise ValueError(f"status_ttl must be > 0 seconds, got {status_ttl!r}.")
        self.experiment_name = experiment_name
        self.trial_name = trial_name
        self.worker_type = worker_type
        self.worker_index = worker_index
        self.worker_name = f"{worker_type}/{worker_index}"
        self.status_ttl = status_ttl
        self.controller_watch_interval = controller_watch_interval
        self.logger = logging.getLogger(self.worker_name, "system")
        self.worker_info: Optional[WorkerInformation] = None
        self.config: Any = None
        self.status: Optional[WorkerStatus] = None
        self.poll_count = 0
        self.exit_code: Optional[int] = None
        self._next_controller_check = 0.0

    # ---- subclass hooks -------------------------------------------------

    def _configure(self, config: Any) -> None:
        """Build the worker from ``config`` (called once)."""

    def _poll(self) -> PollResult:
        """Do one unit of work; called repeatedly while RUNNING."""
        raise NotImplementedError(f"{type(self).__name__} must implement _poll().")

    def _on_start(self) -> None:
        """Called on ``start`` before the status becomes RUNNING."""

    def _on_pause(self) -> None:
        """Called on ``pause``."""

    def _on_interrupt(self) -> None:
        """Called on ``interrupt``: abandon work in progress."""

    def _exit_hook(self) -> None:
        """Release resources; called once when the loop ends (any reason).

        It runs from any state: also when ``configure`` never came, could not be read,
        or raised half-way.  So release only what was built, and give every resource
        it touches a ``None`` default that exists before ``_configure`` (a class
        attribute), rather than assuming ``_configure`` got that far.
        """

    # ---- status ---------------------------------------------------------

    @property
    def exiting(self) -> bool:
        """Whether the loop will end (``exit`` received or the worker failed)."""
        return self.exit_code is not None

    def _set_status(self, status: WorkerStatus) -> None:
        self.status = status
        key = names.worker_status(self.experiment_name, self.trial_name, self.worker_name)
        if status == WorkerStatus.ERROR:
            # No TTL and kept after exit: the controller must still see ERROR
            # (not LOST) after this process has gone.
            name_resolve.add(key, status.value, replace=True, delete_on_exit=False)
        else:
            name_resolve.add(key, status.value, keepalive_ttl=self.status_ttl, replace=True)
        self.logger.info(f"status -> {status.value}")

    def _fail(self, exc: BaseException, during: str) -> ErrorInfo:
        """Publish ERROR and the error, and make the loop end with code 1."""
        info = ErrorInfo.from_exception(exc, worker=self.worker_name, handle_name=during)
        self.logger.error(f"failed during {during}:\n{info.traceback}")
        try:
            name_resolve.add(
                _error_key(self.experiment_name, self.trial_name, self.worker_name),
                json.dumps(dataclasses.asdict(info)),
                replace=True,
                delete_on_exit=False,
            )
            self._set_status(WorkerStatus.ERROR)
        except Exception as e:  # the store is gone; the exit code still tells
            self.logger.error(f"could not publish ERROR status: {e!r}")
        self.exit_code = 1
        return info

    # ---- control --------------------------------------------------------

    def handle_control(self, command: ControlCommand | str, **kwargs) -> Any:
        """Apply control ``command`` (see the module docstring) and return its result.

        Raises:
            ControlCommandError: unknown command, bad arguments, or a command invalid
                in the current state (refused; the worker carries on).
            Exception: whatever ``_configure``/hooks raise (the worker has failed).
        """
        try:
            cmd = ControlCommand(command)
        except (ValueError, TypeError):
            raise ControlCommandError(
                f"unknown control command {command!r}; valid: {list(CONTROL_COMMANDS)}."
            ) from None
        handler = _CONTROL_HANDLERS[cmd]
        # Check the arguments before the call: a TypeError raised inside a handler is the
        # worker failing, not the controller sending bad arguments.
        try:
            inspect.signature(handler).bind(self, **kwargs)
        except TypeError as e:
            raise ControlCommandError(
                f"bad arguments for control command {cmd.value!r}: {e}."
            ) from None
        return handler(self, **kwargs)

    def _cmd_configure(self, worker_info: WorkerInformation, config: Any) -> None:
        if self.worker_info is not None:
            raise ControlCommandError(f"{self.worker_name} is already configured.")
        if not isinstance(worker_info, WorkerInformation):
            raise ControlCommandError(
                f"configure needs a WorkerInformation, got {type(worker_info).__name__}."
            )
        mine = (self.experiment_name, self.trial_name, self.worker_type, self.worker_index)
        theirs = (
            worker_info.experiment_name,
            worker_info.trial_name,
            worker_info.worker_type,
            worker_info.worker_index,
        )
        if mine != theirs:
            raise ControlCommandError(
                f"configure for {theirs} reached worker {mine}; the controller and the "
                "launcher disagree on experiment/trial/worker names."
            )
        if self.config_class is not None and not isinstance(config, self.config_class):
            raise ControlCommandError(
                f"{type(self).__name__} expects a {self.config_class.__name__} config, got "
                f"{type(config).__name__}. Check the experiment's workers[{self.worker_type!r}]."
            )
        self.worker_info, self.config = worker_info, config
        self._configure(config)
        self._set_status(WorkerStatus.READY)
        self._next_controller_check = time.monotonic() + (self.controller_watch_interval or 0)

    def _cmd_start(self) -> None:
        if self.worker_info is None:
            raise ControlCommandError(f"{self.worker_name} cannot start before configure.")
        if self.status in (WorkerStatus.COMPLETED, WorkerStatus.ERROR):
            raise ControlCommandError(
                f"{self.worker_name} cannot start: it is {self.status.value}."
            )
        self._on_start()
        self._set_status(WorkerStatus.RUNNING)

    def _cmd_pause(self) -> None:
        if self.status == WorkerStatus.RUNNING:
            self._on_pause()
            self._set_status(WorkerStatus.PAUSED)

    def _cmd_interrupt(self) -> None:
        if self.status in (WorkerStatus.RUNNING, WorkerStatus.PAUSED, WorkerStatus.READY):
            self._on_interrupt()
            self._set_status(WorkerStatus.INTERRUPTED)

    def _cmd_ping(self) -> Dict[str, Any]:
        return {
            "worker": self.worker_name,
            "pid": os.getpid(),
            "host": network.gethostname(),
            "status": self.status.value if self.status else None,
            "poll_count": self.poll_count,
        }

    def _cmd_exit(self) -> None:
        self.exit_code = 0 if self.exit_code is None else self.exit_code

    def _serve_control(self, control: WorkerControlServer, timeout: float) -> None:
        """Answer at most one control request (waiting up to ``timeout`` s)."""
        req = control.recv(timeout)
        if req is None:
            return
        if isinstance(req, UnreadableControlRequest):
            # Like a configure that raised: ERROR, the error in this worker's log and
            # in the reply, exit code 1.  The command is unknown, the message unread.
            info = self._fail(req, during="an unreadable control request")
            control.send(ControlReply(self.worker_name, "?", error=info))
            return
        if not isinstance(req, ControlRequest):
            control.send(
                ControlReply(
                    self.worker_name,
                    "?",
                    error=ErrorInfo.from_exception(
                        TypeError(f"not a ControlRequest: {req!r}"), worker=self.worker_name
                    ),
                )
            )
            return
        try:
            result = self.handle_control(req.command, **dict(req.kwargs))
        except ControlCommandError as e:
            # Bad request from the controller: refuse it and carry on.
            control.send(
                ControlReply(
                    self.worker_name,
                    req.command,
                    error=ErrorInfo.from_exception(
                        e, worker=self.worker_name, handle_name=str(req.command)
                    ),
                )
            )
            return
        except Exception as e:
            info = self._fail(e, during=str(req.command))
            control.send(ControlReply(self.worker_name, req.command, error=info))
            return
        control.send(ControlReply(self.worker_name, req.command, result=result))

    def _check_controller(self) -> None:
        # Not once an exit is decided: the controller removes its key as soon as every
        # worker has answered its `exit`, which may be within the loop iteration that
        # handled it (the run would end with exit code 1 after completing).
        if self.controller_watch_interval is None or self.worker_info is None or self.exiting:
            return
        now = time.monotonic()
        if now < self._next_controller_check:
            return
        self._next_controller_check = now + self.controller_watch_interval
        if read_status(self.experiment_name, self.trial_name, CONTROLLER_NAME) == WorkerStatus.LOST:
            self.logger.error(
                "the controller's status key is gone (controller exited or died); exiting."
            )
            self.exit_code = 1

    def _after_poll(self, result: Any) -> None:
        self.poll_count += 1
        if not isinstance(result, PollResult):
            raise TypeError(
                f"{type(self).__name__}._poll must return a PollResult, "
                f"got {type(result).__name__}."
            )
        if result.completed:
            self._set_status(WorkerStatus.COMPLETED)

    # ---- loops ----------------------------------------------------------

    def step(self) -> Optional[PollResult]:
        """Poll once if RUNNING (for in-process use); failures end the worker."""
        if self.status != WorkerStatus.RUNNING or self.exiting:
            return None
        try:
            result = self._poll()
            self._after_poll(result)
        except Exception as e:
            self._fail(e, during="poll")
            return None
        return result

    def run(self, control: WorkerControlServer, idle_wait: float = 0.05) -> int:
        """Serve control and poll until ``exit`` or failure; return the exit code.

        Control requests are answered between polls, so a long ``_poll``
        delays them (status and liveness go through name_resolve and are not
        affected).  While not RUNNING the loop waits up to ``idle_wait`` s for
        a control request; after a poll that did no work (empty PollResult)
        it waits :data:`NO_WORK_WAIT` s, so an idle worker does not spin.
        """
        last: Optional[PollResult] = None
        try:
            while not self.exiting:
                if self.status != WorkerStatus.RUNNING:
                    wait = idle_wait
                else:
                    wait = NO_WORK_WAIT if _did_nothing(last) else 0
                self._serve_control(control, wait)
                self._check_controller()
                last = self.step()
        finally:
            self._close(control)
        return self.exit_code

    def _close(self, control: WorkerControlServer) -> None:
        try:
            self._exit_hook()
        except Exception:
            self.logger.exception("exit hook failed")
            self.exit_code = self.exit_code or 1
        control.close()
        self.logger.info(f"exiting with code {self.exit_code}")


#: What each control command runs (called with the worker and the request's kwargs).  The
#: base class's own methods: subclasses customise through the ``_on_*`` hooks, so that the
#: state checks and status updates of every command stay the same for all workers.
_CONTROL_HANDLERS: Dict[ControlCommand, Callable[..., Any]] = {
    ControlCommand.CONFIGURE: Worker._cmd_configure,
    ControlCommand.START: Worker._cmd_start,
    ControlCommand.PAUSE: Worker._cmd_pause,
    ControlCommand.INTERRUPT: Worker._cmd_interrupt,
    ControlCommand.PING: Worker._cmd_ping,
    ControlCommand.EXIT: Worker._cmd_exit,
}


class AsyncWorker(Worker):
    """A worker whose poll is a coroutine (master worker, rollout workers).

    Subclasses implement ``async _poll_async()``; ``run`` drives it in an
    event loop created for the worker, serving control between polls.
    """

    def _poll(self) -> PollResult:
        raise TypeError(f"{type(self).__name__} is an AsyncWorker: implement _poll_async().")

    async def _poll_async(self) -> PollResult:
        """One unit of work; called repeatedly while RUNNING."""
        raise NotImplementedError(f"{type(self).__name__} must implement _poll_async().")

    async def step_async(self) -> Optional[PollResult]:
        """Poll once if RUNNING; failures end the worker."""
        if self.status != WorkerStatus.RUNNING or self.exiting:
            return None
        try:
            result = await self._poll_async()
            self._after_poll(result)
        except Exception as e:
            self._fail(e, during="poll")
            return None
        return result

    def step(self) -> Optional[PollResult]:
        raise TypeError("AsyncWorker: use `await step_async()` (run() drives the loop).")

    def run(self, control: WorkerControlServer, idle_wait: float = 0.05) -> int:
        """Run the loop in a new event loop; return the exit code."""
        return asyncio.run(self._run_async(control, idle_wait))

    async def _run_async(self, control: WorkerControlServer, idle_wait: float) -> int:
        try:
            while not self.exiting:
                self._serve_control(control, 0)
                self._check_controller()
                if self.status == WorkerStatus.RUNNING:
                    last = await self.step_async()
                    # Let the worker's own tasks run; back off when it had no work.
                    await asyncio.sleep(NO_WORK_WAIT if _did_nothing(last) else 0)
                else:
                    await asyncio.sleep(idle_wait)
        finally:
            self._close(control)
        return self.exit_code


# ---- registry -------------------------------------------------------------

_WORKERS: Dict[str, Type[Worker]] = {}


def register_worker(worker_type: str, cls: Optional[Type[Worker]] = None):
    """Register ``cls`` as worker type ``worker_type`` (usable as a decorator)."""

    def _register(c: Type[Worker]) -> Type[Worker]:
        if not (isinstance(c, type) and issubclass(c, Worker)):
            raise TypeError(f"worker type {worker_type!r}: {c!r} is not a Worker subclass.")
        old = _WORKERS.get(worker_type)
        if old is not None and old.__qualname__ != c.__qualname__:
            raise ValueError(f"worker type {worker_type!r} is already registered ({old!r}).")
        _WORKERS[worker_type] = c
        return c

    if not isinstance(worker_type, str) or not worker_type or "/" in worker_type:
        raise ValueError(f"worker type must be a non-empty name without '/', got {worker_type!r}.")
    return _register if cls is None else _register(cls)


#: Where each built-in worker type is defined; importing the module registers it.  Listed
#: here (as names, not imports: those modules sit above this one) so that a launched
#: process needs no ``--import`` for them.
BUILTIN_WORKER_MODULES: Dict[str, str] = {
    "master_worker": "realhf.system.dag.master_worker",
    "model_worker": "realhf.system.dag.model_worker",
    "generation_server": "realhf.system.rollout.generation_server",
    "gserver_manager": "realhf.system.rollout.manager.worker",
    "rollout_worker": "realhf.system.rollout.rollout_worker",
}


def make_worker(worker_type: str, *args, **kwargs) -> Worker:
    """Build a worker of a registered type (``Worker.__init__`` arguments).

    A built-in type not yet registered is imported from :data:`BUILTIN_WORKER_MODULES`.
    """
    module = BUILTIN_WORKER_MODULES.get(worker_type)
    if worker_type not in _WORKERS and module is not None:
        import importlib

        importlib.import_module(module)
    if worker_type not in _WORKERS:
        raise ValueError(
            f"Unknown worker type {worker_type!r}; registered: {registered_worker_types()}. "
            "Import the module that registers it (realhf.apps.remote --import MODULE)."
        )
    return _WORKERS[worker_type](*args, **kwargs)


class ExperimentStatus(str, enum.Enum):
    """Values of ``names.experiment_status``: the controller writes RUNNING at start and
    COMPLETE, ABORTED or STOPPED (on a stop request) at the end (kept after exit, so a
    launcher can tell them apart)."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    ABORTED = "ABORTED"
    STOPPED = "STOPPED"


def experiment_ended(experiment_name: str, trial_name: str) -> bool:
    """Whether ``names.experiment_status`` says the run is over (absent: not over).

    Workers that run until the experiment ends (generation servers, rollout workers, the
    gserver manager) poll it: they have no step count of their own to finish at.
    """
    try:
        status = name_resolve.get(names.experiment_status(experiment_name, trial_name))
    except name_resolve.NameEntryNotFoundError:
        return False
    return status != ExperimentStatus.RUNNING.value


def registered_worker_types() -> List[str]:
    """Names of all registered worker types, sorted."""
    return sorted(_WORKERS)
