"""areal's LocalGenerationServer runs on realhf's server-process helper: it serves, stops
with its context, and does not outlive a script that is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import requests

from areal.engine.local_server import LocalGenerationServer

pytestmark = pytest.mark.slow  # each test starts a server (~5 s)

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "realhf", "assets", "tiny")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_server_serves_and_stops_with_its_context(tmp_path):
    log = tmp_path / "server.log"
    server = LocalGenerationServer(TINY, num_threads=1, log_path=str(log))
    with server as url:
        pid = server.server.process.pid
        assert requests.get(url + "/health", timeout=10).status_code == 200
    assert server.server is None and _gone(pid, 15)
    with pytest.raises(RuntimeError, match="exited with code .* log tail"):
        with LocalGenerationServer(str(tmp_path / "no_model"), log_path=str(log)):
            pass


def test_the_server_does_not_outlive_a_killed_script(tmp_path):
    """The script dies by SIGKILL (no __exit__, no atexit): the server goes too instead of
    holding its port and the model's memory as an orphan."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from areal.engine.local_server import LocalGenerationServer
        log = {str(tmp_path / "server.log")!r}
        server = LocalGenerationServer({TINY!r}, num_threads=1, log_path=log)
        url = server.__enter__()
        print(server.server.process.pid, url, flush=True)
        time.sleep(600)
        """
    )
    script_proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = script_proc.stdout.readline().split()
        assert line, script_proc.stderr.read()
        pid, url = int(line[0]), line[1]
        assert requests.get(url + "/health", timeout=10).status_code == 200
        script_proc.kill()
        script_proc.wait(10)
        assert _gone(pid, 20), f"the server {pid} outlived its killed script"
    finally:
        script_proc.kill()
        script_proc.wait(10)
