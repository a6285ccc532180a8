"""The sandbox itself: limits, isolation, cleanup (real subprocesses, as root)."""

import ast
import os

import pytest

from functioncall.code.sandbox import SandboxLimits, run_python, sandbox_mode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root to switch uid")

# Forks at most 200 children and reports how many it got: shows the process limit
# holds before anything unbounded is run.
BOUNDED_FORK_PROBE = r"""
import os, time
n = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    n += 1
print(n)
"""


def _procs_of(uid):
    return [p for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid]


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_limits_validate_themselves():
    with pytest.raises(ValueError, match="SandboxLimits.max_processes=0"):
        SandboxLimits(max_processes=0)
    assert SandboxLimits(wall_timeout_s=2.5).cpu_s == 4


@pytest.mark.slow
def test_mode_is_detected_and_known():
    assert sandbox_mode() in ("bwrap", "rlimit")


@pytest.mark.slow
def test_runs_as_unprivileged_uid_with_minimal_env(mode):
    prog = "import os; print(os.getuid(), os.getgid(), os.getgroups(), sorted(os.environ))"
    res = run_python(["{code}/p.py"], {"p.py": prog}, limits=SandboxLimits(), mode=mode)
    assert res.ok, res.stderr
    uid, gid, groups, env = res.stdout.split(" ", 3)
    assert int(uid) >= 1000 and int(uid) == res.uid and int(gid) == res.uid
    assert groups == "[]"
    assert "REALHF" not in env and "PATH" in env


@pytest.mark.slow
def test_process_limit_holds_bounded_probe(mode):
    limits = SandboxLimits(wall_timeout_s=10, max_processes=8)
    res = run_python(["{code}/p.py"], {"p.py": BOUNDED_FORK_PROBE}, limits=limits, mode=mode)
    assert res.ok, res.stderr
    # the program itself is one of the 8 processes its uid may have
    assert int(res.stdout) == limits.max_processes - 1
    assert _procs_of(res.uid) == []  # the sleeping children were killed and reaped


@pytest.mark.slow
def test_stdin_stdout_and_exit_code(mode):
    prog = "import sys; data = sys.stdin.read(); print(data.upper()); sys.exit(3)"
    res = run_python(["{code}/p.py"], {"p.py": prog}, stdin=b"abc", mode=mode)
    assert (res.returncode, res.stdout.strip()) == (3, "ABC")


@pytest.mark.slow
def test_wall_timeout_kills_and_reports(mode):
    res = run_python(
        ["{code}/p.py"],
        {"p.py": "while True: pass"},
        limits=SandboxLimits(wall_timeout_s=1),
        mode=mode,
    )
    assert res.timed_out and not res.ok
    assert res.wall_s < 5


@pytest.mark.slow
def test_fresh_working_directory_each_run(mode):
    prog = "import os; print(sorted(os.listdir('.'))); open('left_behind', 'w').write('x')"
    first = run_python(["{code}/p.py"], {"p.py": prog}, mode=mode)
    second = run_python(["{code}/p.py"], {"p.py": prog}, mode=mode)
    assert first.ok and second.ok, (first.stderr, second.stderr)
    assert first.stdout.strip() == second.stdout.strip() == "[]"


@pytest.mark.slow
def test_bwrap_hides_the_host_filesystem_and_network():
    if sandbox_mode() != "bwrap":
        pytest.skip("bwrap cannot create namespaces on this machine")
    prog = (
        "import os, socket\n"
        "print(sorted(os.listdir('/')))\n"
        "print(os.path.exists('/etc/passwd'), os.path.exists('/work'), os.path.exists('/home'))\n"
        "s = socket.socket()\n"
        "try:\n    s.connect(('1.1.1.1', 80)); print('net')\nexcept OSError as e: print('nonet')\n"
    )
    res = run_python(["{code}/p.py"], {"p.py": prog}, mode="bwrap")
    assert res.ok, res.stderr
    lines = res.stdout.splitlines()
    visible = set(ast.literal_eval(lines[0]))
    assert not visible & {"etc", "home", "work", "var", "opt", "srv", "mnt"}
    assert {"usr", "proc", "dev", "tmp", "sandbox", "code"} <= visible
    assert lines[1] == "False False False"
    assert lines[2] == "nonet"
