"""Launch an experiment's controller and workers through SLURM (``mode=slurm``).

One batch job per worker type, plus one for the controller.  Each job asks for
``--ntasks`` = the number of workers of its type with that type's resources per task
(``--cpus-per-task``, ``--mem-per-cpu``, ``--gpus-per-task``) and runs one ``srun``
step; task ``SLURM_PROCID`` is worker index ``I``.  Why not the alternatives:

* a heterogeneous job (one component per type) would be gang-scheduled, but SLURM
  puts every component on nodes of its own, so an experiment with more worker types
  than nodes would pend forever;
* one allocation with ``srun --exact`` steps forces one shape (CPUs, GPUs per task)
  on every process, and where the GPUs of the allocation land decides whether a
  GPU step fits at all.

Jobs are not gang-scheduled, so the launcher bounds how long they may pend
(``start_timeout``), refuses up front what the partition can never run, and submits the
workers before the controller so that the controller, which waits for them, starts last.

Every task runs the wrapper of :mod:`realhf.scheduler.slurm_task` around ``python -m
realhf.apps.remote ...``: it starts the process in a session of its own, records where
it runs and how it ended in ``{run_dir}/slurm/{type}_{index}.start/.exit``, forwards
signals, and kills whatever the process leaves behind in its group.  ``srun`` sends each
task's output to ``{run_dir}/logs/{type}_{index}.log`` (a shared file system is assumed).
The checks against the partition and the job states ``squeue`` reports live in
:mod:`realhf.scheduler.slurm_cluster`.

The watch loop is :meth:`realhf.scheduler.jobs.JobSet.wait`; in every outcome the jobs
are ``scancel``-ed and the launcher waits until ``squeue`` no longer lists them.  Job ids
and the node of every worker are logged and written to ``{run_dir}/placement.json``.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import time
from typing import Dict, List, Mapping, Optional, Sequence

from realhf.api.core.system_api import ExperimentConfig
from realhf.api.slurm_args import SlurmConfig
from realhf.base import logging
from realhf.base.net import auth
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.scheduler import slurm_cluster
from realhf.scheduler.jobs import CONTROLLER_TYPE, JobSet, interrupt_on_signals
from realhf.scheduler.local import launch_controller_cmd, prepare_trial, remote_worker_cmd
from realhf.scheduler.slurm_cluster import (
    CLIENT_COMMANDS,
    JobStates,
    SlurmError,
    WorkerGroup,
    run_client,
)
from realhf.scheduler.slurm_task import SlurmTask, task_cmd

logger = logging.getLogger("slurm_scheduler", "system")

__all__ = ["SlurmError", "SlurmTask", "SlurmScheduler", "WorkerGroup", "launch_experiment"]

# Pending reasons that no amount of waiting fixes.
HOPELESS_REASONS = (
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionDown",
    "PartitionInactive",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "QOSMaxCpuPerJobLimit",
    "QOSMaxGRESPerJob",
    "DependencyNeverSatisfied",
)
LOST_AFTER = 3.0  # s a finished job's task may take to show its exit file (shared FS lag)


class SlurmScheduler(JobSet):
    """Submit worker groups as batch jobs, watch them (as :meth:`JobSet.wait` says, plus
    :class:`SlurmError` for jobs that can never start), cancel them.

    Args:
        run_dir: logs go to ``{run_dir}/logs/``, scripts and task states to
            ``{run_dir}/slurm/``, placement to ``{run_dir}/placement.json``.
        options: the :class:`SlurmConfig`.
        job_prefix: jobs are named ``{job_prefix}:{worker_type}``.
        env: environment of the jobs (sbatch exports it to every task).
    """

    run_name = "SLURM run"
    interrupt_action = "cancelling every job"
    check_interval = drain_interval = 0.2

    def __init__(self, run_dir: str, options: SlurmConfig, job_prefix: str, env: Mapping[str, str]):
        self.run_dir = os.path.abspath(run_dir)
        self.log_dir = os.path.join(self.run_dir, "logs")
        self.state_dir = os.path.join(self.run_dir, "slurm")
        self.opts = options
        self.job_prefix = job_prefix
        self.env = dict(env)
        self.jobs: Dict[str, str] = {}  # worker type -> job id
        self.tasks: List[SlurmTask] = []
        self.job_states = JobStates(self._client, options.poll_interval)
        self.excluded: List[str] = []  # nodes of the partition outside slurm.nodelist
        self._placed = False  # placement.json written with every task's node
        self.stop_at_exit()

    # ---- client commands ----------------------------------------------------

    def _client(self, *cmd: str, check: bool = True, env: Optional[Mapping[str, str]] = None):
        return run_client(
            *cmd,
            env=self.env if env is None else env,
            timeout=self.opts.submit_timeout,
            check=check,
        )

    def check_fits(self, groups: Sequence[WorkerGroup]) -> str:
        """Refuse what the partition can never run; return the partition used."""
        partition, self.excluded = slurm_cluster.check_fits(self._client, self.opts, groups)
        return partition

    # ---- submit -------------------------------------------------------------

    def submit(self, group: WorkerGroup, partition: str) -> str:
        """Write ``group``'s batch script, sbatch it, return the job id."""
        os.makedirs(self.log_dir, exist_ok=True)
        os.makedirs(self.state_dir, exist_ok=True)
        t = group.worker_type
        per_task = [f"--ntasks={group.count}", f"--cpus-per-task={group.cpus}"]
        if group.gpus:
            per_task.append(f"--gpus-per-task={group.gpus}")
        log = os.path.join(self.log_dir.replace("%", "%%"), f"{t}_%t.log")
        srun = ["srun", "--mpi=none", "--kill-on-bad-exit=0", *per_task]
        srun += [f"--output={log}", "--open-mode=append"]
        script = os.path.join(self.state_dir, f"{t}.sbatch")
        with open(script, "w") as f:
            f.write(
                "#!/bin/bash\n"
                f"# {self.job_prefix}:{t}, written by {__name__}: one task per worker.\n"
                f"exec {shlex.join(srun + task_cmd(self.state_dir, t, group.cmd))}\n"
            )
        sbatch = ["sbatch", "--parsable", f"--job-name={self.job_prefix}:{t}", *per_task]
        sbatch += [f"--output={os.path.join(self.state_dir, t)}.batch.log", "--open-mode=append"]
        if group.mem_mb:
            sbatch.append(f"--mem-per-cpu={math.ceil(group.mem_mb / group.cpus)}")
        if partition:
            sbatch.append(f"--partition={partition}")
        if self.excluded:
            sbatch.append(f"--exclude={','.join(self.excluded)}")
        sbatch += [f"--chdir={os.getcwd()}", "--export=ALL", *self.opts.sbatch_args, script]
        out = self._client(*sbatch, env=dict(self.env, **group.env))
        job_id = out.stdout.strip().split(";")[0]
        self.jobs[t] = job_id
        for i in range(group.count):
            log_path = os.path.join(self.log_dir, f"{t}_{i}.log")
            self.tasks.append(SlurmTask(t, i, job_id, log_path, self.state_dir))
        logger.info(f"submitted {t} ({group.count} task(s)) as job {job_id}")
        return job_id

    # ---- watch ---------------------------------------------------------------

    def poll(self, force: bool = False) -> None:
        """Refresh job states (squeue, at most every poll_interval s) and task files."""
        self.job_states.refresh(list(self.jobs.values()), force)
        now = time.monotonic()
        for t in self.tasks:
            t.refresh()
            ended = self.job_states.ended_at.get(t.job_id)
            if t.exit_info is None and t.lost is None and ended and now - ended > LOST_AFTER:
                state = self.job_states.state(t.job_id)[0]
                started = f"on {t.node}" if t.node else "before the task started"
                t.lost = (
                    f"no exit status: job {t.job_id} ended ({state}) {started}; see "
                    f"{os.path.join(self.state_dir, t.worker_type)}.batch.log"
                )

    def check_pending(self, since_submit: float) -> None:
        """Fail on jobs that will never start, or that pend past start_timeout."""
        pending = {
            t: (s[1] or "?")
            for t, j in self.jobs.items()
            if (s := self.job_states.state(j))[0] == "PENDING"
        }
        hopeless = {t: r for t, r in pending.items() if r.startswith(HOPELESS_REASONS)}
        if hopeless:
            raise SlurmError(f"jobs can never start (type: squeue reason): {hopeless}")
        if pending and since_submit > self.opts.start_timeout:
            raise TimeoutError(
                f"jobs still pending after {self.opts.start_timeout:g}s (slurm.start_timeout), "
                f"type: squeue reason: {pending}"
            )

    def placement(self) -> dict:
        """Job ids, nodes and per-worker nodes (what placement.json holds)."""
        return {
            "jobs": {
                t: {
                    "job_id": j,
                    "state": self.job_states.states.get(j, ("?",))[0],
                    "nodes": self.job_states.state(j)[2],
                }
                for t, j in self.jobs.items()
            },
            "workers": {
                t.name: {"job_id": t.job_id, "node": t.node, "exit": t.describe_exit()}
                for t in self.tasks
            },
        }

    def write_placement(self) -> None:
        write_json_atomic(os.path.join(self.run_dir, "placement.json"), self.placement(), indent=2)

    # ---- what the watch loop asks ----------------------------------------------

    def _watched(self) -> List[SlurmTask]:
        return self.tasks

    def _poll(self, wait_s: float) -> None:
        time.sleep(wait_s)
        # Once every task has exited, what is left to see is the jobs ending.
        self.poll(force=not any(t.returncode is None for t in self.tasks))

    def _check_progress(self, elapsed: float) -> None:
        if self._placed:
            return
        if all(t.start_info for t in self.tasks):
            self._placed = True
            self.write_placement()
            logger.info(
                "placement: " + ", ".join(f"{t.name}@{t.node} (job {t.job_id})" for t in self.tasks)
            )
        else:
            self.check_pending(elapsed)

    def _busy(self) -> bool:
        # A job whose tasks all exited still ends its step and batch script.
        return super()._busy() or any(self.job_states.alive(j) for j in self.jobs.values())

    def _timeout_context(self) -> str:
        return f"; jobs {self.jobs}"

    def _after_wait(self) -> None:
        self.write_placement()

    # ---- stop ----------------------------------------------------------------

    def stop_all(self, grace: float = 5.0, first_signal: int = signal.SIGTERM) -> None:
        """:meth:`cancel_all` (SLURM signals the tasks and SIGKILLs them after its KillWait)."""
        self.cancel_all()

    def cancel_all(self, wait: float = 60.0) -> None:
        """scancel every job that may still run; wait until squeue shows none of them."""
        if not self.jobs:
            return
        self._poll_quietly()
        # Unknown counts as alive; terminal states are final, so stale ones are still right.
        alive = [j for j in self.jobs.values() if self.job_states.alive(j)]
        if not alive:
            return
        try:
            self._client("scancel", *alive, check=False)
        except SlurmError as e:
            logger.error(f"could not cancel jobs {alive}: {e}")
            return
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            self._poll_quietly()
            alive = [j for j in alive if self.job_states.alive(j)]
        if alive:
            logger.error(f"jobs {alive} still listed by squeue {wait:g}s after scancel")

    def _poll_quietly(self) -> None:
        try:
            self.poll(force=True)
        except SlurmError as e:
            logger.error(f"while cancelling: {e}")


