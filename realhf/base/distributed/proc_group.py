"""Stopping a subprocess together with everything it spawned (POSIX process groups).

These are operating-system process groups, not ``torch.distributed`` ones.

A process started with ``subprocess.Popen(..., start_new_session=True)`` leads a new
session and process group whose id is its pid; its children (an SGLang server's
scheduler and detokenizer, a worker's data-loader processes) inherit that group unless
they leave it on purpose.  Signalling the group instead of the pid reaches all of them:
terminating the leader alone leaves its children running — and holding GPU memory — when
they ignore SIGTERM or simply outlive their parent.

A group counts as alive while it has a member that is not a zombie: children orphaned by
the leader are reparented to init, and an init that does not reap (some container
runtimes) would otherwise keep a dead group "alive" forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence

__all__ = ["signal_group", "group_alive", "stop_groups", "dying_with_parent"]


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process of group ``pgid``; False if the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        # ESRCH: no member left.  EPERM: none of them is ours (a pid reused by
        # someone else's process), which for us is the same as gone.
        return False


def _member_state(pid: int, pgid: int) -> Optional[bytes]:
    """The state letter of ``pid`` if it belongs to group ``pgid``, else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # exited since the directory was listed
    # "pid (comm) state ppid pgrp ...": comm may itself hold ") ", so split after the last one.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0] if int(fields[2]) == pgid else None


def group_alive(pgid: int) -> bool:
    """Whether group ``pgid`` has a member that is not a zombie."""
    if not signal_group(pgid, 0):
        return False
    if not os.path.isdir("/proc"):
        return True  # no way to tell zombies apart here: trust kill(0)
    # kill(0) succeeds for zombies too; look at the members' states.
    states = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = _member_state(int(entry), pgid)
            if state is not None:
                states.append(state)
    # No member seen at all means this /proc cannot see them (another pid namespace):
    # then kill(0) is the better witness.
    return not states or any(s not in (b"Z", b"X") for s in states)


def _wait_groups_empty(
    popens: Sequence[subprocess.Popen], deadline: float
) -> List[subprocess.Popen]:
    """Wait until ``deadline`` for the groups to empty; the popens whose group has not."""
    while True:
        for p in popens:
            p.poll()  # reap the leader, so that it does not linger as a zombie
        left = [p for p in popens if group_alive(p.pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop_groups(
    popens: Sequence[subprocess.Popen],
    grace: float = 5.0,
    first_signal: int = signal.SIGTERM,
    kill_timeout: float = 10.0,
) -> List[subprocess.Popen]:
    """Stop the process groups led by ``popens`` (each started with ``start_new_session=True``).

    ``first_signal`` goes to every group at once, so that they shut down in parallel;
    whatever is left after ``grace`` seconds is SIGKILLed, and the call waits up to
    ``kill_timeout`` seconds for that to take effect.  Groups that were already gone are
    fine — a leader that exited may have left children behind, so every group is
    signalled regardless.

    Returns:
        The popens whose group still had live members (or whose leader was not reaped)
        ``kill_timeout`` seconds after SIGKILL — processes stuck in the kernel.
    """
    popens = list(popens)
    for p in popens:
        signal_group(p.pid, first_signal)
    left = _wait_groups_empty(popens, time.monotonic() + grace)
    for p in left:
        signal_group(p.pid, signal.SIGKILL)
    stuck = _wait_groups_empty(left, time.monotonic() + kill_timeout)
    for p in popens:
        try:
            p.wait(timeout=0 if p in stuck else kill_timeout)
        except subprocess.TimeoutExpired:
            if p not in stuck:
                stuck.append(p)
    return stuck


# Runs as ``python -c _EXEC_WITH_PDEATHSIG SIG PARENT_PID CMD...``: ask Linux for SIG when
# the parent dies, check that it has not died already, then become CMD (the request survives
# execve of a program that is not set-uid).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[1]))\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    sys.exit('the process that started this server exited before it started')\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dying_with_parent(cmd: Sequence[str], sig: int = signal.SIGTERM) -> List[str]:
    """``cmd`` wrapped so that Linux sends it ``sig`` when the process that starts it dies.

    For servers started as children in a session of their own: a stop through
    :func:`stop_groups` reaches them, but a parent that is SIGKILLed never calls it, and the
    server (with the memory it holds) would outlive the run.  The caller must start it from
    a thread that lives as long as the process (PR_SET_PDEATHSIG fires when the *thread*
    that forked exits).  Elsewhere than Linux ``cmd`` is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(int(sig)), str(os.getpid()), *cmd]
