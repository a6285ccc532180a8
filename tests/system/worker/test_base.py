"""Worker lifecycle, control commands and status publication (in-process)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from realhf.api.core.system_api import WorkerInformation
from realhf.base import name_resolve, names
from realhf.system.worker.base import (
    _CONTROL_HANDLERS,
    CONTROL_COMMANDS,
    AsyncWorker,
    ControlCommand,
    ControlCommandError,
    PollResult,
    Worker,
    WorkerControlServer,
    WorkerStatus,
    make_worker,
    read_error,
    read_status,
    register_worker,
    registered_worker_types,
)
from realhf.system.worker.controller import WorkerControlPanel

pytestmark = pytest.mark.usefixtures("memory_name_resolve")
EXP = "wb"


@dataclasses.dataclass(frozen=True)
class CountConfig:
    n: int
    fail_at: int = -1


class CountWorker(Worker):
    """Counts to ``n`` polls, then completes; raises at poll ``fail_at``."""

    config_class = CountConfig

    def _configure(self, config):
        if config.n < 0:
            raise ValueError("n must be >= 0")
        self.count = 0
        self.events = []

    def _poll(self):
        if self.count == self.config.fail_at:
            raise RuntimeError(f"boom at {self.count}")
        self.count += 1
        return PollResult(sample_count=1, completed=self.count >= self.config.n)

    def _on_start(self):
        self.events.append("start")

    def _on_pause(self):
        self.events.append("pause")

    def _on_interrupt(self):
        self.events.append("interrupt")

    def _exit_hook(self):
        self.events.append("exit")


register_worker("test_count", CountWorker)


def _info(trial, index=0, count=1, wtype="test_count"):
    return WorkerInformation(EXP, trial, wtype, index, count)


def _worker(trial, index=0):
    return make_worker("test_count", EXP, trial, "test_count", index)


def test_lifecycle_and_status_in_name_resolve(trial):
    w = _worker(trial)
    name = w.worker_name
    assert read_status(EXP, trial, name) == WorkerStatus.LOST  # nothing published yet
    w.handle_control(ControlCommand.CONFIGURE, worker_info=_info(trial), config=CountConfig(n=3))
    assert read_status(EXP, trial, name) == WorkerStatus.READY
    assert w.step() is None  # not running: no poll
    w.handle_control(ControlCommand.START)
    assert read_status(EXP, trial, name) == WorkerStatus.RUNNING
    assert w.step() == PollResult(sample_count=1)
    w.handle_control(ControlCommand.PAUSE)
    assert read_status(EXP, trial, name) == WorkerStatus.PAUSED
    assert w.step() is None
    w.handle_control(ControlCommand.START)
    w.step()
    assert w.step().completed
    assert read_status(EXP, trial, name) == WorkerStatus.COMPLETED
    assert w.step() is None  # completed workers stop polling
    ping = w.handle_control(ControlCommand.PING)
    assert (
        ping["worker"] == "test_count/0"
        and ping["status"] == "COMPLETED"
        and ping["poll_count"] == 3
    )
    assert w.events == ["start", "pause", "start"]
    w.handle_control(ControlCommand.EXIT)
    assert w.exit_code == 0 and w.exiting


def test_control_commands_keep_their_wire_names_and_all_have_a_handler():
    assert CONTROL_COMMANDS == ("configure", "start", "pause", "interrupt", "ping", "exit")
    assert [ControlCommand(c) for c in CONTROL_COMMANDS] == list(ControlCommand)
    assert set(_CONTROL_HANDLERS) == set(ControlCommand)


def test_interrupt(trial):
    w = _worker(trial)
    w.handle_control("configure", worker_info=_info(trial), config=CountConfig(n=5))
    w.handle_control("start")
    w.handle_control("interrupt")
    assert w.status == WorkerStatus.INTERRUPTED and w.events == ["start", "interrupt"]
    assert w.step() is None


def test_poll_error_publishes_error_with_traceback(trial):
    w = _worker(trial)
    w.handle_control("configure", worker_info=_info(trial), config=CountConfig(n=5, fail_at=1))
    w.handle_control("start")
    w.step()
    assert w.step() is None
    assert w.exit_code == 1
    assert read_status(EXP, trial, w.worker_name) == WorkerStatus.ERROR
    info = read_error(EXP, trial, w.worker_name)
    assert info.worker == "test_count/0" and info.handle_name == "poll"
    assert "boom at 1" in info.message and "_poll" in info.traceback
    # ERROR must outlive the process: it is not removed at exit.
    name_resolve.reset()
    assert read_status(EXP, trial, w.worker_name) == WorkerStatus.ERROR


@pytest.mark.parametrize(
    "command, kwargs, match",
    [
        ("fly", {}, "unknown control command 'fly'"),
        ("start", {}, "cannot start before configure"),
        ("ping", {"x": 1}, "bad arguments for control command 'ping'"),
        ("configure", {"worker_info": "me", "config": CountConfig(1)}, "needs a WorkerInformation"),
        ("configure", {"config": CountConfig(1)}, "bad arguments"),
    ],
)
def test_invalid_control_commands_are_refused(trial, command, kwargs, match):
    w = _worker(trial)
    with pytest.raises(ControlCommandError, match=match):
        w.handle_control(command, **kwargs)
    assert not w.exiting


def test_configure_checks_identity_and_config_type(trial):
    w = _worker(trial)
    with pytest.raises(ControlCommandError, match="expects a CountConfig config, got dict"):
        w.handle_control("configure", worker_info=_info(trial), config={"n": 1})
    with pytest.raises(ControlCommandError, match="reached worker"):
        w.handle_control(
            "configure", worker_info=_info(trial, index=1, count=2), config=CountConfig(1)
        )
    w.handle_control("configure", worker_info=_info(trial), config=CountConfig(1))
    with pytest.raises(ControlCommandError, match="already configured"):
        w.handle_control("configure", worker_info=_info(trial), config=CountConfig(1))


def test_registry_errors():
    assert "test_count" in registered_worker_types()
    with pytest.raises(ValueError, match="Unknown worker type 'nope'.*test_count"):
        make_worker("nope", EXP, "t", "nope", 0)
    with pytest.raises(ValueError, match="already registered"):
        register_worker("test_count", type("Other", (Worker,), {}))
    with pytest.raises(TypeError, match="not a Worker subclass"):
        register_worker("x", int)
    with pytest.raises(ValueError, match="without '/'"):
        register_worker("a/b", CountWorker)


class AsyncCounter(AsyncWorker):
    async def _poll_async(self):
        await asyncio.sleep(0)
        self.n = getattr(self, "n", 0) + 1
        return PollResult(completed=self.n >= 2)


def test_async_worker_steps(trial):
    w = AsyncCounter(EXP, trial, "async_counter", 0)
    w.handle_control("configure", worker_info=_info(trial, wtype="async_counter"), config=None)
    w.handle_control("start")

    async def drive():
        return [await w.step_async(), await w.step_async(), await w.step_async()]

    assert asyncio.run(drive()) == [PollResult(), PollResult(completed=True), None]
    with pytest.raises(TypeError, match="step_async"):
        w.step()


@pytest.mark.parametrize("cls", [CountWorker, AsyncCounter])
def test_run_loop_over_control_socket(trial, cls):
    """The real loop: a panel configures/starts/pings/exits a worker thread."""
    wtype = "test_count" if cls is CountWorker else "async_counter"
    w = cls(EXP, trial, wtype, 0)
    control = WorkerControlServer(EXP, trial, w.worker_name)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", w.run(control, idle_wait=0.01)))
    t.start()
    panel = WorkerControlPanel(EXP, trial, [w.worker_name], connect_timeout=5)
    try:
        panel.request(
            ControlCommand.CONFIGURE,
            kwargs={
                w.worker_name: dict(
                    worker_info=_info(trial, wtype=wtype),
                    config=CountConfig(n=3) if cls is CountWorker else None,
                )
            },
            timeout=5,
        )
        panel.request(ControlCommand.START, timeout=5)
        for _ in range(100):
            if read_status(EXP, trial, w.worker_name) == WorkerStatus.COMPLETED:
                break
            threading.Event().wait(0.02)
        assert read_status(EXP, trial, w.worker_name) == WorkerStatus.COMPLETED
        reply = panel.request(ControlCommand.PING, timeout=5)[w.worker_name]
        assert reply.result["status"] == "COMPLETED"
        refused = panel.request("start", timeout=5, raise_errors=False)[w.worker_name]
        assert refused.error is not None and "COMPLETED" in refused.error.message
        assert refused.error.handle_name == "start"
        panel.request(ControlCommand.EXIT, timeout=5)
        t.join(timeout=5)
        assert result["rc"] == 0
        # The control address is withdrawn on exit.
        with pytest.raises(name_resolve.NameEntryNotFoundError):
            name_resolve.get(names.worker(EXP, trial, w.worker_name))
    finally:
        panel.close()
        if t.is_alive():
            w.exit_code = 1
            t.join(timeout=5)


def test_worker_exits_when_the_controller_is_gone(trial):
    """A worker configured by a controller leaves once the controller's status key is gone."""
    w = CountWorker(EXP, trial, "test_count", 0, controller_watch_interval=0.0)
    controller_key = names.worker_status(EXP, trial, "controller/0")
    name_resolve.add(controller_key, "RUNNING")
    w.handle_control("configure", worker_info=_info(trial), config=CountConfig(n=10**6))
    w.handle_control("start")
    w._check_controller()
    assert not w.exiting
    name_resolve.delete(controller_key)
    w._check_controller()
    assert w.exit_code == 1


def test_an_exit_received_is_not_undone_by_the_controller_leaving(trial):
    """The controller removes its key once every worker answered `exit`: a worker that
    checks it within the same loop iteration still exits with 0 (a completed run)."""
    w = CountWorker(EXP, trial, "test_count", 0, controller_watch_interval=0.0)
    controller_key = names.worker_status(EXP, trial, "controller/0")
    name_resolve.add(controller_key, "RUNNING")
    w.handle_control("configure", worker_info=_info(trial), config=CountConfig(n=10**6))
    w.handle_control("start")
    w.handle_control("exit")
    name_resolve.delete(controller_key)
    w._check_controller()
    assert w.exit_code == 0
