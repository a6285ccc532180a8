"""The fork server: children that behave like freshly executed processes, watched like Popens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from realhf.scheduler import forkserver
from realhf.scheduler.local import LocalScheduler

pytestmark = pytest.mark.slow  # the server imports torch & co. (~6 s)


@pytest.fixture(scope="module")
def server():
    s = forkserver.ForkServer()
    yield s
    s.close()


PROBE = frozenset({"forked_probe"})


def _argv(out, code=0, *extra):
    return [sys.executable, "-m", "forked_probe", str(out), str(code), *extra]


def _env(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def test_a_child_sees_its_own_argv_env_session_and_log(server, tmp_path):
    out, log = tmp_path / "a.json", tmp_path / "a.log"
    argv = _argv(out, 3)
    env = _env(REALHF_PROBE_X="seven")
    assert server.can_fork(argv, env, PROBE)
    p = server.spawn(argv, env, str(log))
    assert p.wait(timeout=30) == 3 and p.returncode == 3 and p.poll() == 3
    seen = json.loads(out.read_text())
    assert seen["argv"] == [str(out), "3"] and seen["main"] == "__main__"
    assert seen["pid"] == p.pid and seen["sid"] == p.pid and seen["pgid"] == p.pid
    assert seen["ppid"] == server.proc.pid and seen["parent_env"] == str(server.proc.pid)
    assert seen["env_x"] == "seven" and seen["torch_preloaded"] and seen["stdin"] == ""
    assert "probe says hello" in log.read_text()
    assert seen["cmdline"] == " ".join(argv)  # what ps shows


def test_children_get_their_own_numpy_random_state(server, tmp_path):
    seen = []
    for i in range(2):
        out = tmp_path / f"{i}.json"
        assert server.spawn(_argv(out), _env(), str(tmp_path / "log")).wait(30) == 0
        seen.append(json.loads(out.read_text())["np_random"])
    assert seen[0] != seen[1]


def test_signals_timeouts_and_concurrent_children(server, tmp_path):
    slow = [
        server.spawn(_argv(tmp_path / f"s{i}.json", 0, "sleep", "60"), _env(), str(tmp_path / "l"))
        for i in range(3)
    ]
    with pytest.raises(subprocess.TimeoutExpired):
        slow[0].wait(timeout=0.3)
    assert all(p.poll() is None for p in slow)
    slow[1].kill()
    os.killpg(slow[2].pid, signal.SIGTERM)  # its own process group, as Popen's sessions
    slow[0].terminate()
    assert [p.wait(timeout=30) for p in slow] == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]


def test_a_child_leads_its_session_when_its_pid_is_reported(server, tmp_path):
    # The launcher may signal a child's group the moment spawn() returns (stop_groups at a
    # failed start); a group that does not exist yet reads as one already gone.
    children = [
        server.spawn(_argv(tmp_path / f"g{i}.json", 0, "sleep", "60"), _env(), str(tmp_path / "l"))
        for i in range(8)
    ]
    try:
        for p in children:
            assert os.getsid(p.pid) == p.pid and os.getpgid(p.pid) == p.pid
    finally:
        for p in children:
            p.kill()
    assert [p.wait(timeout=30) for p in children] == [-signal.SIGKILL] * 8


def test_what_cannot_be_forked_is_refused(server, tmp_path):
    out = tmp_path / "x.json"
    assert not server.can_fork([sys.executable, "-c", "pass"], _env(), PROBE)
    assert not server.can_fork(["/bin/sleep", "1"], _env(), PROBE)
    assert not server.can_fork([sys.executable, "-m", "json.tool"], _env())  # not forkable
    # a variable a preloaded library may read at import: the child would not see it
    assert not server.can_fork(_argv(out), _env(OMP_NUM_THREADS="1"), PROBE)
    env = _env()
    del env["PATH"]
    assert not server.can_fork(_argv(out), env, PROBE)
    # variables that no preloaded library reads are the child's own
    assert server.can_fork(_argv(out), _env(REALHF_ANYTHING="1", CUDA_VISIBLE_DEVICES="0"), PROBE)


def test_a_lost_server_is_an_error_and_its_children_are_reported_lost(tmp_path):
    s = forkserver.ForkServer(preload=())
    child = s.spawn(_argv(tmp_path / "c.json", 0, "sleep", "60"), _env(), str(tmp_path / "c.log"))
    s.proc.kill()
    s.proc.wait()
    deadline = time.monotonic() + 10
    while not s.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.lost and not s.can_fork(_argv(tmp_path / "d.json"), _env(), PROBE)
    with pytest.raises(forkserver.ForkServerError, match="exited"):
        s.spawn(_argv(tmp_path / "d.json"), _env(), str(tmp_path / "d.log"))
    assert child.poll() is None  # still running: only its parent is gone
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=10) == forkserver.LOST_RC
    s.close()


def test_a_child_that_exits_before_spawn_returns_is_still_reaped(tmp_path, monkeypatch):
    s = forkserver.ForkServer(preload=())
    wait_for = s._wait_for

    def slow_to_wake(predicate, timeout, what):  # the launcher's thread is descheduled
        value = wait_for(predicate, timeout, what)
        if what.startswith("to fork"):
            time.sleep(1.5)
        return value

    monkeypatch.setattr(s, "_wait_for", slow_to_wake)
    out = tmp_path / "q.json"
    child = s.spawn(_argv(out, 7), _env(), str(tmp_path / "q.log"))
    assert out.exists()  # it ran and exited while spawn() slept
    assert child.wait(timeout=10) == 7
    s.close()


def test_closing_the_server_ends_it(tmp_path):
    s = forkserver.ForkServer(preload=("numpy",))
    s._wait_for(lambda: s._ready, 60, "while importing")
    s.close(timeout=30)
    assert s.proc.returncode == 0
    # one still importing (a launch that fails while building) is not waited for
    s = forkserver.ForkServer(preload=forkserver.PRELOAD)
    t0 = time.monotonic()
    s.close(timeout=30)
    assert time.monotonic() - t0 < 2 and s.proc.returncode == -signal.SIGKILL


def test_local_scheduler_forks_what_it_can_and_stops_it(
    tmp_path, monkeypatch, no_leftover_processes
):
    monkeypatch.setattr(
        forkserver, "FORKABLE_MODULES", forkserver.FORKABLE_MODULES | {"forked_probe"}
    )
    sched = LocalScheduler(str(tmp_path / "run"))
    out = tmp_path / "p.json"
    try:
        (job,) = sched.submit("probe", _argv(out, 0, "sleep", "60"))
        (plain,) = sched.submit("plain", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert isinstance(job.popen, forkserver.ForkedProcess)
        assert isinstance(plain.popen, subprocess.Popen)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(out.read_text())["env_x"] is None
        assert job.returncode is None
        # what ps and psutil show: the command, word by word
        assert psutil.Process(job.pid).cmdline() == job.cmd
    finally:
        sched.stop_all(grace=5)
    assert job.returncode == -signal.SIGTERM and plain.returncode == -signal.SIGTERM
    assert "probe says hello" in open(job.log_path).read()


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "executed"])
def test_launch_writes_stdout_and_stderr_where_asked(fork, tmp_path, no_leftover_processes):
    out, log, err = tmp_path / "o.json", tmp_path / "o.log", tmp_path / "o.err"
    p = forkserver.launch(
        _argv(out, 4), _env(), str(log), err_path=str(err), modules=PROBE, fork=fork
    )
    assert isinstance(p, forkserver.ForkedProcess if fork else subprocess.Popen)
    assert p.wait(timeout=30) == 4
    seen = json.loads(out.read_text())
    assert seen["sid"] == seen["pid"] == p.pid and seen["stdin"] == ""
    assert seen["torch_preloaded"] == fork
    assert log.read_text() == "probe says hello\n" and err.read_text() == "probe warns\n"
    # without err_path both go to the log; from another directory it is executed there
    p = forkserver.launch(_argv(out, 0), _env(), str(log), modules=PROBE, cwd=str(tmp_path))
    assert isinstance(p, subprocess.Popen) and p.wait(timeout=30) == 0
    assert log.read_text().count("probe") == 3 and "probe warns" in log.read_text()


def test_a_server_that_fails_to_fork_is_not_asked_again(tmp_path, monkeypatch, caplog):
    server = forkserver.shared(_env())
    monkeypatch.setattr(server, "failed", False)  # the session's server: restored after

    def broken(*args, **kwargs):
        raise forkserver.ForkServerError("the fork server did not answer")

    monkeypatch.setattr(server, "spawn", broken)
    for i in range(2):
        p = forkserver.launch(
            _argv(tmp_path / f"{i}.json"), _env(), str(tmp_path / "l"), modules=PROBE
        )
        assert isinstance(p, subprocess.Popen) and p.wait(timeout=30) == 0
    assert server.failed and not server.can_fork(_argv(tmp_path / "x.json"), _env(), PROBE)
    (warning,) = [r for r in caplog.records if "from now on" in r.getMessage()]
    assert "did not answer" in warning.getMessage()


def test_a_launcher_whose_environment_changed_gets_a_server_for_it(monkeypatch):
    first = forkserver.shared()
    assert forkserver.shared() is first
    monkeypatch.setenv("REALHF_ANYTHING", "1")  # the children's own: the same server
    assert forkserver.shared() is first
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # set by the launcher's own process group
    second = forkserver.shared()
    assert second is not first and second.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert first.proc.poll() is not None  # it had no children: closed
    assert forkserver.shared_pids() == [second.proc.pid]


_EARLY = """
import atexit, json, os, sys
from realhf.scheduler import forkserver

