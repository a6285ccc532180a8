"""The controller against worker threads (real sockets, in-memory name_resolve).

The multi-process version (real SIGKILL of a worker) is in tests/apps/test_smoke.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from realhf.api.core.system_api import ExperimentConfig
from realhf.base import name_resolve, names
from realhf.system.transport.errors import ExperimentFailed, StreamTimeout
from realhf.system.worker.base import (
    PollResult,
    Worker,
    WorkerControlServer,
    WorkerStatus,
    read_status,
)
from realhf.system.worker.controller import Controller, WorkerControlPanel

pytestmark = pytest.mark.usefixtures("memory_name_resolve")
EXP = "wc"
ORDER_LOG = []


@dataclasses.dataclass(frozen=True)
class StepConfig:
    steps: int = 3
    fail_in: str = ""  # "configure" | "poll"
    vanish: bool = False  # drop the status key (as a dead process would)


class StepWorker(Worker):
    config_class = StepConfig

    def _configure(self, config):
        ORDER_LOG.append(self.worker_name)
        if config.fail_in == "configure":
            raise OSError("cannot open checkpoint")
        self.n = 0

    def _poll(self):
        time.sleep(0.01)
        self.n += 1
        if self.config.fail_in == "poll" and self.n == 2:
            raise RuntimeError("exploded in poll")
        if self.config.vanish and self.n == 2:
            # Simulate a process death: the keepalive'd keys disappear.
            name_resolve.delete(names.worker_status(EXP, self.trial_name, self.worker_name))
            name_resolve.delete(names.worker(EXP, self.trial_name, self.worker_name))
            self.exit_code = 9
            return PollResult()
        return PollResult(completed=self.n >= self.config.steps)


class Fleet:
    """Worker threads for an ExperimentConfig."""

    def __init__(self, trial, exp: ExperimentConfig):
        self.workers, self.threads, self.codes = [], [], {}
        for wtype, cfgs in exp.workers.items():
            for i in range(len(cfgs)):
                w = StepWorker(EXP, trial, wtype, i)
                control = WorkerControlServer(EXP, trial, w.worker_name)
                t = threading.Thread(
                    target=lambda w=w, c=control: self.codes.__setitem__(
                        w.worker_name, w.run(c, idle_wait=0.01)
                    ),
                    daemon=True,
                )
                t.start()
                self.workers.append(w)
                self.threads.append(t)

    def join(self):
        for t in self.threads:
            t.join(timeout=10)
        return self.codes


def _exp(**overrides):
    workers = {"servers": [StepConfig()], "trainers": [StepConfig(), StepConfig()]}
    for name, cfg in overrides.items():
        wtype, idx = name.split("/")
        workers[wtype][int(idx)] = cfg
    return ExperimentConfig(workers=workers, configure_order=("servers", "trainers"))


def _controller(trial, **kw):
    kw.setdefault("poll_interval", 0.05)
    kw.setdefault("connect_timeout", 5)
    kw.setdefault("failure_settle", 0.2)
    return Controller(EXP, trial, **kw)


def test_successful_run_configures_in_order_and_exits_everyone(trial):
    exp = ExperimentConfig(
        workers={"trainers": [StepConfig(), StepConfig()], "servers": [StepConfig()]},
        configure_order=("servers", "trainers"),
    )
    fleet = Fleet(trial, exp)
    ORDER_LOG.clear()
    summary = _controller(trial).run(exp, timeout=20)
    assert ORDER_LOG[0] == "servers/0" and sorted(ORDER_LOG[1:]) == ["trainers/0", "trainers/1"]
    assert summary.configure_order == ["servers", "trainers"]
    assert set(summary.statuses.values()) == {"COMPLETED"}
    assert fleet.join() == {"servers/0": 0, "trainers/0": 0, "trainers/1": 0}
    # The controller withdrew its own status and recorded the outcome.
    assert read_status(EXP, trial, "controller/0") == WorkerStatus.LOST
    assert name_resolve.get(names.experiment_status(EXP, trial)) == "COMPLETE"


def test_error_in_poll_is_reported_with_traceback_and_others_stopped(trial):
    exp = _exp(**{"trainers/1": StepConfig(steps=1000, fail_in="poll")})
    exp.workers["servers"][0] = StepConfig(steps=10**6)
    fleet = Fleet(trial, exp)
    with pytest.raises(ExperimentFailed) as ei:
        _controller(trial).run(exp, timeout=20)
    err = ei.value
    assert list(err.failures) == ["trainers/1"]
    assert "ERROR during poll" in err.failures["trainers/1"]
    assert "exploded in poll" in err.failures["trainers/1"]
    assert "Traceback" in err.failures["trainers/1"]
    codes = fleet.join()
    assert codes["trainers/1"] == 1 and codes["servers/0"] == 0
    assert name_resolve.get(names.experiment_status(EXP, trial)) == "ABORTED"


def test_configure_error_stops_before_start(trial):
    exp = _exp(**{"servers/0": StepConfig(fail_in="configure")})
    fleet = Fleet(trial, exp)
    ORDER_LOG.clear()
    with pytest.raises(ExperimentFailed) as ei:
        _controller(trial).run(exp, timeout=20)
    assert "servers/0" in ei.value.failures
    assert "cannot open checkpoint" in ei.value.failures["servers/0"]
    assert ORDER_LOG == ["servers/0"], "later types are not configured after a failure"
    codes = fleet.join()
    assert codes["servers/0"] == 1 and codes["trainers/0"] == 0


def test_vanished_worker_is_reported_lost(trial):
    exp = _exp(**{"trainers/0": StepConfig(steps=10**6, vanish=True)})
    exp.workers["servers"][0] = StepConfig(steps=10**6)
    fleet = Fleet(trial, exp)
    with pytest.raises(ExperimentFailed) as ei:
        _controller(trial).run(exp, timeout=20)
    assert list(ei.value.failures) == ["trainers/0"]
    assert ei.value.failures["trainers/0"].startswith("LOST")
    assert fleet.join()["servers/0"] == 0


def test_missing_workers_are_named(trial):
    exp = _exp()
    with pytest.raises(ExperimentFailed) as ei:
        _controller(trial, connect_timeout=0.3).run(exp)
    assert sorted(ei.value.failures) == ["servers/0", "trainers/0", "trainers/1"]
    assert "did not register their control address within 0.3s" in ei.value.failures["servers/0"]


def test_run_timeout_names_unfinished_workers(trial):
    exp = _exp(**{"servers/0": StepConfig(steps=10**6)})
    fleet = Fleet(trial, exp)
    with pytest.raises(TimeoutError, match=r"still not COMPLETED: \['servers/0'\]"):
        _controller(trial).run(exp, timeout=0.5)
    assert set(fleet.join().values()) == {0}


def test_completion_types_limit_what_must_finish(trial):
    exp = ExperimentConfig(
        workers={"servers": [StepConfig(steps=10**6)], "trainers": [StepConfig()]},
        configure_order=("servers", "trainers"),
        completion_types=("trainers",),
    )
    fleet = Fleet(trial, exp)
    summary = _controller(trial).run(exp, timeout=20)
    assert summary.statuses["servers/0"] == "RUNNING"
    assert fleet.join() == {"servers/0": 0, "trainers/0": 0}


def test_panel_timeout_resets_socket_and_names_worker(trial):
    # A control address whose owner never answers (no loop serving it).
    server = WorkerControlServer(EXP, trial, "mute/0")
    panel = WorkerControlPanel(EXP, trial, ["mute/0"], connect_timeout=5)
    try:
        with pytest.raises(
            StreamTimeout, match=r"\['mute/0'\] did not answer control command 'ping'"
        ):
            panel.request("ping", timeout=0.3)
        # The REQ socket was recreated: sending again is possible.
        with pytest.raises(StreamTimeout):
            panel.request("ping", timeout=0.2)
        with pytest.raises(ValueError, match="Unknown workers"):
            panel.request("ping", ["other/0"])
    finally:
        panel.close()
        server.close()


def test_experiment_config_validation():
    with pytest.raises(ValueError, match="does not list worker types \\['b'\\]"):
        ExperimentConfig(workers={"a": [1], "b": [1]}, configure_order=("a",))
    with pytest.raises(ValueError, match="non-empty list of configs"):
        ExperimentConfig(workers={"a": []}, configure_order=("a",))
    with pytest.raises(ValueError, match="completion_types"):
        ExperimentConfig(workers={"a": [1]}, configure_order=("a",), completion_types=("z",))
    with pytest.raises(ValueError, match="poll_interval must be a positive number"):
        Controller(EXP, "t", poll_interval=0)
