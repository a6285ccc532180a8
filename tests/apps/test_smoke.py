"""The smoke experiment as real processes: success (file, etcd), ERROR, and a killed worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from realhf.api.core import system_api
from realhf.base import name_resolve, names
from realhf.experiments import smoke as smoke_exp
from realhf.scheduler.local import JobFailure, LocalScheduler, launch_experiment
from realhf.system.worker.base import WorkerStatus, read_status

pytestmark = pytest.mark.slow


def _run_demo(tmp_path, *extra):
    out = subprocess.run(
        [sys.executable, "-m", "realhf.apps.smoke", "--fileroot", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out


def _check_demo_output(out):
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "all 5 workers COMPLETED" in text
    assert "configured smoke_consumer -> smoke_model -> smoke_master -> smoke_producer" in text
    assert "3 rounds of typed SquareRequest -> smoke_model/0, smoke_model/1" in text
    assert "remote error delivered: ValueError" in text and "from smoke_model/1" in text
    assert "pushed 20 typed Rollout messages" in text and "received 20" in text


def test_demo_over_file_name_resolve(tmp_path, no_leftover_processes):
    t0 = time.monotonic()
    out = _run_demo(tmp_path)
    _check_demo_output(out)
    assert time.monotonic() - t0 < 30
    logs = sorted(os.listdir(tmp_path / "smoke" / "demo" / "logs"))
    assert logs == [
        "controller_0.log",
        "smoke_consumer_0.log",
        "smoke_master_0.log",
        "smoke_model_0.log",
        "smoke_model_1.log",
        "smoke_producer_0.log",
    ]
    # Every key of the trial was removed by its owner on exit, except the outcome.
    repo = name_resolve.make_repository("file", root=str(tmp_path / "name_resolve"))
    try:
        status_key = names.experiment_status("smoke", "demo")
        assert repo.find_subtree(names.trial_root("smoke", "demo")) == [status_key]
        assert repo.get(status_key) == "COMPLETE"
    finally:
        repo.close()
    no_leftover_processes()


@pytest.mark.etcd
def test_demo_over_etcd(tmp_path, etcd_server, no_leftover_processes):
    out = _run_demo(tmp_path, "--name-resolve", f"etcd3://{etcd_server.address}", "--trial", "etcd")
    _check_demo_output(out)
    assert f"etcd3://{etcd_server.address}" in out.stdout
    no_leftover_processes()


def _launch_in_thread(tmp_path, trial, controller_extra=(), **exp_kwargs):
    """Start the smoke experiment from a thread; return (scheduler, thread, outcome)."""
    run_dir = tmp_path / "smoke" / trial
    spec = f"file://{tmp_path / 'name_resolve'}"
    kwargs = dict(result_dir=str(run_dir / "results"), **exp_kwargs)
    exp = system_api.make_experiment("smoke", **kwargs)
    sched = LocalScheduler(str(run_dir))
    outcome = {}

    def target():
        try:
            outcome["codes"] = launch_experiment(
                exp,
                "smoke",
                trial,
                run_dir=str(run_dir),
                name_resolve_spec=spec,
                imports=[smoke_exp.__name__],
                timeout=90,
                scheduler=sched,
                fileroot=str(tmp_path),
                controller_extra=controller_extra,
            )
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return sched, t, outcome, run_dir


def _summary(run_dir):
    with open(run_dir / "controller_summary.json") as f:
        return json.load(f)


def test_killed_worker_is_reported_lost_and_everything_stops(tmp_path, no_leftover_processes):
    trial = "kill"
    name_resolve.reconfigure("file", root=str(tmp_path / "name_resolve"))
    try:
        # Many slow rounds: the run is still going when the worker is killed.
        sched, t, outcome, run_dir = _launch_in_thread(
            tmp_path, trial, n_rounds=100000, round_interval_s=0.02
        )
        deadline = time.monotonic() + 60
        while read_status("smoke", trial, "smoke_model/1") != WorkerStatus.RUNNING:
            assert time.monotonic() < deadline, "smoke_model/1 never reached RUNNING"
            assert t.is_alive(), outcome
            time.sleep(0.1)
        victim = sched.find("smoke_model", 1)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not (run_dir / "controller_summary.json").exists():
            assert time.monotonic() - killed_at < 30, "controller did not report within 30 s"
            time.sleep(0.1)
        reported_after = time.monotonic() - killed_at
        t.join(timeout=60)
        assert not t.is_alive()
    finally:
        name_resolve.reconfigure("memory")
    summary = _summary(run_dir)
    assert summary["ok"] is False
    # The killed worker is LOST; the master may also report that its peer vanished.
    assert set(summary["failures"]) <= {"smoke_model/1", "smoke_master/0"}
    assert summary["failures"]["smoke_model/1"].startswith("LOST")
    if "smoke_master/0" in summary["failures"]:
        assert "smoke_model/1" in summary["failures"]["smoke_master/0"]
    assert reported_after < 30
    err = outcome["error"]
    assert isinstance(err, JobFailure)
    assert {j.name for j in err.failed} >= {"controller/0", "smoke_model/1"}
    assert "smoke_model/1 (killed by SIGKILL)" in str(err)
    # The others were told to exit and did so cleanly.
    for name in ("smoke_model", "smoke_consumer", "smoke_producer"):
        job = sched.find(name, 0)
        assert job.returncode == 0, (job.name, job.describe_exit(), job.log_tail())
    print(f"LOST reported {reported_after:.1f}s after SIGKILL")
    no_leftover_processes()


def test_worker_error_is_reported_with_remote_traceback(tmp_path, no_leftover_processes):
    sched, t, outcome, run_dir = _launch_in_thread(
        tmp_path,
        "crash",
        controller_extra=["--failure-settle", "0.5"],
        crash_worker="smoke_model/0",
        crash_after=2,
    )
    t.join(timeout=90)
    assert not t.is_alive()
    summary = _summary(run_dir)
    # The master waiting on smoke_model/0 may notice its exit within the settle time too
    # (its liveness ping fails); it then names the dead handler.
    assert "smoke_model/0" in summary["failures"]
    assert set(summary["failures"]) <= {"smoke_model/0", "smoke_master/0"}
    if "smoke_master/0" in summary["failures"]:
        assert "'smoke_model/0' is not connected" in summary["failures"]["smoke_master/0"]
    reason = summary["failures"]["smoke_model/0"]
    assert reason.startswith("ERROR during poll")
    assert "injected failure in smoke_model/0 after 2 units of work" in reason
    assert "Traceback" in reason and "_count_work" in reason
    assert isinstance(outcome["error"], JobFailure)
    assert sched.find("smoke_model", 0).returncode == 1
    no_leftover_processes()
