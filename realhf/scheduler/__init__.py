"""Launchers: run an experiment's controller and workers locally, on Ray or through SLURM.

Every launcher module has a ``launch_experiment(experiment, experiment_name, trial_name, *,
run_dir, name_resolve_spec, imports, timeout, fileroot,
options)`` with the contract of :func:`realhf.scheduler.local.launch_experiment`: it runs
``python -m realhf.apps.remote`` for the controller and every worker, waits, stops
everything it started, returns exit codes by job name and raises
:class:`~realhf.scheduler.local.JobFailure` / ``TimeoutError`` / ``KeyboardInterrupt``.
``options`` is the launcher's section of the config (``cfg.ray``, ``cfg.slurm``; None for
local).  A launch the cluster cannot run as configured (tools missing, an unreachable
cluster, a partition that does not exist, more resources than there are) raises
:class:`LaunchError` before anything is left running.
"""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["LaunchError", "launcher"]


class LaunchError(RuntimeError):
    """The launcher cannot run this launch as configured; the message names what and how to
    fix it.  Nothing of the launch is left queued or running."""


_MODULES = {
    "local": "realhf.scheduler.local",
    "ray": "realhf.scheduler.ray",
    "slurm": "realhf.scheduler.slurm",
}


def launcher(mode: str) -> Callable:
    """The ``launch_experiment`` of launcher ``mode``."""
    if mode not in _MODULES:
        raise ValueError(f"unknown launcher mode={mode!r}; use one of {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[mode]).launch_experiment
