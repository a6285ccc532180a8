"""Launch an experiment's controller and workers as local subprocesses.

:class:`LocalScheduler` starts each process in its own session (so its process
group holds it and everything it spawns), writes its stdout/stderr to
``{run_dir}/logs/{worker_type}_{index}.log``, and on failure, timeout, Ctrl-C
or interpreter exit kills every group it started: SIGINT/SIGTERM first, then
SIGKILL after a grace period.  Nothing it launched outlives it, short of the
launcher itself being SIGKILLed (then ``realhf.apps.remote`` processes die
with it: they ask the kernel for a parent-death signal).  Those processes are forked
from the launcher's fork server (:mod:`realhf.scheduler.forkserver`), which has imported
torch & co. once and exits when the launcher does; any other command is executed.

:func:`launch_experiment` is the whole local launch: build the command lines
of ``python -m realhf.apps.remote`` for the controller and for every worker
of an :class:`~realhf.api.core.system_api.ExperimentConfig`, submit them, wait.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Union

from realhf.api.core.system_api import ExperimentConfig
from realhf.base import logging, name_resolve, names
from realhf.base.distributed import proc_group
from realhf.base.net import auth
from realhf.base.storage.atomic_file import write_atomic
from realhf.scheduler import forkserver
from realhf.scheduler.jobs import CONTROLLER_TYPE, JobFailure, JobSet, LaunchedJob

logger = logging.getLogger("local_scheduler", "system")

#: where in the run dir the launcher pickles the built experiment for the controller
EXPERIMENT_FILE = "experiment.pkl"

__all__ = [
    "Job",
    "JobFailure",
    "LocalScheduler",
    "visible_gpus",
    "remote_controller_cmd",
    "remote_worker_cmd",
    "launch_controller_cmd",
    "prepare_trial",
    "launch_experiment",
]


@dataclasses.dataclass
class Job(LaunchedJob):
    """One launched process."""

    worker_type: str
    index: int
    cmd: List[str]
    log_path: str
    #: the process: a Popen, or a child of the fork server that behaves like one
    popen: Union[subprocess.Popen, forkserver.ForkedProcess]
    #: set when the scheduler stopped it as a straggler after a successful run
    stopped_as_straggler: bool = False
    #: the process environment (a restart reuses it)
    env: Dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def pid(self) -> int:
        """Process id (also its process-group id)."""
        return self.popen.pid

    @property
    def returncode(self) -> Optional[int]:
        """Exit code once it has exited (negative: killed by that signal)."""
        return self.popen.poll()


def visible_gpus() -> List[str]:
    """The CUDA devices this process may hand out: ``$CUDA_VISIBLE_DEVICES`` when set, else
    every device torch sees (none without CUDA)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


class LocalScheduler(JobSet):
    """Start, watch and stop local processes (watched as :meth:`JobSet.wait` says).

    Args:
        run_dir: logs go to ``{run_dir}/logs/``.
        env: extra environment for every process (on top of ``os.environ``).
        gpu_devices: device ids handed out round-robin to jobs that ask for
            GPUs; default :func:`visible_gpus`.
    """

    run_name = "local run"

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
        #: fork realhf processes from the shared fork server (off: REALHF_FORKSERVER=0)
        self.fork = forkserver.enabled()
        self.stop_at_exit()

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
            penv.update(auth.child_env())  # launch_experiment's own secret file overrides
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
            job = Job(
                worker_type, index, argv, log_path, self._popen(argv, log_path, penv), env=penv
            )
            with self._lock:
                self.jobs.append(job)
            new.append(job)
            logger.debug(f"started {job.name} pid {job.pid}: {' '.join(argv)}")
        return new

    def _popen(self, argv: Sequence[str], log_path: str, env: Mapping[str, str]):
        # realhf's own processes are forked from a server that has imported torch and
        # co. once (see realhf.scheduler.forkserver); anything else is executed.
        return forkserver.launch(argv, env, log_path, fork=self.fork)

    def _relaunch(self, job: Job) -> None:
        old = job.popen
        proc_group.stop_groups([old], grace=0.0)  # children the old process left behind
        with open(job.log_path, "ab") as log:
            log.write(f"\n---- {job.name} restarted after {job.describe_exit()} ----\n".encode())
        with self._lock:
            job.popen = self._popen(job.cmd, job.log_path, job.env)
        logger.info(f"restarted {job.name}: pid {job.pid} (was {old.pid})")

    def _kill(self, job: Job) -> None:
        proc_group.signal_group(job.pid, signal.SIGKILL)

    def find(self, worker_type: str, index: int = 0) -> Job:
        """The job ``worker_type/index``."""
        for j in self.jobs:
            if j.worker_type == worker_type and j.index == index:
                return j
        raise KeyError(f"no job {worker_type}/{index}; jobs: {[j.name for j in self.jobs]}")

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
    experiment_path: Optional[str] = None,
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
    if experiment_path:
        cmd += ["--experiment-config", experiment_path]
    if summary_path:
        cmd += ["--summary", summary_path]
    for m in imports:
        cmd += ["--import", m]
    return cmd + list(extra)


