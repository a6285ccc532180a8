"""A two-node SLURM cluster on this machine, for tests: munged + slurmctld + slurmd x2.

Debian's slurm is built with MULTIPLE_SLURMD, so two ``slurmd -N node1|node2`` on one
host make a two-node cluster.  Everything lives under a scratch directory: the config,
the munge key and socket, state, spool and logs; ports are chosen free at start.  The
client commands (``sbatch``, ``squeue``, ...) find the cluster through ``SLURM_CONF``,
which is in :attr:`SlurmCluster.env`.

``SlurmdParameters=config_overrides`` lets the nodes claim more CPUs than the machine
has (``cpus_per_node``), so that an experiment of a handful of single-CPU processes fits
on a 2-core machine while still spreading over both nodes.

The pytest fixture :func:`slurm_cluster` (module scope) skips when ``slurmctld`` is not
installed and stops every daemon by PID at the end.  ``python slurm_cluster.py`` starts
a cluster and keeps it up until Ctrl-C (for trying things by hand).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

import pytest

from realhf.base.net import network

NODES = ("node1", "node2")
PARTITION = "debug"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0

_CONF = """\
ClusterName=realhftest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
KillWait=5
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
{nodes}
PartitionName={partition} Nodes=node[1-{n}] Default=YES MaxTime=INFINITE State=UP
"""


@dataclasses.dataclass
class SlurmCluster:
    """A running test cluster: where it lives and how to reach it."""

    root: str
    conf: str
    partition: str
    nodes: List[str]
    cpus_per_node: int
    procs: Dict[str, subprocess.Popen]

    @property
    def env(self) -> Dict[str, str]:
        """``os.environ`` plus ``SLURM_CONF`` (what the client commands need)."""
        return dict(os.environ, SLURM_CONF=self.conf)

    def run(self, *cmd: str, timeout: float = 10.0) -> str:
        """Run a client command against this cluster; its stdout (raises on exit != 0)."""
        return subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, check=True
        ).stdout

    def node_states(self) -> Dict[str, str]:
        """Node name -> state as ``sinfo`` reports it (``idle``, ``mixed``, ``down*`` ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def queue(self) -> List[str]:
        """``squeue`` lines (job id, name, state) of every job still known to the cluster."""
        return [ln for ln in self.run("squeue", "-h", "-o", "%i %j %T").splitlines() if ln.strip()]

    def log_tail(self, n: int = 30) -> str:
        """The last lines of every daemon log (for failure messages)."""
        parts = []
        log_dir = os.path.join(self.root, "log")
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                lines = f.read().splitlines()[-n:]
            parts.append(f"--- {name} ---\n" + "\n".join(lines))
        return "\n".join(parts)


def _write_config(d: str, cpus_per_node: int, mem_mb: int) -> str:
    ports = network.find_multiple_free_ports(2 + len(NODES))
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[2 + i]} "
        f"CPUs={cpus_per_node} RealMemory={mem_mb} State=UNKNOWN"
        for i, n in enumerate(NODES)
    )
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(
            _CONF.format(
                d=d,
                ctld_port=ports[0],
                slurmd_port=ports[1],
                nodes=nodes,
                partition=PARTITION,
                n=len(NODES),
            )
        )
    return conf


def _make_munge_key(d: str) -> str:
    munge_dir = os.path.join(d, "munge")
    os.makedirs(munge_dir)
    os.chmod(munge_dir, 0o711)
    key = os.path.join(munge_dir, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    return key


def stop(procs: Dict[str, subprocess.Popen]) -> None:
    """SIGTERM every daemon at once, SIGKILL what is left after STOP_TIMEOUT s, reap."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_TIMEOUT)


def start(
    root: Optional[str] = None, *, cpus_per_node: int = 4, mem_mb: int = 8000
) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node; return once every node is idle.

    Raises RuntimeError (with the daemon logs) when the nodes are not idle within
    START_TIMEOUT s; the daemons started so far are stopped first.
    """
    d = os.path.abspath(root or tempfile.mkdtemp(prefix="realhf-slurm-"))
    for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    key = _make_munge_key(d)
    conf = _write_config(d, cpus_per_node, mem_mb)
    munge = os.path.join(d, "munge")
    log = os.path.join(d, "log")
    cmds = {
        "munged": [
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={munge}/munge.socket",
            f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed",
            f"--log-file={log}/munged.log",
        ],
        "slurmctld": ["slurmctld", "-D", "-f", conf],
        **{f"slurmd-{n}": ["slurmd", "-D", "-f", conf, "-N", n] for n in NODES},
    }
    procs: Dict[str, subprocess.Popen] = {}
    cluster = SlurmCluster(d, conf, PARTITION, list(NODES), cpus_per_node, procs)
    try:
        for name, cmd in cmds.items():
            with open(os.path.join(log, f"{name}.out"), "ab") as out:
                procs[name] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
                )
            if name == "munged":  # slurmctld authenticates through it right away
                _wait_for(lambda: os.path.exists(f"{munge}/munge.socket"), procs, cluster)
        _wait_for(
            lambda: (
                set(_states_or_empty(cluster).values()) == {"idle"}
                and len(_states_or_empty(cluster)) == len(NODES)
            ),
            procs,
            cluster,
        )
    except BaseException:
        stop(procs)
        raise
    return cluster


def _states_or_empty(cluster: SlurmCluster) -> Dict[str, str]:
    try:
        return cluster.node_states()
    except (subprocess.SubprocessError, ValueError):
        return {}


def _wait_for(cond, procs: Dict[str, subprocess.Popen], cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not cond():
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"SLURM daemons exited while starting: {dead}\n{cluster.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"SLURM test cluster not ready after {START_TIMEOUT:g}s "
                f"(nodes: {_states_or_empty(cluster)})\n{cluster.log_tail()}"
            )
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A running two-node :class:`SlurmCluster`; every daemon is stopped by PID at the end."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    if missing:
        pytest.skip(
            f"SLURM not installed ({', '.join(missing)} not on PATH); apt-get install "
            "slurmctld slurmd slurm-client munge"
        )
    cluster = start(str(tmp_path_factory.mktemp("slurm")))
    try:
        yield cluster
    finally:
        _cancel_everything(cluster)
        stop(cluster.procs)


def _cancel_everything(cluster: SlurmCluster, timeout: float = 15.0) -> None:
    """scancel whatever a test left queued, so that no task outlives the slurmds."""
    try:
        if not cluster.queue():
            return
        cluster.run("scancel", "--user", "root")
        deadline = time.monotonic() + timeout
        while cluster.queue() and time.monotonic() < deadline:
            time.sleep(0.2)
    except (subprocess.SubprocessError, OSError):
        pass  # the daemons are going down anyway


if __name__ == "__main__":
    c = start()
    print(f"export SLURM_CONF={c.conf}  # Ctrl-C stops the cluster")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        stop(c.procs)
