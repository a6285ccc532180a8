"""Session fixtures shared by the whole test suite.

``etcd_server``: a real etcd (Debian's etcd-server binary) on 127.0.0.1 with
free client/peer ports and a temporary data directory, started once per
session on first use and killed at the end.  Tests that use it carry
``@pytest.mark.etcd``; they are skipped (with the reason) when the ``etcd``
binary is not installed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil
import pytest

from functioncall.code import uid_slots
from realhf.base.net import auth, network
from realhf.scheduler import forkserver

# Test scaffolding shared across folders (tiny random HF models, the dag-test experiment)
# lives in tests/helpers/, outside the product.  Spawned ranks inherit sys.path; launched
# worker processes inherit PYTHONPATH, and import the dag-test experiment by name.
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HELPERS, os.environ.get("PYTHONPATH")) if p)

# The test session is the root of every run its tests start by hand (threads, spawned
# ranks, `python -m realhf.apps.remote` subprocesses): they share one run secret, as the
# processes of a launch do.  Launched runs get a secret file of their own.
auth.child_env()

# Under pytest-xdist each worker sandboxes code in uids of its own, so test_hostile's
# host-wide "no sandbox process outlived the run" check sees only its own worker's runs.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw") and "REALHF_SANDBOX_UID_BASE" not in os.environ:
    _uids = uid_slots.uid_range()  # the whole range, then this worker's share after it
    _share = _uids.start + len(_uids) * int(_XDIST_WORKER[2:])
    os.environ["REALHF_SANDBOX_UID_BASE"] = str(_share)

# Fixtures that start real engines, for every test module (see each helper's docstring).
from restartable_etcd import restartable_etcd  # noqa: E402,F401
from slurm_cluster import slurm_cluster  # noqa: E402,F401
from vllm_venv import vllm_python  # noqa: E402,F401

ETCD_START_TIMEOUT = 20.0


@dataclasses.dataclass(frozen=True)
class EtcdServer:
    """Where the test etcd listens."""

    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return b'"health":"true"' in r.read()
    except OSError:
        return False


@pytest.fixture(scope="session")
def etcd_server():
    """Start etcd on 127.0.0.1 (free ports, temp data dir); yield its EtcdServer."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found on PATH (Debian package etcd-server)")
    client_port, peer_port = network.find_multiple_free_ports(2)
    data_dir = tempfile.mkdtemp(prefix="realhf-etcd-")
    log_path = f"{data_dir}.log"
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    cmd = [
        binary,
        "--name",
        "realhf-test",
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"realhf-test={peer_url}",
        "--initial-cluster-state",
        "new",
    ]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ETCD_START_TIMEOUT
        while not _healthy(client_port):
            if proc.poll() is not None:
                with open(log_path, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
                pytest.fail(f"etcd exited with code {proc.returncode} while starting:\n{tail}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"etcd on 127.0.0.1:{client_port} not healthy after "
                    f"{ETCD_START_TIMEOUT}s; log at {log_path}"
                )
            time.sleep(0.1)
        yield EtcdServer("127.0.0.1", client_port)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(data_dir, ignore_errors=True)


# ---- order: the longest-running modules first ----

# `make test` runs the suite on xdist workers with `--dist loadfile --no-loadscope-reorder`:
# whole modules (their fixtures set up once) are handed out in this order to whichever
# worker is free.  Longest first keeps a 4-minute module from starting last while the other
# workers idle: modules that start Ray, vLLM or SLURM, then those with more slow tests (each
# one a multi-process run).  Ray goes first: `ray start` gives its raylet a fixed 30 s to
# register (Ray's node.py), and under a vLLM start-up on the other workers it once took
# longer; started first, the three Ray modules' clusters are up (~15-21 s) before any vLLM
# server starts.  No result depends on the order.
_HEAVY_FIRST = ("ray", "vllm", "slurm")


def pytest_collection_modifyitems(config, items):
    if not _XDIST_WORKER:
        return  # one process: the order is the files' own, as a reader expects
    rank, slow = {}, {}
    for item in items:
        marks = [i for i, m in enumerate(_HEAVY_FIRST) if item.get_closest_marker(m)]
        rank[item.path] = min([rank.get(item.path, len(_HEAVY_FIRST)), *marks])
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))
    # stable: pytest's order among equals, and within each module
    items.sort(key=lambda item: (rank[item.path], -slow[item.path]))


# ---- multi-process tests: nothing we launch may outlive a test ----


def _descendants():
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_leftover_processes():
    """Fail the test if processes it started are still alive 10 s after it ends.

    Processes that existed before the test (e.g. the session's etcd) are ignored.
    Call the yielded function to check earlier, inside the test.
    """
    # The session's fork server (realhf.scheduler.forkserver) outlives the launches that
    # use it; the processes it forks are its children and are checked.
    before = set(_descendants()) | set(forkserver.shared_pids())

    def check(timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            before.update(forkserver.shared_pids())  # those a launch in the test started
            left = {pid: p for pid, p in _descendants().items() if pid not in before}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        names = []
        for p in left.values():
            try:
                names.append((p.pid, p.cmdline()))
            except psutil.NoSuchProcess:
                pass
        assert not names, f"processes left behind: {names}"

    yield check
    check()


@pytest.fixture
def caplog(caplog):
    """pytest's caplog, also fed by realhf loggers.

    caplog listens on the root logger, and the ``realhf`` package logger does not propagate
    there (it prints through its own handler, and a user's root handler would print every
    line twice), so its handler is attached to the package logger as well.
    """
    import logging as std

    package = std.getLogger("realhf")
    package.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        package.removeHandler(caplog.handler)
