"""Launch an experiment's controller and workers as local subprocesses.

:class:`LocalScheduler` starts each process in its own session (so its process
group holds it and everything it spawns), writes its stdout/stderr to
``{run_dir}/logs/{worker_type}_{index}.log``, and on failure, timeout, Ctrl-C
or interpreter exit kills every group it started: SIGINT/SIGTERM first, then
SIGKILL after a grace period.  Nothing it launched outlives it, short of the
launcher itself being SIGKILLed (then ``realhf.apps.remote`` processes die
with it: they ask the kernel for a parent-death signal).

:func:`launch_experiment` is the whole local launch: build the command lines
of ``python -m realhf.apps.remote`` for the controller and for every worker
of an :class:`~realhf.api.core.system_api.ExperimentConfig`, submit them, wait.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Dict, List, Mapping, Optional, Sequence

from realhf.api.core.system_api import ExperimentConfig
from realhf.base import logging, name_resolve, names, proc_group

logger = logging.getLogger("local_scheduler", "system")

__all__ = [
    "Job",
    "JobFailure",
    "LocalScheduler",
    "visible_gpus",
    "remote_controller_cmd",
    "remote_worker_cmd",
    "launch_experiment",
]

CONTROLLER_TYPE = "controller"
LOG_TAIL_LINES = 25


@dataclasses.dataclass
class Job:
    """One launched process."""

    worker_type: str
    index: int
    cmd: List[str]
    log_path: str
    popen: subprocess.Popen
    #: set when the scheduler stopped it as a straggler after a successful run
    stopped_as_straggler: bool = False

    @property
    def name(self) -> str:
        """``{worker_type}/{index}``."""
        return f"{self.worker_type}/{self.index}"

    @property
    def pid(self) -> int:
        """Process id (also its process-group id)."""
        return self.popen.pid

    @property
    def returncode(self) -> Optional[int]:
        """Exit code once it has exited (negative: killed by that signal)."""
        return self.popen.poll()

    def describe_exit(self) -> str:
        """``exit code 1`` / ``killed by SIGKILL`` / ``running``."""
        rc = self.returncode
        if rc is None:
            return "running"
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exit code {rc}"

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last ``n`` lines of the job's log file."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"
        return "\n".join(lines[-n:])


class JobFailure(RuntimeError):
    """Launched processes failed; names each with its exit and log tail."""

    def __init__(self, failed: Sequence[Job], headline: str = "launched processes failed"):
        self.failed = list(failed)
        parts = [headline + ":"]
        for j in self.failed:
            parts.append(
                f"--- {j.name} ({j.describe_exit()}), log {j.log_path} ---\n{j.log_tail()}"
            )
        super().__init__("\n".join(parts))


def visible_gpus() -> List[str]:
    """The CUDA devices this process may hand out: ``$CUDA_VISIBLE_DEVICES`` when set, else
    every device torch sees (none without CUDA)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


# Schedulers alive in this process, stopped at exit (weak: a scheduler that
# was garbage-collected has already stopped its jobs).
_live: "weakref.WeakSet[LocalScheduler]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for s in list(_live):
        s.stop_all()


