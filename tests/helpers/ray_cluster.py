"""A throwaway Ray cluster of several raylets ("nodes") on 127.0.0.1, for tests.

``start_ray_cluster(n_nodes=2)`` runs ``ray start --head`` and ``ray start --address``
with free ports, a short temp dir of its own and a custom resource ``node{i}`` per node
(so a test can tell the nodes apart), and returns a :class:`RayCluster`.
:meth:`RayCluster.stop` kills exactly its processes — each ``ray start`` leads its own
process group, and every Ray process of the cluster names the temp dir or belongs to
one of those groups — and removes the temp dir; ``ray stop`` is not used, since it
would stop every Ray cluster of the machine.  Usage stats are off and nothing goes to
``~/.ray`` or ``/tmp/ray``.

The cluster requires a token of its own (``RAY_AUTH_MODE=token``): Ray 2.6x's ``ray
start`` turns ``--node-ip-address 127.0.0.1`` into the machine's address, so its GCS and
raylets listen on every interface, and without a token anyone who reaches them could
run code.  Clients in the test process use :meth:`RayCluster.client_env` (the
environment of subprocesses started inside it carries the token too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, List

import psutil

from realhf.base.net import network
from realhf.scheduler.ray_cluster import ray_environ

START_TIMEOUT = 60.0


def ray_importable() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class RayCluster:
    """Where the test cluster's GCS listens, and how to stop it."""

    address: str  # GCS host:port
    temp_dir: str
    pgids: List[int]
    log_path: str
    token: str  # what a client must present (RAY_AUTH_TOKEN)

    def auth_env(self) -> Dict[str, str]:
        """The variables that make a Ray client present this cluster's token."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    @contextlib.contextmanager
    def client_env(self) -> Iterator[None]:
        """Within: this process's Ray clients, and the subprocesses it starts, present the
        cluster's token; after: the environment and Ray's auth config as they were."""
        with ray_environ(self.auth_env()):
            yield

    def processes(self) -> List[psutil.Process]:
        """Live processes of this cluster (not zombies)."""
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                mine = os.getpgid(p.pid) in self.pgids or self.temp_dir in " ".join(
                    p.info["cmdline"] or []
                )
                if mine and p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                pass
        return out

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every process of the cluster, SIGKILL what is left; remove the temp dir."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            procs = self.processes()
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _gone, alive = psutil.wait_procs(procs, timeout=wait)
            if not alive:
                break
        left = self.processes()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if left:
            raise RuntimeError(f"Ray test cluster left processes behind: {left}")


def _ray_start(args: List[str], log, auth_env: Dict[str, str]) -> int:
    """Run ``ray start ARGS`` in a process group of its own; its pgid once it returned."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **auth_env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        rc = proc.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if rc != 0:
        log.flush()
        with open(log.name, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        raise RuntimeError(f"`ray start {' '.join(args)}` exited with {rc}:\n{tail}")
    return proc.pid


def start_ray_cluster(n_nodes: int = 2, cpus_per_node: int = 2) -> RayCluster:
    """Start a head and ``n_nodes - 1`` more raylets on 127.0.0.1; see the module doc."""
    temp_dir = tempfile.mkdtemp(prefix="rh-ray-")  # short: Ray's socket paths must fit
    log_path = os.path.join(temp_dir, "ray_start.log")
    ports = iter(network.find_multiple_free_ports(3 + 5 * n_nodes))
    gcs_port = next(ports)
    address = f"127.0.0.1:{gcs_port}"
    cluster = RayCluster(address, temp_dir, [], log_path, token=secrets.token_hex(32))
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus_per_node)]
    common += ["--object-store-memory", str(100 * 1024 * 1024), "--temp-dir", temp_dir]
    # Workers bind OS-chosen ports: the default range 10002-19999 may hold the ports above.
    common += ["--min-worker-port", "0", "--max-worker-port", "0"]
    # No autoscaler monitor and no log monitors (tests read no worker logs through the
    # driver): fewer processes to start, so a node registers sooner on a busy machine.
    common += ["--no-monitor", "--include-log-monitor=false"]
    try:
        with open(log_path, "ab") as log:
            for i in range(1, n_nodes + 1):
                args = common + ["--resources", json.dumps({f"node{i}": 1})]
                args += ["--node-manager-port", str(next(ports))]
                args += ["--object-manager-port", str(next(ports))]
                args += ["--dashboard-agent-listen-port", str(next(ports))]
                args += ["--metrics-export-port", str(next(ports))]
                args += ["--runtime-env-agent-port", str(next(ports))]
                if i == 1:
                    args += ["--head", "--port", str(gcs_port), "--include-dashboard=false"]
                    args += ["--ray-client-server-port", str(next(ports))]
                    args += ["--dashboard-port", str(next(ports)), "--disable-usage-stats"]
                else:
                    args += ["--address", address]
                cluster.pgids.append(_ray_start(args, log, cluster.auth_env()))
        with cluster.client_env():
            _wait_nodes(address, n_nodes)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_nodes(address: str, n_nodes: int) -> None:
    """Wait until the GCS lists ``n_nodes`` live nodes."""
    from ray._raylet import GcsClient

    client = GcsClient(address=address)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        alive = [n for n in client.get_all_node_info(timeout=5).values() if n.state == 0]
        if len(alive) >= n_nodes:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(alive)} of {n_nodes} Ray nodes came up at {address}")
        time.sleep(0.2)
