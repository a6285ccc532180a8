"""An etcd that a test can stop and start again on the same ports and data (an outage).

The session-wide ``etcd_server`` fixture (tests/conftest.py) is shared by many tests; an
outage test needs a server of its own.  :class:`RestartableEtcd` keeps the ports and the
data directory across :meth:`stop` / :meth:`start`, so keys and leases survive as they do
when a real etcd restarts (etcd extends the leases it finds at start).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional

import pytest

from realhf.base.net import network

START_TIMEOUT = 20.0


class RestartableEtcd:
    def __init__(self, root: Optional[str] = None):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            pytest.skip("etcd binary not found on PATH (Debian package etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="realhf-etcd-outage-", dir=root)
        self.port, self.peer_port = network.find_multiple_free_ports(2)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "RestartableEtcd":
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary,
            "--name=outage",
            f"--data-dir={self.dir}/data",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=outage={peer}",
        ]
        log = open(f"{self.dir}/etcd.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start; log {self.dir}/etcd.log")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        """SIGKILL (no clean shutdown: as a crash or a pulled plug)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.port}/health"
            with urllib.request.urlopen(url, timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False


@pytest.fixture
def restartable_etcd(tmp_path):
    server = RestartableEtcd().start()
    try:
        yield server
    finally:
        server.close()