def launch_controller_cmd(
    run_dir: str,
    experiment_name: str,
    trial_name: str,
    *,
    imports: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> List[str]:
    """:func:`remote_controller_cmd` of a launch: the experiment that
    :func:`prepare_trial` writes to ``run_dir``, the outcome to
    ``{run_dir}/controller_summary.json``."""
    return remote_controller_cmd(
        experiment_name,
        trial_name,
        experiment_path=os.path.join(run_dir, EXPERIMENT_FILE),
        summary_path=os.path.join(run_dir, "controller_summary.json"),
        imports=imports,
        extra=extra,
    )


def prepare_trial(
    run_dir: str,
    name_resolve_spec: str,
    experiment_name: str,
    trial_name: str,
    experiment: ExperimentConfig,
) -> None:
    """Clear the trial's name-resolve keys; pickle ``experiment`` into ``run_dir`` for the
    controller (which then runs what the launcher checked, without building it again)."""
    # Start from a clean trial: stale keys of an earlier run (e.g. the ERROR
    # status a failed worker leaves behind) would mislead the new one.
    repo = name_resolve.from_spec(name_resolve_spec)
    try:
        repo.clear_subtree(names.trial_root(experiment_name, trial_name))
    finally:
        repo.close()
    os.makedirs(run_dir, exist_ok=True)
    # Atomic: a relaunch into the same run dir never leaves the controller half a file.
    write_atomic(os.path.join(run_dir, EXPERIMENT_FILE), pickle.dumps(experiment))


def launch_experiment(
    experiment: ExperimentConfig,
    experiment_name: str,
    trial_name: str,
    *,
    run_dir: str,
    name_resolve_spec: str,
    imports: Sequence[str] = (),
    controller_extra: Sequence[str] = (),
    worker_extra: Sequence[str] = (),
    timeout: Optional[float] = None,
    env: Optional[Mapping[str, str]] = None,
    fileroot: Optional[str] = None,
    scheduler: Optional[LocalScheduler] = None,
) -> Dict[str, int]:
    """Run ``experiment`` locally: controller + every worker, wait, stop all.

    The trial's name-resolve keys are cleared first.  The controller runs
    ``experiment`` itself (pickled to ``{run_dir}/experiment.pkl``); ``imports`` are
    modules every process imports first (they register worker types, interfaces and
    the classes the experiment names).  The controller's outcome is written
    to ``{run_dir}/controller_summary.json``.  ``fileroot`` becomes the
    processes' ``$REALHF_FILEROOT``.  Returns exit codes by job name.

    Raises:
        JobFailure, TimeoutError, KeyboardInterrupt: see
            :meth:`realhf.scheduler.jobs.JobSet.wait`.
    """
    prepare_trial(run_dir, name_resolve_spec, experiment_name, trial_name, experiment)
    penv = {"REALHF_NAME_RESOLVE": name_resolve_spec, "REALHF_DIE_WITH_PARENT": "1"}
    # One machine: every socket of the run listens on loopback (unless the user pinned
    # another address), and the run gets a fresh secret (see realhf.base.net.auth).
    penv["REALHF_HOST_IP"] = os.environ.get("REALHF_HOST_IP") or "127.0.0.1"
    penv.update(auth.issue(run_dir))
    if fileroot is not None:
        penv["REALHF_FILEROOT"] = os.path.abspath(fileroot)
    penv.update(env or {})
    sched = scheduler or LocalScheduler(run_dir, env=penv)
    if scheduler is not None:
        sched.env.update(penv)
    sched.submit(
        CONTROLLER_TYPE,
        launch_controller_cmd(
            run_dir,
            experiment_name,
            trial_name,
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
    if not experiment.restartable_types:
        return sched.wait(timeout=timeout)
    # Partial restarts: failed jobs of these types are started again, and the controller's
    # restart requests (a hung process) kill the old process first.
    sched.restartable = {t: experiment.max_worker_restarts for t in experiment.restartable_types}
    repo = name_resolve.from_spec(name_resolve_spec)
    sched.take_restart_requests = lambda: take_restart_requests(repo, experiment_name, trial_name)
    try:
        return sched.wait(timeout=timeout)
    finally:
        sched.take_restart_requests = None
        repo.close()


def take_restart_requests(
    repo: name_resolve.NameRecordRepository, experiment_name: str, trial_name: str
) -> Dict[str, Optional[int]]:
    """The controller's restart requests ``{worker name: pid}``, removed from the store."""
    root = names.restart_requests(experiment_name, trial_name)
    out: Dict[str, Optional[int]] = {}
    try:
        for key in repo.find_subtree(root):
            try:
                pid = json.loads(repo.get(key)).get("pid")
            except (name_resolve.NameEntryNotFoundError, ValueError):
                pid = None
            out[key[len(root) :].strip("/")] = pid
            repo.delete(key)
    except Exception as e:  # noqa: BLE001 — the store may be briefly away; ask again later
        logger.warning(f"could not read restart requests: {e!r}")
    return out
