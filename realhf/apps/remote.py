"""Entry point of every launched realhf process: the controller or one worker.

Launchers (``realhf.scheduler.local``, later Slurm/Ray) run::

    python -m realhf.apps.remote controller --experiment E --trial R \\
        --experiment-config RUN_DIR/experiment.pkl [--summary OUT.json] \\
        [--import MODULE ...] [--name-resolve SPEC] [--timeout S]
    python -m realhf.apps.remote worker --type T --index I --experiment E --trial R \\
        [--import MODULE ...] [--name-resolve SPEC]

``--name-resolve`` takes a spec (``file:///abs/root``, ``etcd3://host:port``);
default ``$REALHF_NAME_RESOLVE``, else the file backend under the file root.
``--import`` imports modules that register experiments or worker types
(the built-in worker types of ``realhf.system.worker.base.BUILTIN_WORKER_MODULES`` are
found without it).

The controller runs the experiment its launcher built and pickled to
``--experiment-config`` (:class:`realhf.system.worker.controller.Controller`): it is not
built twice (a build reads and checks the dataset, ~2 s for rw);
it exits 0 on success, 1 when workers failed (its log and ``--summary`` name
them and why), 3 (``STOPPED_EXIT_CODE``) when stopped on request.  A worker builds its
registered type and serves control until told to exit; it exits 0 after ``exit``, 1 after
a failure.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import pickle
import signal
import sys
from typing import List, Optional

from realhf.api.core import system_api
from realhf.apps import plugins
from realhf.base import constants, gcutil, logging, name_resolve, shutdown
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.system.transport.errors import ExperimentFailed, StopRequested
from realhf.system.worker import base as worker_base
from realhf.system.worker.controller import Controller

logger = logging.getLogger("remote", "system")

#: the controller's exit code after ``python -m realhf.apps.main stop``
STOPPED_EXIT_CODE = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m realhf.apps.remote",
        description="Run the controller or one worker of a realhf experiment.",
    )
    sub = p.add_subparsers(dest="role", required=True)

    def common(sp):
        sp.add_argument("--experiment", "-e", required=True, help="experiment name (keys, run dir)")
        sp.add_argument("--trial", "-f", required=True, help="trial name")
        sp.add_argument(
            "--name-resolve",
            default=None,
            help="name-resolve spec, e.g. file:///tmp/nr or etcd3://host:2379 "
            "(default: $REALHF_NAME_RESOLVE, else the file backend)",
        )
        sp.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=[],
            metavar="MODULE",
            help="module to import first (registers types)",
        )
        sp.add_argument(
            "--status-ttl",
            type=float,
            default=worker_base.DEFAULT_STATUS_TTL,
            help="keepalive TTL (s) of status keys",
        )

    c = sub.add_parser("controller", help="configure, start and watch the workers")
    common(c)
    c.add_argument(
        "--experiment-config",
        default=None,
        metavar="PATH",
        help="the built ExperimentConfig, pickled (launchers write RUN_DIR/experiment.pkl)",
    )
    c.add_argument("--summary", default=None, metavar="PATH", help="write the outcome as JSON here")
    c.add_argument("--poll-interval", type=float, default=1.0)
    c.add_argument("--connect-timeout", type=float, default=120.0)
    c.add_argument("--configure-timeout", type=float, default=600.0)
    c.add_argument(
        "--failure-settle",
        type=float,
        default=None,
        help="after a failure, keep watching this long for related failures "
        "(default: status TTL + poll interval)",
    )
    c.add_argument("--timeout", type=float, default=None, help="fail after this many seconds")

    w = sub.add_parser("worker", help="run one worker")
    common(w)
    w.add_argument("--type", "-w", required=True, dest="worker_type")
    w.add_argument("--index", "-i", required=True, type=int)
    w.add_argument(
        "--controller-watch-interval",
        type=float,
        default=5.0,
        help="exit when the controller has been gone this long (s)",
    )
    return p


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the launcher dies (set by the local scheduler)."""
    if os.environ.get("REALHF_DIE_WITH_PARENT") != "1" or not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    parent = os.environ.get("REALHF_PARENT_PID")
    if parent and os.getppid() != int(parent):  # the launcher died before prctl
        sys.exit("realhf.apps.remote: the launcher exited before this process started.")


def _setup(args) -> None:
    _die_with_parent()
    # SIGTERM -> SystemExit so atexit hooks run and name-resolve keys are removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.name_resolve:
        # The module builds its repository from this variable on first use.
        os.environ[name_resolve.ENV_VAR] = args.name_resolve
    try:
        name_resolve.repository()  # fail now, naming the spec, if it is unusable
    except (ValueError, ConnectionError, PermissionError) as e:
        raise SystemExit(f"realhf.apps.remote: name resolution is unusable: {e}") from e
    try:
        constants.set_experiment_trial_names(args.experiment, args.trial)
    except ValueError as e:
        raise SystemExit(f"realhf.apps.remote: {e}") from e
    for module in args.imports:
        try:
            plugins.import_plugin(module)
        except plugins.PluginError as e:
            raise SystemExit(f"realhf.apps.remote: --import {module}: {e}") from e