class LocalScheduler:
    """Start, watch and stop local processes.

    Args:
        run_dir: logs go to ``{run_dir}/logs/``.
        env: extra environment for every process (on top of ``os.environ``).
        gpu_devices: device ids handed out round-robin to jobs that ask for
            GPUs; default :func:`visible_gpus`.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        env: Optional[Mapping[str, str]] = None,
        gpu_devices: Optional[Sequence[str]] = None,
    ):
        self.run_dir = os.path.abspath(run_dir)
        self.log_dir = os.path.join(self.run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = dict(env or {})
        if gpu_devices is None:
            gpu_devices = visible_gpus()
        self.gpu_devices = [str(d) for d in gpu_devices]
        self._next_gpu = 0
        self.jobs: List[Job] = []
        self._lock = threading.Lock()
        _live.add(self)

    # ---- submit ---------------------------------------------------------

    def submit(
        self,
        worker_type: str,
        cmd: Sequence[str],
        count: int = 1,
        *,
        env: Optional[Mapping[str, str]] = None,
        gpus_per_process: int = 0,
    ) -> List[Job]:
        """Start ``count`` processes of ``worker_type``; return their jobs.

        Every ``{index}`` in the arguments of ``cmd`` becomes the process's
        index (0..count-1), which is also in ``$REALHF_WORKER_INDEX``.
        """
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"submit({worker_type!r}): count must be an int >= 1, got {count!r}.")
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise ValueError(
                f"submit({worker_type!r}): cmd must be a non-empty list of str, got {cmd!r}."
            )
        if gpus_per_process > len(self.gpu_devices):
            raise ValueError(
                f"submit({worker_type!r}) asks for {gpus_per_process} GPU(s) per process but "
                f"only {len(self.gpu_devices)} device(s) are known ({self.gpu_devices}); set "
                "CUDA_VISIBLE_DEVICES or pass gpu_devices."
            )
        taken = {j.index for j in self.jobs if j.worker_type == worker_type}
        start = max(taken) + 1 if taken else 0
        new = []
        for index in range(start, start + count):
            argv = [a.replace("{index}", str(index)) for a in cmd]
            penv = dict(os.environ)
            penv.update(self.env)
            penv.update(env or {})
            penv["REALHF_WORKER_INDEX"] = str(index)
            penv["REALHF_PARENT_PID"] = str(os.getpid())
            penv.setdefault("PYTHONUNBUFFERED", "1")
            if gpus_per_process:
                devs = [
                    self.gpu_devices[(self._next_gpu + k) % len(self.gpu_devices)]
                    for k in range(gpus_per_process)
                ]
                self._next_gpu = (self._next_gpu + gpus_per_process) % len(self.gpu_devices)
                penv["CUDA_VISIBLE_DEVICES"] = ",".join(devs)
            log_path = os.path.join(self.log_dir, f"{worker_type}_{index}.log")
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=penv,
                    start_new_session=True,
                )
            job = Job(worker_type, index, argv, log_path, popen)
            with self._lock:
                self.jobs.append(job)
            new.append(job)
            logger.debug(f"started {job.name} pid {job.pid}: {' '.join(argv)}")
        return new

    def find(self, worker_type: str, index: int = 0) -> Job:
        """The job ``worker_type/index``."""
        for j in self.jobs:
            if j.worker_type == worker_type and j.index == index:
                return j
        raise KeyError(f"no job {worker_type}/{index}; jobs: {[j.name for j in self.jobs]}")

    # ---- wait -----------------------------------------------------------

    def wait(
        self,
        *,
        timeout: Optional[float] = None,
        main_type: str = CONTROLLER_TYPE,
        failure_grace: float = 30.0,
        exit_grace: float = 15.0,
        check_interval: float = 0.1,
    ) -> Dict[str, int]:
        """Wait for the jobs; stop them all on failure; return exit codes by name.

        Jobs of ``main_type`` (the controller) decide the outcome: when they
        have exited, the others get ``exit_grace`` s to finish and are then
        killed (as stragglers, not counted as failures).
        When any job fails, the main jobs get ``failure_grace`` s to notice
        and report (the controller's report is the better error) before
        everything is killed.  Ctrl-C (SIGINT) and SIGTERM are forwarded to
        every job, then everything is stopped.  Without ``main_type`` jobs,
        all jobs must exit 0.

        Raises:
            JobFailure: some job failed (names each failed job, with log tail).
            TimeoutError: ``timeout`` s passed (all jobs are stopped).
            KeyboardInterrupt: on Ctrl-C / SIGTERM, after stopping all jobs.
        """
        if not self.jobs:
            raise RuntimeError("LocalScheduler.wait(): nothing was submitted.")
        restore = self._install_signal_handlers()
        try:
            return self._wait(timeout, main_type, failure_grace, exit_grace, check_interval)
        except KeyboardInterrupt:
            logger.warning("interrupted: forwarding SIGINT to all jobs, then stopping them")
            self.stop_all(first_signal=signal.SIGINT)
            raise
        except BaseException:
            self.stop_all()
            raise
        finally:
            restore()

    def _wait(
        self, timeout, main_type, failure_grace, exit_grace, check_interval
    ) -> Dict[str, int]:
        t0 = time.monotonic()
        mains = [j for j in self.jobs if j.worker_type == main_type] or list(self.jobs)
        first_failure: Optional[float] = None
        while True:
            failed = [j for j in self.jobs if j.returncode not in (None, 0)]
            if all(j.returncode is not None for j in mains):
                # Whatever the outcome, the controller has told the workers to
                # exit: let them finish doing so before stopping the rest.
                self._drain_others(exit_grace)
                failed = [
                    j
                    for j in self.jobs
                    if j.returncode not in (None, 0) and not j.stopped_as_straggler
                ]
                failed_mains = [j for j in mains if j.returncode != 0]
                if failed_mains:
                    raise JobFailure(failed_mains + [j for j in failed if j not in failed_mains])
                if failed:
                    raise JobFailure(failed, "the controller succeeded but these processes failed")
                return {j.name: j.returncode for j in self.jobs}
            now = time.monotonic()
            if failed and first_failure is None:
                first_failure = now
                logger.warning(
                    f"{[f'{j.name} ({j.describe_exit()})' for j in failed]} failed; giving "
                    f"{[j.name for j in mains]} up to {failure_grace:g}s to report"
                )
            if first_failure is not None and now - first_failure > failure_grace:
                raise JobFailure(
                    failed,
                    f"processes failed and {[j.name for j in mains]} did not finish "
                    f"within {failure_grace:g}s",
                )
            if timeout is not None and now - t0 > timeout:
                running = [j.name for j in self.jobs if j.returncode is None]
                raise TimeoutError(
                    f"local run did not finish within {timeout:g}s; still running: {running}. "
                    f"Logs are in {self.log_dir}."
                )
            time.sleep(check_interval)

    def _drain_others(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while any(j.returncode is None for j in self.jobs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stragglers = [j for j in self.jobs if j.returncode is None]
        if stragglers:
            logger.warning(
                f"{[j.name for j in stragglers]} still running {grace:g}s after the "
                "controller finished; stopping them"
            )
            for j in stragglers:
                j.stopped_as_straggler = True
        self.stop_all()

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def _raise(signum, frame):
            raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

        old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}

        def restore():
            for s, h in old.items():
                signal.signal(s, h)

        return restore

    # ---- stop -----------------------------------------------------------

    def stop_all(self, grace: float = 5.0, first_signal: int = signal.SIGTERM) -> None:
        """Signal every job's process group, wait ``grace`` s, SIGKILL the rest, reap."""
        with self._lock:
            jobs = list(self.jobs)
        if not jobs:
            return
        stuck = proc_group.stop_groups([j.popen for j in jobs], grace, first_signal)
        for j in jobs:
            if j.popen in stuck:
                logger.error(f"{j.name} (process group {j.pid}) did not die after SIGKILL")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_all()


# ---- commands of realhf.apps.remote -----------------------------------------


def remote_worker_cmd(
    worker_type: str,
    experiment_name: str,
    trial_name: str,
    *,
    imports: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> List[str]:
    """``python -m realhf.apps.remote worker ...`` with ``{index}`` for submit()."""
    cmd = [
        sys.executable,
        "-m",
        "realhf.apps.remote",
        "worker",
        "--type",
        worker_type,
        "--index",
        "{index}",
        "--experiment",
        experiment_name,
        "--trial",
        trial_name,
    ]
    for m in imports:
        cmd += ["--import", m]
    return cmd + list(extra)


def remote_controller_cmd(
    experiment_name: str,
    trial_name: str,
    *,
    experiment_type: Optional[str] = None,
    experiment_args_path: Optional[str] = None,
    summary_path: Optional[str] = None,
    imports: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> List[str]:
    """``python -m realhf.apps.remote controller ...``."""
    cmd = [
        sys.executable,
        "-m",
        "realhf.apps.remote",
        "controller",
        "--experiment",
        experiment_name,
        "--trial",
        trial_name,
    ]
    if experiment_type:
        cmd += ["--experiment-type", experiment_type]
    if experiment_args_path:
        cmd += ["--experiment-args", experiment_args_path]
    if summary_path:
        cmd += ["--summary", summary_path]
    for m in imports:
        cmd += ["--import", m]
    return cmd + list(extra)


def launch_experiment(
    experiment: ExperimentConfig,
    experiment_name: str,
    trial_name: str,
    *,
    run_dir: str,
    name_resolve_spec: str,
    experiment_type: Optional[str] = None,
    experiment_args: Optional[dict] = None,
    imports: Sequence[str] = (),
    controller_extra: Sequence[str] = (),
    worker_extra: Sequence[str] = (),
    timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    fileroot: Optional[str] = None,
    scheduler: Optional[LocalScheduler] = None,
) -> Dict[str, int]:
    """Run ``experiment`` locally: controller + every worker, wait, stop all.

    The trial's name-resolve keys are cleared first.  The controller rebuilds
    ``experiment`` from ``experiment_type`` (default
    ``experiment_name``) and ``experiment_args`` (pickled to
    ``{run_dir}/experiment_args.pkl``); ``imports`` are modules that register
    the experiment and its worker types.  The controller's outcome is written
    to ``{run_dir}/controller_summary.json``.  ``fileroot`` becomes the
    processes' ``$REALHF_FILEROOT``.  Returns exit codes by job name.

    Raises:
        JobFailure, TimeoutError, KeyboardInterrupt: see :meth:`LocalScheduler.wait`.
    """
    # Start from a clean trial: stale keys of an earlier run (e.g. the ERROR
    # status a failed worker leaves behind) would mislead the new one.
    repo = name_resolve.from_spec(name_resolve_spec)
    try:
        repo.clear_subtree(names.trial_root(experiment_name, trial_name))
    finally:
        repo.close()
    os.makedirs(run_dir, exist_ok=True)
    args_path = os.path.join(run_dir, "experiment_args.pkl")
    with open(args_path, "wb") as f:
        pickle.dump(dict(experiment_args or {}), f)
    penv = {"REALHF_NAME_RESOLVE": name_resolve_spec, "REALHF_DIE_WITH_PARENT": "1"}
    if fileroot is not None:
        penv["REALHF_FILEROOT"] = os.path.abspath(fileroot)
    penv.update(env or {})
    sched = scheduler or LocalScheduler(run_dir, env=penv)
    if scheduler is not None:
        sched.env.update(penv)
    sched.submit(
        CONTROLLER_TYPE,
        remote_controller_cmd(
            experiment_name,
            trial_name,
            experiment_type=experiment_type,
            experiment_args_path=args_path,
            summary_path=os.path.join(run_dir, "controller_summary.json"),
            imports=imports,
            extra=controller_extra,
        ),
    )
    for wtype in experiment.ordered_types:
        sch = experiment.scheduling_of(wtype)
        sched.submit(
            wtype,
            remote_worker_cmd(
                wtype, experiment_name, trial_name, imports=imports, extra=worker_extra
            ),
            count=len(experiment.workers[wtype]),
            env=dict(sch.env),
            gpus_per_process=sch.gpu,
        )
    return sched.wait(timeout=timeout)