# ---- the whole launch -----------------------------------------------------------


def _groups(
    experiment: ExperimentConfig,
    opts: SlurmConfig,
    controller_cmd: List[str],
    worker_cmd,
) -> List[WorkerGroup]:
    """The controller and every worker type with resources (experiment + overrides)."""
    types = [CONTROLLER_TYPE, *experiment.ordered_types]
    for name in ("worker_cpus", "worker_gpus", "worker_mem_mb"):
        unknown = set(getattr(opts, name)) - set(types)
        if unknown:
            raise SlurmError(
                f"slurm.{name} names {sorted(unknown)}, which are not worker types of this "
                f"experiment ({types})."
            )
    groups = []
    for t in types:
        sch = experiment.scheduling_of(t) if t != CONTROLLER_TYPE else None
        cpus = opts.worker_cpus.get(t, max(1, sch.cpu) if sch else 1)
        gpus = opts.worker_gpus.get(t, sch.gpu if sch else 0)
        mem = opts.worker_mem_mb.get(t, sch.mem_mb if sch else 1024)
        count = len(experiment.workers[t]) if sch else 1
        cmd = controller_cmd if t == CONTROLLER_TYPE else worker_cmd(t)
        groups.append(WorkerGroup(t, count, cpus, gpus, mem, dict(sch.env) if sch else {}, cmd))
    # Workers first: the controller waits for them, so it should be scheduled last.
    return groups[1:] + groups[:1]


