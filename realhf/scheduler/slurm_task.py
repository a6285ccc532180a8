"""One SLURM task: the wrapper that runs a worker on its node, and the launcher's view of it.

Every task of a batch job runs ``python -m realhf.scheduler.slurm_task task --state-dir D
--type T -- python -m realhf.apps.remote ...``.  The wrapper (:func:`run_task`) starts the
process in a session of its own, writes where it runs (``D/{type}_{index}.start``) and
how it ended (``.exit``; squeue forgets finished jobs and sacct needs accounting),
forwards signals that reached only the wrapper, and kills whatever the process leaves
behind in its group (proctrack/linuxproc only tracks descendants, so a double-forked
child would otherwise escape ``scancel``).  :class:`SlurmTask` reads those files on the
launcher's side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from realhf.base.distributed import proc_group
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.scheduler.jobs import LaunchedJob, describe_returncode

__all__ = ["SlurmTask", "run_task", "task_cmd"]

TASK_FORWARD_DELAY = 2.0  # s the wrapper lets a signalled process exit on its own
TASK_KILL_GRACE = 10.0  # s after a signal before the wrapper SIGKILLs (below SLURM's KillWait)


def task_cmd(state_dir: str, worker_type: str, cmd: Sequence[str]) -> List[str]:
    """The wrapper's command line running ``cmd`` as task ``$SLURM_PROCID`` of a type."""
    wrapper = [sys.executable, "-m", __name__, "task", "--state-dir", state_dir]
    return wrapper + ["--type", worker_type, "--", *cmd]


def run_task(state_dir: str, worker_type: str, cmd: Sequence[str]) -> int:
    """Run worker ``SLURM_PROCID`` of ``worker_type``; record its start and exit."""
    index = int(os.environ.get("SLURM_PROCID", "0"))
    base = os.path.join(state_dir, f"{worker_type}_{index}")
    received: List[int] = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: received.append(signum))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    argv = [a.replace("{index}", str(index)) for a in cmd]
    env = dict(os.environ, REALHF_WORKER_INDEX=str(index))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    write_json_atomic(
        base + ".start",
        {
            "node": node,
            "host": socket.gethostname(),
            "pid": proc.pid,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "step_id": os.environ.get("SLURM_STEP_ID"),
        },
    )
    # SLURM signals every process of the step itself: forward (once, late) only for what
    # it could not see, so as not to interrupt the process's own clean shutdown.
    signalled_at = None
    pending = [(TASK_FORWARD_DELAY, None), (TASK_KILL_GRACE, signal.SIGKILL)]
    while proc.poll() is None:
        if received and signalled_at is None:
            signalled_at = time.monotonic()
        while pending and signalled_at and time.monotonic() - signalled_at > pending[0][0]:
            proc_group.signal_group(proc.pid, pending.pop(0)[1] or received[0])
        time.sleep(0.05)
    # The process is gone; children it left in its group are not.
    proc_group.stop_groups([proc], grace=TASK_FORWARD_DELAY)
    rc = proc.returncode
    write_json_atomic(
        base + ".exit",
        {
            "returncode": rc,
            "signal": signal.Signals(received[0]).name if received else None,
            "node": node,
        },
    )
    return rc if rc >= 0 else 128 - rc


class SlurmTask(LaunchedJob):
    """One launched worker process, as the launcher sees it: what the wrapper's state
    files say about it."""

    def __init__(self, worker_type: str, index: int, job_id: str, log_path: str, state: str):
        self.worker_type = worker_type
        self.index = index
        self.job_id = job_id
        self.log_path = log_path
        self._base = os.path.join(state, f"{worker_type}_{index}")
        self.start_info: Optional[dict] = None
        self.exit_info: Optional[dict] = None
        self.lost: Optional[str] = None  # why it counts as dead without an exit file
        self.stopped_as_straggler = False

    @property
    def node(self) -> Optional[str]:
        return (self.start_info or {}).get("node")

    def refresh(self) -> None:
        """Read the start/exit files the wrapper wrote."""
        if self.start_info is None:
            self.start_info = _read_json(self._base + ".start")
        if self.exit_info is None:
            self.exit_info = _read_json(self._base + ".exit")

    @property
    def returncode(self) -> Optional[int]:
        """Exit code once it has exited (negative: killed by that signal)."""
        if self.exit_info is not None:
            return int(self.exit_info["returncode"])
        return -signal.SIGKILL if self.lost else None

    def describe_exit(self) -> str:
        """``exit code 1 on node3`` / ``... after SIGTERM (job 12 signalled)`` / ``running``
        / ``not started`` / why it was lost."""
        rc = self.returncode
        if rc is None:
            return "running" if self.start_info else "not started"
        if self.exit_info is None:
            return self.lost or "lost"
        text = describe_returncode(rc)
        where = f" on {self.node}" if self.node else ""
        got = self.exit_info.get("signal")
        return f"{text}{where}" + (f" after {got} (job {self.job_id} signalled)" if got else "")


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _task_main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog=f"python -m {__name__}", description="(internal) run one SLURM task of realhf"
    )
    sub = p.add_subparsers(dest="role", required=True)
    t = sub.add_parser("task", help="run worker $SLURM_PROCID of a type; record start/exit")
    t.add_argument("--state-dir", required=True)
    t.add_argument("--type", required=True)
    t.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("task needs a command after --")
    return run_task(args.state_dir, args.type, cmd)


if __name__ == "__main__":
    sys.exit(_task_main())
