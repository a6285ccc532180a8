"""The Ray actor that hosts one launched process on its node (see :mod:`realhf.scheduler.ray`).

:class:`ProcessHost` starts the same ``python -m realhf.apps.remote ...`` command the local
launcher runs as a subprocess in a session of its own, with its output appended to a log
file, and reports where it runs, when it exits and how; the launcher stops it through
``stop`` (signal the group, SIGKILL after a grace).
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from typing import Dict, List, Optional

from realhf.base.distributed import proc_group

__all__ = ["PYTHON", "ProcessHost", "host_actor_class"]

#: stands for the node's own Python in commands (paths may differ between nodes)
PYTHON = "{python}"


class ProcessHost:
    """Body of the Ray actor that runs one command as a subprocess on its node."""

    def __init__(self, job_name: str):
        self.job_name = job_name
        self._popen = None
        self._started = threading.Event()
        self._exited = threading.Event()
        self._error: Optional[BaseException] = None

    def start(self, argv: List[str], env: Dict[str, str], log_path: str, cwd: str) -> dict:
        """Start ``argv`` (``{python}`` = this node's Python); return where it runs."""
        import ray

        argv = [sys.executable if a == PYTHON else a for a in argv]
        penv = dict(os.environ)
        penv.update(env)
        penv["REALHF_PARENT_PID"] = str(os.getpid())
        penv.setdefault("PYTHONUNBUFFERED", "1")
        # The run's sockets listen on the address Ray itself uses on this node, not on
        # whatever the host name resolves to, and never on every interface.
        penv.setdefault("REALHF_HOST_IP", ray.util.get_node_ip_address())
        # PR_SET_PDEATHSIG (REALHF_DIE_WITH_PARENT) fires when the *thread* that forked
        # the child exits, and actor calls run on pool threads: fork from a thread that
        # lives exactly as long as the child.
        threading.Thread(
            target=self._run,
            args=(argv, penv, log_path, cwd if os.path.isdir(cwd) else None),
            name=f"spawn-{self.job_name}",
            daemon=True,
        ).start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": self._popen.pid,
            "actor_pid": os.getpid(),
        }

    def _run(self, argv, env, log_path, cwd) -> None:
        import subprocess

        try:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            with open(log_path, "ab") as log:
                self._popen = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
        except BaseException as e:  # handed to start(), which raises it to the launcher
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._popen.wait()
        self._exited.set()

    def wait(self) -> int:
        """Block until the subprocess exits; its exit code (negative: signal)."""
        self._exited.wait()
        return self._popen.returncode

    def stop(self, grace: float, first_signal: int) -> Optional[int]:
        """Signal the subprocess's group, SIGKILL it after ``grace`` s; the exit code."""
        if self._popen is None:
            return None
        proc_group.stop_groups([self._popen], grace, first_signal)
        return self._popen.returncode

    def ping(self) -> bool:
        """True; a call that fails once the actor is dead."""
        return True


@functools.lru_cache(maxsize=None)
def host_actor_class():
    """:class:`ProcessHost` as a Ray actor class."""
    import ray

    return ray.remote(ProcessHost)
