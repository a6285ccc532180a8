"""The SLURM client commands and what the cluster has (see :mod:`realhf.scheduler.slurm`).

:func:`run_client` runs ``sbatch``/``squeue``/``scancel``/``scontrol`` and turns their
failures into :class:`SlurmError`; :func:`check_fits` reads the partition and its nodes
(``scontrol show partition/nodes``, ``sinfo``-free) and refuses up front a launch the
partition can never run, naming the setting to change.  :class:`JobStates` is what
``squeue`` says about the launch's jobs.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from realhf.api.slurm_args import SlurmConfig
from realhf.base import logging
from realhf.scheduler import LaunchError

logger = logging.getLogger("slurm_scheduler", "system")

__all__ = [
    "CLIENT_COMMANDS",
    "JobStates",
    "Node",
    "SlurmError",
    "WorkerGroup",
    "check_fits",
    "run_client",
]

CLIENT_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
# Job states in which a job can still hold processes somewhere.
ALIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING"}
SQUEUE_OUTAGE = 120.0  # s squeue may keep failing before the launch gives up
UNUSABLE_NODE_STATES = ("DOWN", "DRAIN", "FAIL", "INVALID", "FUTURE", "NOT_RESPONDING")

#: ``client(*cmd, check=True)``: :func:`run_client` with the launcher's env and timeout
Client = Callable[..., subprocess.CompletedProcess]


class SlurmError(LaunchError):
    """SLURM cannot run this launch: tools missing, bad partition or nodes, too large a
    request, a failed submission.  Nothing of the launch is left queued or running."""


@dataclasses.dataclass(frozen=True)
class WorkerGroup:
    """One batch job: ``count`` processes of ``worker_type`` with these resources each."""

    worker_type: str
    count: int
    cpus: int
    gpus: int
    mem_mb: int
    env: Mapping[str, str]
    cmd: Sequence[str]  # with "{index}" where the worker index goes


@dataclasses.dataclass(frozen=True)
class Node:
    """What ``scontrol show nodes`` says about one node."""

    name: str
    cpus: int
    gpus: int
    mem_mb: int
    state: str
    partitions: Sequence[str]

    @property
    def usable(self) -> bool:
        return not any(s in self.state for s in UNUSABLE_NODE_STATES)


def run_client(
    *cmd: str, env: Mapping[str, str], timeout: float, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the SLURM client command ``cmd``; ``SlurmError`` when it fails (``check``),
    does not answer within ``timeout`` s (slurm.submit_timeout) or is missing."""
    try:
        out = subprocess.run(
            list(cmd),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise SlurmError(
            f"`{shlex.join(cmd)}` did not answer within {timeout:g}s "
            "(slurm.submit_timeout); is slurmctld reachable?"
        ) from e
    except FileNotFoundError as e:
        raise SlurmError(f"`{cmd[0]}` is not on PATH: {e}") from e
    if check and out.returncode != 0:
        raise SlurmError(
            f"`{shlex.join(cmd)}` failed (exit code {out.returncode}): "
            f"{(out.stderr or out.stdout).strip()}"
        )
    return out


def check_fits(
    client: Client, opts: SlurmConfig, groups: Sequence[WorkerGroup]
) -> Tuple[str, List[str]]:
    """Refuse what the partition can never run (``SlurmError`` naming what and the fix);
    return the partition used and the nodes of it outside ``slurm.nodelist``."""
    try:
        out = client("scontrol", "show", "partition", "-o")
    except SlurmError as e:
        if "configuration source" not in str(e):
            raise
        raise SlurmError(
            f"{e}\nThe SLURM client finds no slurm.conf: set slurm.slurm_conf (or "
            "$SLURM_CONF) to the cluster's slurm.conf."
        ) from e
    partitions = {}
    for line in out.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "PartitionName" in fields:
            partitions[fields["PartitionName"]] = fields
    partition = opts.partition or next(
        (p for p, f in partitions.items() if f.get("Default") == "YES"), ""
    )
    if not partition:
        raise SlurmError(
            f"the cluster has no default partition; set slurm.partition to one of "
            f"{sorted(partitions)}."
        )
    if partition not in partitions:
        raise SlurmError(
            f"slurm.partition={partition!r} does not exist; the cluster has {sorted(partitions)}."
        )
    if partitions[partition].get("State") not in (None, "UP"):
        raise SlurmError(
            f"partition {partition!r} is {partitions[partition]['State']}, not UP; "
            "choose another with slurm.partition."
        )
    nodes = [n for n in _nodes(client) if partition in n.partitions]
    excluded: List[str] = []
    if opts.nodelist:
        wanted = client("scontrol", "show", "hostnames", opts.nodelist)
        wanted_names = set(wanted.stdout.split())
        unknown = wanted_names - {n.name for n in nodes}
        if unknown:
            raise SlurmError(
                f"slurm.nodelist={opts.nodelist!r}: {sorted(unknown)} are not nodes of "
                f"partition {partition!r} (it has {sorted(n.name for n in nodes)})."
            )
        excluded = sorted(n.name for n in nodes if n.name not in wanted_names)
        nodes = [n for n in nodes if n.name in wanted_names]
    usable = [n for n in nodes if n.usable]
    where = f"partition {partition!r}" + (f" (nodes {opts.nodelist})" if opts.nodelist else "")
    down = "" if len(usable) == len(nodes) else f"; {len(nodes) - len(usable)} are down/drained"
    have = (
        f"{where} has {len(usable)} usable node(s){down}, with "
        f"{[f'{n.name}: {n.cpus} CPUs, {n.gpus} GPUs, {n.mem_mb} MiB' for n in usable]}"
    )
    for g in groups:
        if not any(n.cpus >= g.cpus and n.gpus >= g.gpus and n.mem_mb >= g.mem_mb for n in usable):
            raise SlurmError(
                f"no node can run one {g.worker_type} process ({g.cpus} CPUs, {g.gpus} GPUs, "
                f"{g.mem_mb} MiB): {have}. Lower slurm.worker_cpus/worker_gpus/"
                f"worker_mem_mb.{g.worker_type} or choose another partition."
            )
    for what, attr in (("CPUs", "cpus"), ("GPUs", "gpus")):
        need = sum(g.count * getattr(g, attr) for g in groups)
        total = sum(getattr(n, attr) for n in usable)
        if need > total:
            per_type = {g.worker_type: g.count * getattr(g, attr) for g in groups}
            raise SlurmError(f"the experiment needs {need} {what} ({per_type}) but {have}.")
    return partition, excluded


def _nodes(client: Client) -> List[Node]:
    nodes = []
    for line in client("scontrol", "show", "nodes", "-o").stdout.splitlines():
        f = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" not in f:
            continue
        gpus = 0
        for gres in re.split(r",(?![^(]*\))", f.get("Gres", "")):
            parts = gres.split("(")[0].split(":")
            if parts[0] == "gpu" and parts[-1].isdigit():
                gpus += int(parts[-1])
        nodes.append(
            Node(
                name=f["NodeName"],
                cpus=int(f.get("CPUEfctv") or f.get("CPUTot") or 0),
                gpus=gpus,
                mem_mb=int(f.get("RealMemory") or 0),
                state=f.get("State", ""),
                partitions=f.get("Partitions", "").split(","),
            )
        )
    return nodes


class JobStates:
    """What ``squeue`` says about some jobs: ``(state, pending reason, nodes)`` by job id.

    Asked at most every ``poll_interval`` s (unless forced); a busy slurmctld may miss a
    few answers (the last known states stay), an outage longer than ``SQUEUE_OUTAGE`` s
    is a :class:`SlurmError`.  A job squeue no longer lists is ``GONE``.
    """

    def __init__(self, client: Client, poll_interval: float):
        self.client = client
        self.poll_interval = poll_interval
        self.states: Dict[str, Tuple[str, str, str]] = {}
        #: monotonic time at which each job was first seen no longer alive
        self.ended_at: Dict[str, float] = {}
        self._last_squeue = 0.0
        self._failing_since: Optional[float] = None

    def state(self, job_id: str) -> Tuple[str, str, str]:
        """``(state, reason, nodes)``; a job not seen yet counts as pending."""
        return self.states.get(job_id, ("PENDING", "", ""))

    def alive(self, job_id: str) -> bool:
        """The job may still hold processes somewhere (unknown counts as alive)."""
        return self.state(job_id)[0] in ALIVE_STATES

    def refresh(self, job_ids: Sequence[str], force: bool = False) -> None:
        """Ask squeue about ``job_ids`` when ``poll_interval`` s have passed (or ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_squeue < self.poll_interval:
            return
        self._last_squeue = now
        try:
            out = self._squeue(job_ids)
        except SlurmError as e:
            since = self._failing_since = self._failing_since or now
            if now - since > SQUEUE_OUTAGE:
                raise SlurmError(f"squeue has failed for {now - since:.0f}s: {e}") from e
            logger.warning(f"{e}; keeping the last known job states")
            return
        self._failing_since = None
        seen = {}
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 4:
                seen[parts[0]] = tuple(parts[1:])
        for job_id in job_ids:
            self.states[job_id] = seen.get(job_id, ("GONE", "", ""))
            if not self.alive(job_id):
                self.ended_at.setdefault(job_id, now)

    def _squeue(self, job_ids: Sequence[str]) -> str:
        ids = ",".join(job_ids)
        out = self.client("squeue", "-h", "-t", "all", "-j", ids, "-o", "%i|%T|%r|%N", check=False)
        # Jobs purged from slurmctld's memory make squeue fail with this; they are gone.
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise SlurmError(f"squeue failed (exit code {out.returncode}): {out.stderr.strip()}")
        return out.stdout
