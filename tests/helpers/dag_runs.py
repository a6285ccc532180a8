"""Launching the dag-test experiment (``dag_test_experiment``) from tests, and reading a run.

Shared by the end-to-end DAG tests: ``launch(root, trial, **experiment_kwargs)`` runs the
experiment with the local launcher under ``root`` and makes sure it leaves no process
behind; ``metrics(run_dir)`` reads the master's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time

import dag_test_experiment as dag_test
import psutil

from realhf.api.core.system_api import make_experiment
from realhf.scheduler import forkserver
from realhf.scheduler.local import JobFailure, launch_experiment

EXP = "dag-test"


def _children():
    """Live descendants, not counting the fork servers (they serve every launch of the
    session; what they fork is counted)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE
    } - set(forkserver.shared_pids())


def launch(root, trial, **kw):
    """Run dag-test; returns (exit codes or the JobFailure, run dir)."""
    kw = dict(model_path=str(root / "model"), log_dir=str(root / trial / "ids"), **kw)
    run_dir = root / EXP / trial
    before = _children()
    try:
        result = launch_experiment(
            make_experiment(EXP, **kw),
            EXP,
            trial,
            run_dir=str(run_dir),
            name_resolve_spec=f"file://{root / 'name_resolve'}",
            imports=[dag_test.__name__],
            timeout=240,
            fileroot=str(root),
        )
    except JobFailure as e:
        result = e
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (_children() - before), "processes left behind"
    return result, run_dir


def metrics(run_dir):
    """The master's metrics lines of a run."""
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]