def _job_env(
    name_resolve_spec: str, fileroot: Optional[str], env: Optional[Mapping[str, str]], opts
) -> Dict[str, str]:
    penv = dict(os.environ)
    # What describes the launcher's own process or allocation is wrong on a compute node:
    # its parent pid, its GPUs, the SLURM job it may itself run in.
    for k in list(penv):
        if k.startswith("SLURM_") and k != "SLURM_CONF":
            del penv[k]
    # Likewise the launcher's address and any secret it made for itself (the run gets a
    # secret file of its own: see launch_experiment).
    for k in (
        "REALHF_DIE_WITH_PARENT",
        "REALHF_PARENT_PID",
        "CUDA_VISIBLE_DEVICES",
        "REALHF_HOST_IP",
        auth.SECRET_ENV,
        auth.SECRET_FILE_ENV,
    ):
        penv.pop(k, None)
    penv["REALHF_NAME_RESOLVE"] = name_resolve_spec
    if fileroot is not None:
        penv["REALHF_FILEROOT"] = os.path.abspath(fileroot)
    penv.setdefault("PYTHONUNBUFFERED", "1")
    penv.update(env or {})
    if opts.slurm_conf:
        penv["SLURM_CONF"] = os.path.abspath(opts.slurm_conf)
    return penv


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
    options: Optional[SlurmConfig] = None,
) -> Dict[str, int]:
    """Run ``experiment`` through SLURM: controller + every worker, wait, cancel all.

    The contract of :func:`realhf.scheduler.local.launch_experiment` (name-resolve keys
    cleared, ``experiment`` pickled to ``{run_dir}/experiment.pkl``, the
    controller's outcome in ``{run_dir}/controller_summary.json``, logs in
    ``{run_dir}/logs/{type}_{index}.log``), with ``options`` (``cfg.slurm``) saying
    where and how.  ``run_dir`` must be on a file system every node sees.

    Raises:
        SlurmError: SLURM cannot run it (missing tools, bad partition/nodes, too large,
            submission failed, jobs that can never start); nothing is left queued.
        JobFailure, TimeoutError, KeyboardInterrupt: see
            :meth:`realhf.scheduler.jobs.JobSet.wait`.
    """
    opts = options if options is not None else SlurmConfig()
    if not isinstance(opts, SlurmConfig):
        raise TypeError(f"options must be a SlurmConfig, got {type(opts).__name__}.")
    penv = _job_env(name_resolve_spec, fileroot, env, opts)
    missing = [c for c in CLIENT_COMMANDS if shutil.which(c, path=penv.get("PATH")) is None]
    if missing:
        raise SlurmError(
            f"SLURM client commands {missing} are not on PATH ({penv.get('PATH', '')}); "
            "install slurm-client (Debian) or run from a cluster login node."
        )
    run_dir = os.path.abspath(run_dir)
    # The run's secret: a 0600 file in the run directory, which the compute nodes see (they
    # write their logs there too); the processes get only its path.
    penv.update(auth.issue(run_dir))
    controller_cmd = launch_controller_cmd(
        run_dir,
        experiment_name,
        trial_name,
        imports=imports,
        extra=controller_extra,
    )
    groups = _groups(
        experiment,
        opts,
        controller_cmd,
        lambda t: remote_worker_cmd(
            t, experiment_name, trial_name, imports=imports, extra=worker_extra
        ),
    )
    sched = SlurmScheduler(run_dir, opts, f"realhf:{experiment_name}:{trial_name}", penv)
    partition = sched.check_fits(groups)
    prepare_trial(run_dir, name_resolve_spec, experiment_name, trial_name, experiment)
    # Stale task states of an earlier attempt in this run dir would read as this one's.
    shutil.rmtree(sched.state_dir, ignore_errors=True)
    # Ctrl-C/SIGTERM between two sbatch calls must not leave the first jobs queued.
    try:
        with interrupt_on_signals():
            for g in groups:
                sched.submit(g, partition)
    except BaseException:
        sched.cancel_all()
        raise
    logger.info(f"jobs of {experiment_name}/{trial_name}: {sched.jobs}; logs in {sched.log_dir}")
    return sched.wait(timeout=timeout)
