"""Launch an experiment's controller and workers on a Ray cluster (``mode=ray``).

Every process is the same ``python -m realhf.apps.remote ...`` command that the local
launcher runs (:mod:`realhf.scheduler.local`), started as a subprocess by a Ray actor
(:class:`~realhf.scheduler.ray_host.ProcessHost`) on the node Ray picked, with its output in
``{run_dir}/logs/{type}_{index}.log`` (a file system shared by the nodes is assumed, as
for the run directory and the file name-resolve backend).

Placement: each worker type gets a placement group of one bundle per process
(``cpu``/``gpu`` of its :class:`~realhf.api.core.system_api.Scheduling`, or
``ray.cpus_per_worker``) with strategy ``ray.placement_strategy`` (PACK: a type's
processes, e.g. a model's ranks, share nodes as far as they fit).  The controller runs
next to the launcher when there is room.  Where every process ran (node id, IP, pids)
goes to ``{run_dir}/placement.json`` and the log.

Cluster (:mod:`realhf.scheduler.ray_cluster`): ``ray.address`` = an existing cluster's
GCS ``host:port`` (or ``auto``); empty = a local cluster started for the run (temp dir in
the run dir or a fresh one removed at the end, token authentication with a fresh token
kept out of ``~/.ray``) and shut down after it.  Name resolution is whatever spec the
launcher is given (main.py defaults to the file backend, fine on one machine); on several
nodes give ``name_resolve=etcd3://...`` or ``name_resolve=ray`` (this cluster's GCS
key-value store, ``ray://GCS``).

Stopping: the actors' subprocess groups get SIGTERM, then SIGKILL after a grace, and the
actors are killed.  A subprocess whose actor dies unexpectedly (``ray.kill``, a lost node)
gets SIGTERM from the kernel (``REALHF_DIE_WITH_PARENT``), and its death is a failure.
Outcomes, failures, timeouts and Ctrl-C follow :meth:`realhf.scheduler.jobs.JobSet.wait`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from realhf.api.core.system_api import ExperimentConfig
from realhf.api.ray_args import RayConfig
from realhf.base import logging
from realhf.base.net import auth
from realhf.scheduler.jobs import CONTROLLER_TYPE, JobSet, LaunchedJob
from realhf.scheduler.local import launch_controller_cmd, prepare_trial, remote_worker_cmd
from realhf.scheduler.ray_cluster import (
    NAMESPACE,
    RayClusterError,
    check_capacity,
    connect,
    first_line,
    warn_if_file_backend_on_many_nodes,
    write_placement,
)
from realhf.scheduler.ray_host import PYTHON, ProcessHost, host_actor_class

logger = logging.getLogger("ray_scheduler", "system")

__all__ = [
    "ProcessHost",
    "RayClusterError",
    "RayJob",
    "RayScheduler",
    "connect",
    "launch_experiment",
]


@dataclasses.dataclass
class RayJob(LaunchedJob):
    """One process launched in a Ray actor."""

    worker_type: str
    index: int
    cmd: List[str]
    log_path: str
    actor: Any
    #: ObjectRefs of the actor's start() (placement) and wait() (exit code) calls
    placement_ref: Any = None
    wait_ref: Any = None
    placement: Dict[str, Any] = dataclasses.field(default_factory=dict)
    exit_code: Optional[int] = None
    #: why the actor died before its subprocess reported an exit (ray.kill, node lost)
    lost: Optional[str] = None
    stopped_as_straggler: bool = False
    killed: bool = False

    @property
    def returncode(self) -> Optional[int]:
        """Exit code once it has exited (None while running or when its actor was lost)."""
        return self.exit_code

    @property
    def done(self) -> bool:
        return self.exit_code is not None or self.lost is not None

    @property
    def failed(self) -> bool:
        return self.lost is not None or self.exit_code not in (None, 0)

    def describe_exit(self) -> str:
        """``exit code 1`` / ``killed by SIGKILL`` / ``Ray actor lost: ...`` / ``running``."""
        if self.lost is not None:
            return f"Ray actor lost: {self.lost}"
        return super().describe_exit()


class RayScheduler(JobSet):
    """Start processes in Ray actors, watch them (as :meth:`JobSet.wait` says), stop them
    (the driver must be connected)."""

    run_name = "Ray run"

    def __init__(
        self, run_dir: str, *, env: Optional[Mapping[str, str]] = None, options: RayConfig
    ):
        self.run_dir = os.path.abspath(run_dir)
        self.log_dir = os.path.join(self.run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = dict(env or {})
        self.options = options
        self.jobs: List[RayJob] = []
        self._groups: List[Any] = []

    # ---- submit ---------------------------------------------------------

    def submit(
        self,
        worker_type: str,
        cmd: Sequence[str],
        count: int = 1,
        *,
        env: Optional[Mapping[str, str]] = None,
        cpus: float = 1.0,
        gpus: int = 0,
        actor_prefix: str = "",
        colocate_with_driver: bool = False,
    ) -> List[RayJob]:
        """Create ``count`` actors of ``worker_type``, start ``cmd`` in each, return the jobs.

        Processes of one call share a placement group (``options.placement_strategy``);
        ``colocate_with_driver`` instead prefers the launcher's node (soft affinity).
        ``{index}`` in ``cmd`` becomes the process index; ``cmd[0]`` equal to
        :data:`PYTHON` becomes the node's Python.
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        bundle = {"CPU": float(cpus), **self.options.resources_of(worker_type)}
        if gpus:
            bundle["GPU"] = float(gpus)
        if colocate_with_driver:
            here = ray.get_runtime_context().get_node_id()
            strategies = [NodeAffinitySchedulingStrategy(here, soft=True)] * count
        else:
            pg = placement_group(
                [dict(bundle) for _ in range(count)],
                strategy=self.options.placement_strategy,
                name=f"{actor_prefix}{worker_type}",
            )
            self._groups.append(pg)
            self._wait_placed(pg, worker_type, count, bundle)
            strategies = [
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                for i in range(count)
            ]
        host_cls = host_actor_class()
        new = []
        for index, strategy in enumerate(strategies):
            name = f"{worker_type}/{index}"
            actor = host_cls.options(
                name=f"{actor_prefix}{name}",
                namespace=NAMESPACE,
                num_cpus=cpus,
                num_gpus=gpus,
                max_concurrency=4,  # wait() blocks; stop()/ping() must still get through
                scheduling_strategy=strategy,
            ).remote(name)
            argv = [a.replace("{index}", str(index)) for a in cmd]
            penv = {**self.env, **(env or {}), "REALHF_WORKER_INDEX": str(index)}
            job = RayJob(
                worker_type,
                index,
                argv,
                os.path.join(self.log_dir, f"{worker_type}_{index}.log"),
                actor,
            )
            job.placement_ref = actor.start.remote(argv, penv, job.log_path, os.getcwd())
            self.jobs.append(job)
            new.append(job)
        return new

    def _wait_placed(self, pg, worker_type: str, count: int, bundle: dict) -> None:
        import ray

        ready, _ = ray.wait([pg.ready()], timeout=self.options.startup_timeout_s)
        if not ready:
            raise RayClusterError(
                f"Ray could not place {count} x {bundle} for {worker_type} "
                f"(strategy {self.options.placement_strategy}) within "
                f"{self.options.startup_timeout_s:g}s; the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free. Lower "
                "ray.cpus_per_worker, add nodes, or raise ray.startup_timeout_s."
            )

    def await_started(self) -> Dict[str, dict]:
        """Wait for every actor to start its subprocess; return placements by job name."""
        import ray

        pending = [j for j in self.jobs if not j.placement]
        refs = [j.placement_ref for j in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.options.startup_timeout_s)
        late = [j.name for j, r in zip(pending, refs) if r not in ready]
        if late:
            raise RayClusterError(
                f"{late} did not start within {self.options.startup_timeout_s:g}s "
                "(ray.startup_timeout_s); the Ray logs of the cluster say why."
            )
        for job in pending:
            try:
                job.placement = ray.get(job.placement_ref)
            except Exception as e:
                raise RayClusterError(f"{job.name} could not start on the Ray cluster: {e}") from e
            job.wait_ref = job.actor.wait.remote()
        return {j.name: j.placement for j in self.jobs}

    # ---- wait -----------------------------------------------------------

    def _poll(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for exits; record exit codes and lost actors."""
        import ray

        pending = {j.wait_ref: j for j in self.jobs if not j.done and j.wait_ref is not None}
        if not pending:
            time.sleep(wait_s)
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
        for ref in ready:
            job = pending[ref]
            try:
                job.exit_code = ray.get(ref)
            except ray.exceptions.RayError as e:
                job.lost = first_line(e)

    # ---- stop -----------------------------------------------------------

    def stop_all(self, grace: float = 5.0, first_signal: int = signal.SIGTERM) -> None:
        """Stop every subprocess (signal, then SIGKILL), kill the actors, free the groups."""
        from ray.util.placement_group import remove_placement_group

        live = [j for j in self.jobs if not j.killed]
        if live:
            self._stop_actors(live, grace, first_signal)
        for pg in self._groups:
            remove_placement_group(pg)
        self._groups.clear()

    def _stop_actors(self, live: List[RayJob], grace: float, first_signal: int) -> None:
        import ray

        # Actors that never started a subprocess (not placed yet) just get killed: a
        # call to them would wait for placement.
        stops = {j.actor.stop.remote(grace, int(first_signal)): j for j in live if j.placement}
        ready, _ = ray.wait(list(stops), num_returns=len(stops), timeout=grace + 15)
        for ref in ready:
            job = stops[ref]
            try:
                code = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # actor already dead: the kernel signalled its subprocess
            if not job.done and code is not None:
                job.exit_code = code
        for job in live:
            ray.kill(job.actor, no_restart=True)
            job.killed = True
        # Killing is asynchronous and a call on a dead actor fails: ping until all fail,
        # so that no actor (or actor name) outlives this call.
        deadline = time.monotonic() + 15
        pending = list(live)
        while pending and time.monotonic() < deadline:
            pings = {j.actor.ping.remote(): j for j in pending}
            ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=15)
            pending = []
            for ref in ready:
                try:
                    ray.get(ref)
                    pending.append(pings[ref])
                except ray.exceptions.RayError:
                    pass
            time.sleep(0.05 if pending else 0)


def _forwarded_env(options: RayConfig) -> Dict[str, str]:
    """Launcher variables every process gets: REALHF_* and ``options.forward_env``."""
    keep = set(options.forwarded_env_names)
    # Not forwarded: what describes the launcher's own host (its address) or a secret this
    # process made for itself; the run gets its own (see launch_experiment).
    local = {"REALHF_HOST_IP", auth.SECRET_ENV, auth.SECRET_FILE_ENV}
    return {
        k: v
        for k, v in os.environ.items()
        if (k.startswith("REALHF_") or k in keep) and k not in local
    }


# ---- the launch -------------------------------------------------------------------


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
    options: Optional[RayConfig] = None,
) -> Dict[str, int]:
    """Run ``experiment`` on Ray: controller + every worker, wait, stop all.

    The contract of :func:`realhf.scheduler.local.launch_experiment`, on the cluster
    of ``options.address`` (empty: a local one for the run).  ``name_resolve_spec``
    ``ray`` means this cluster's GCS store (``ray://GCS``).

    Raises:
        JobFailure, TimeoutError, KeyboardInterrupt: see
            :meth:`realhf.scheduler.jobs.JobSet.wait`.
        RayClusterError: the cluster is unreachable, or cannot place or start the workers.
    """
    options = options or RayConfig()
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    types = experiment.ordered_types
    wanted_cpus = sum(
        (options.cpus_per_worker or experiment.scheduling_of(t).cpu) * len(experiment.workers[t])
        for t in types
    ) + (options.cpus_per_worker or 1)
    with connect(options, run_dir=run_dir, wanted_cpus=wanted_cpus) as gcs_address:
        if name_resolve_spec.strip() == "ray":
            name_resolve_spec = f"ray://{gcs_address}"
        warn_if_file_backend_on_many_nodes(name_resolve_spec)
        wanted_gpus = sum(
            experiment.scheduling_of(t).gpu * len(experiment.workers[t]) for t in types
        )
        check_capacity({"CPU": wanted_cpus, **({"GPU": wanted_gpus} if wanted_gpus else {})})
        prepare_trial(run_dir, name_resolve_spec, experiment_name, trial_name, experiment)
        penv = _forwarded_env(options)
        penv.update({"REALHF_NAME_RESOLVE": name_resolve_spec, "REALHF_DIE_WITH_PARENT": "1"})
        # The run's secret: a 0600 file in the run directory, which every node must see
        # (the same requirement as the run's logs); the processes get only its path.
        penv.update(auth.issue(run_dir))
        if fileroot is not None:
            penv["REALHF_FILEROOT"] = os.path.abspath(fileroot)
        penv.update(env or {})
        sched = RayScheduler(run_dir, env=penv, options=options)
        prefix = f"{experiment_name}/{trial_name}/"
        try:
            cmd = launch_controller_cmd(
                run_dir,
                experiment_name,
                trial_name,
                imports=imports,
                extra=controller_extra,
            )
            sched.submit(
                CONTROLLER_TYPE,
                [PYTHON] + cmd[1:],
                cpus=options.cpus_per_worker or 1,
                actor_prefix=prefix,
                colocate_with_driver=True,
            )
            for wtype in types:
                sch = experiment.scheduling_of(wtype)
                cmd = remote_worker_cmd(
                    wtype, experiment_name, trial_name, imports=imports, extra=worker_extra
                )
                sched.submit(
                    wtype,
                    [PYTHON] + cmd[1:],
                    count=len(experiment.workers[wtype]),
                    env=dict(sch.env),
                    cpus=options.cpus_per_worker or sch.cpu,
                    gpus=sch.gpu,
                    actor_prefix=prefix,
                )
            write_placement(run_dir, sched.await_started(), gcs_address)
        except BaseException:
            sched.stop_all()
            raise
        return sched.wait(timeout=timeout)
