"""realhf.base.distributed.proc_group: stopping a subprocess's whole process group.

Every process here is started by the test in its own session and is stopped (by
its group id) before the test ends; sleeps are bounded so that nothing can
outlive a failed test by more than a minute.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from realhf.base.distributed import proc_group

# A leader that starts a child in its group, prints the child's pid once the child
# is set up, then sleeps.  argv[1] == "1": both ignore SIGTERM (only SIGKILL ends them).
_TREE = r"""
import os, signal, subprocess, sys, time
ignore = sys.argv[1] == "1"
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
c = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                     stdout=subprocess.PIPE)
c.stdout.readline()
print(c.pid, flush=True)
time.sleep(60)
"""


def _start_tree(ignore_term: bool):
    p = subprocess.Popen(
        [sys.executable, "-c", _TREE, "1" if ignore_term else "0"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    child = int(p.stdout.readline())
    p.stdout.close()
    return p, child


@pytest.fixture
def started():
    """Process groups a test starts; SIGKILLed at the end whatever happened."""
    popens = []
    yield popens
    for p in popens:
        proc_group.signal_group(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


@pytest.mark.parametrize("ignore_term", [False, True], ids=["term", "kill"])
def test_stop_groups_ends_leader_and_child(started, no_leftover_processes, ignore_term):
    p, child = _start_tree(ignore_term)
    started.append(p)
    assert proc_group.group_alive(p.pid)
    t0 = time.monotonic()
    assert proc_group.stop_groups([p], grace=0.5, kill_timeout=10) == []
    assert time.monotonic() - t0 < 10
    assert p.returncode == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
    assert not proc_group.group_alive(p.pid)
    no_leftover_processes()


def test_a_group_whose_leader_exited_is_still_stopped(started, no_leftover_processes):
    """The leader died on its own; the child it left is in the group and is stopped."""
    p, child = _start_tree(False)
    started.append(p)
    p.kill()  # the leader only: its child stays, orphaned
    p.wait(timeout=10)
    assert proc_group.group_alive(p.pid)  # the child holds the group
    assert proc_group.stop_groups([p], grace=5, kill_timeout=10) == []
    assert not proc_group.group_alive(p.pid)


def test_a_group_of_zombies_is_not_alive():
    """A member that exited but was not reaped (as orphans under an init that does not
    reap them) does not keep its group alive, although kill() still reaches it."""
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped
        assert proc_group.signal_group(p.pid, 0)
        assert not proc_group.group_alive(p.pid)
    finally:
        p.wait(timeout=10)


def test_gone_groups_are_fine():
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait(timeout=10)
    assert not proc_group.signal_group(p.pid, signal.SIGTERM)
    assert not proc_group.group_alive(p.pid)
    assert proc_group.stop_groups([p], grace=1) == []
    assert proc_group.stop_groups([]) == []


# A parent that starts a server (sleep) in its own session through dying_with_parent,
# prints the server's pid, then waits to be killed.
_PARENT = r"""
import subprocess, sys, time
from realhf.base.distributed import proc_group
s = subprocess.Popen(proc_group.dying_with_parent(
    [sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"]),
    stdout=subprocess.PIPE, start_new_session=True)
s.stdout.readline()
print(s.pid, flush=True)
time.sleep(60)
"""


def test_a_server_started_dying_with_parent_ends_when_its_parent_is_killed():
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, start_new_session=True
    )
    server = int(parent.stdout.readline())
    try:
        # the wrapper exec'd into the server: same pid, the server's command line
        with open(f"/proc/{server}/cmdline", "rb") as f:
            assert b"time.sleep(60)" in f.read()
        assert proc_group.group_alive(server)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while proc_group.group_alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not proc_group.group_alive(server), "the server outlived its SIGKILLed parent"
    finally:
        proc_group.signal_group(server, signal.SIGKILL)
        proc_group.signal_group(parent.pid, signal.SIGKILL)
        parent.wait(10)