# the launcher's own exit hook: the server forked from it must not run it
atexit.register(lambda: open(f"{sys.argv[1]}.exited.{os.getpid()}", "w").close())
server = forkserver.start_early()
import realhf.base.constants  # the launcher goes on importing realhf's modules
import torch

out, log = sys.argv[1], sys.argv[2]
env = dict(os.environ, REALHF_PROBE_X="seven")
argv = [sys.executable, "-m", "forked_probe", out, "3", "sleep", "30"]
assert server.can_fork(argv, env, frozenset({"forked_probe"})), server.env_difference(env)
child = server.spawn(argv, env, log)
print(json.dumps({"server": server.proc.pid, "child": child.pid,
                  "shared": forkserver.shared() is server}), flush=True)
sys.stdin.readline()  # the test has looked at the running child
child.kill()
print(json.dumps({"rc": child.wait(30)}), flush=True)
"""


def test_a_launcher_forks_its_server_from_itself(tmp_path, no_leftover_processes):
    out, log = tmp_path / "e.json", tmp_path / "e.log"
    helpers = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([helpers, os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen(
        [sys.executable, "-c", _EARLY, str(out), str(log)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        started = json.loads(launcher.stdout.readline())
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = json.loads(out.read_text())
        server = psutil.Process(started["server"])
        assert server.ppid() == launcher.pid and started["shared"]
        assert "realhf.scheduler.forkserver (forked by the launcher)" in " ".join(server.cmdline())
        assert seen["ppid"] == server.pid and seen["parent_env"] == str(server.pid)
        assert seen["sid"] == seen["pid"] == started["child"] and seen["env_x"] == "seven"
        assert seen["torch_preloaded"] and seen["stdin"] == ""
        # written unbuffered, as in a fresh process, though the launcher's stdout is a pipe
        assert "probe is sleeping" in log.read_text()
        launcher.stdin.write("\n")
        launcher.stdin.flush()
        assert json.loads(launcher.stdout.readline())["rc"] == -signal.SIGKILL
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    psutil.wait_procs([server], timeout=10)  # the launcher's exit closed it
    assert not server.is_running()
    assert sorted(p.name for p in tmp_path.glob("e.json.exited.*")) == [
        f"e.json.exited.{launcher.pid}"
    ]


def test_no_early_server_once_realhf_modules_are_imported():
    code = (
        "import realhf.base.constants\n"
        "from realhf.scheduler import forkserver\n"
        "assert forkserver.start_early() is None and not forkserver.shared_pids()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