def _load_experiment(path: Optional[str]) -> system_api.ExperimentConfig:
    where = "realhf.apps.remote controller"
    if not path:
        raise SystemExit(
            f"{where}: --experiment-config PATH is required: the pickled ExperimentConfig a "
            "launcher writes to RUN_DIR/experiment.pkl (see realhf.scheduler.local.prepare_trial)."
        )
    try:
        with open(path, "rb") as f:
            experiment = pickle.load(f)  # the run directory's own file, written by the launch
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise SystemExit(f"{where}: cannot load --experiment-config {path}: {e}") from e
    if not isinstance(experiment, system_api.ExperimentConfig):
        raise SystemExit(
            f"{where}: --experiment-config {path} holds a {type(experiment).__name__}, "
            "not an ExperimentConfig."
        )
    return experiment


def run_controller(args) -> int:
    """Load the experiment, run it, report; 0 on success, 1 on failure."""
    experiment = _load_experiment(args.experiment_config)
    controller = Controller(
        args.experiment,
        args.trial,
        poll_interval=args.poll_interval,
        connect_timeout=args.connect_timeout,
        configure_timeout=args.configure_timeout,
        status_ttl=args.status_ttl,
        failure_settle=args.failure_settle,
    )
    outcome: dict
    try:
        summary = controller.run(experiment, timeout=args.timeout)
        outcome = {"ok": True, **dataclasses.asdict(summary)}
        logger.info(
            f"experiment {args.experiment!r} trial {args.trial!r} completed in "
            f"{summary.run_seconds:.2f}s: {summary.statuses}"
        )
        code = 0
    except ExperimentFailed as e:
        logger.error(str(e))
        outcome = {"ok": False, "failures": e.failures, "message": str(e)}
        code = 1
    except TimeoutError as e:
        logger.error(str(e))
        outcome = {"ok": False, "failures": {}, "message": str(e)}
        code = 1
    except StopRequested as e:
        logger.warning(str(e))
        outcome = {"ok": False, "failures": {}, "message": str(e), "stopped": True}
        code = STOPPED_EXIT_CODE
    if args.summary:
        write_json_atomic(args.summary, outcome, indent=2)
    return code


def keep_worker_memory(worker_type: str) -> bool:
    """For a worker that holds tensors (a model worker, a generation server), in a process
    of its own: the memory its tensors free stays in it for the next ones, instead of being
    faulted in again on every call (see :mod:`realhf.impl.tensor_pool`).  Large tensors come
    from realhf's tensor pool, smaller ones from the C heap, which keeps them too (see
    ``gcutil.keep_freed_memory``); a model worker trims the C heap at the end of each call.
    Returns whether the tensor pool was installed."""
    if worker_type not in ("model_worker", "generation_server"):
        return False
    gcutil.keep_freed_memory()
    from realhf.impl import tensor_pool

    try:
        return tensor_pool.install()
    except ValueError as e:  # a bad REALHF_TENSOR_POOL
        raise SystemExit(f"realhf.apps.remote worker: {e}") from e


def run_worker(args) -> int:
    """Build worker ``--type/--index`` and serve until told to exit."""
    if args.index < 0:
        raise SystemExit(f"realhf.apps.remote worker: --index must be >= 0, got {args.index}.")
    keep_worker_memory(args.worker_type)
    try:
        worker = worker_base.make_worker(
            args.worker_type,
            args.experiment,
            args.trial,
            args.worker_type,
            args.index,
            status_ttl=args.status_ttl,
            controller_watch_interval=args.controller_watch_interval,
        )
    except ValueError as e:  # unknown worker type
        raise SystemExit(f"realhf.apps.remote worker: {e}") from e
    control = worker_base.WorkerControlServer(
        args.experiment, args.trial, worker.worker_name, keepalive_ttl=args.status_ttl
    )
    logger.info(f"{worker.worker_name} (pid {os.getpid()}) serving control at {control.address}")
    return worker.run(control)


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` and run the controller or a worker; return the exit code."""
    args = _parser().parse_args(argv)
    _setup(args)
    if args.role == "controller":
        return run_controller(args)
    return run_worker(args)


if __name__ == "__main__":
    # Not sys.exit: a finished gloo rank could abort in interpreter teardown (base/shutdown.py).
    shutdown.run_and_exit(main)
