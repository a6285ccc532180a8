"""LocalScheduler with real subprocesses: logs, outcomes, and no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from realhf.scheduler.local import JobFailure, LocalScheduler

PY = sys.executable


def _py(code: str):
    return [PY, "-c", textwrap.dedent(code)]


def _pids_alive(pids):
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
def test_success_logs_and_index_substitution(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path), env={"GREETING": "hi"})
    s.submit(
        "worker",
        _py(
            "import os,sys; "
            "print(os.environ['GREETING'], sys.argv[1], os.environ['REALHF_WORKER_INDEX'])"
        )
        + ["idx={index}"],
        count=2,
    )
    s.submit("controller", _py("print('controller done')"))
    codes = s.wait(timeout=30)
    assert codes == {"worker/0": 0, "worker/1": 0, "controller/0": 0}
    logs = sorted(os.listdir(tmp_path / "logs"))
    assert logs == ["controller_0.log", "worker_0.log", "worker_1.log"]
    assert (tmp_path / "logs" / "worker_1.log").read_text().strip() == "hi idx=1 1"
    no_leftover_processes()


@pytest.mark.slow
def test_failed_worker_stops_everything_and_names_it(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path))
    s.submit("controller", _py("import time; time.sleep(60)"))
    s.submit("sleeper", _py("import time; time.sleep(60)"))
    s.submit("crasher", _py("import sys; print('about to fail'); sys.exit(3)"))
    t0 = time.monotonic()
    with pytest.raises(JobFailure) as ei:
        s.wait(failure_grace=0.5, timeout=30)
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert "crasher/0 (exit code 3)" in msg and "about to fail" in msg
    assert [j.name for j in ei.value.failed] == ["crasher/0"]
    no_leftover_processes()


@pytest.mark.slow
def test_controller_failure_is_reported_first(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path))
    s.submit("worker", _py("import time; time.sleep(60)"))
    s.submit("controller", _py("import sys; print('worker X failed: ValueError'); sys.exit(1)"))
    with pytest.raises(JobFailure) as ei:
        s.wait(timeout=30, exit_grace=0.5)
    assert ei.value.failed[0].name == "controller/0"
    assert "worker X failed: ValueError" in str(ei.value)
    no_leftover_processes()


@pytest.mark.slow
def test_stragglers_after_controller_success_are_stopped(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path))
    s.submit("worker", _py("import time; time.sleep(60)"))
    s.submit("controller", _py("pass"))
    t0 = time.monotonic()
    codes = s.wait(exit_grace=0.3, timeout=30)
    assert time.monotonic() - t0 < 10
    assert codes["controller/0"] == 0 and codes["worker/0"] == -signal.SIGTERM
    no_leftover_processes()


@pytest.mark.slow
def test_grandchildren_die_with_their_group(tmp_path, no_leftover_processes):
    pidfile = tmp_path / "grandchild.pid"
    s = LocalScheduler(str(tmp_path))
    s.submit(
        "worker",
        _py(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(p.pid))
        time.sleep(60)
    """),
    )
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    with pytest.raises(TimeoutError, match=r"still running: \['worker/0'\]"):
        s.wait(timeout=0.5)
    assert _pids_alive([grandchild]) == []
    no_leftover_processes()


@pytest.mark.slow
def test_ctrl_c_is_forwarded_and_nothing_remains(tmp_path, no_leftover_processes):
    """SIGINT to a launcher process: jobs get SIGINT, launcher exits, no orphans."""
    marker = tmp_path / "pids"
    script = tmp_path / "launcher.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        from realhf.scheduler.local import LocalScheduler
        s = LocalScheduler({str(tmp_path)!r})
        code = "import signal, sys, time\\n" \\
               "signal.signal(signal.SIGINT, " \\
               "lambda *a: (print('got SIGINT', flush=True), sys.exit(0)))\\n" \\
               "time.sleep(60)"
        jobs = s.submit("controller", [sys.executable, "-c", code])
        jobs += s.submit("worker", [sys.executable, "-c", code], count=2)
        open({str(marker)!r}, "w").write(" ".join(str(j.pid) for j in jobs))
        try:
            s.wait(timeout=60)
        except KeyboardInterrupt:
            print("launcher interrupted", flush=True)
            sys.exit(130)
    """)
    )
    launcher = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "launcher did not start its jobs"
            time.sleep(0.05)
        pids = [int(p) for p in marker.read_text().split()]
        time.sleep(0.5)  # let the jobs install their SIGINT handlers
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out
    assert b"launcher interrupted" in out
    assert _pids_alive(pids) == []
    logs = [(tmp_path / "logs" / f).read_text() for f in sorted(os.listdir(tmp_path / "logs"))]
    assert all("got SIGINT" in log for log in logs), logs


def test_bad_input(tmp_path):
    s = LocalScheduler(str(tmp_path), gpu_devices=[])
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        s.submit("w", ["true"], count=0)
    with pytest.raises(ValueError, match="cmd must be a non-empty list of str"):
        s.submit("w", [])
    with pytest.raises(ValueError, match="asks for 1 GPU"):
        s.submit("w", ["true"], gpus_per_process=1)
    with pytest.raises(RuntimeError, match="nothing was submitted"):
        s.wait()


@pytest.mark.slow
def test_gpus_are_assigned_round_robin(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path), gpu_devices=["0", "1", "2"])
    s.submit(
        "w",
        _py("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"),
        count=3,
        gpus_per_process=2,
    )
    s.wait(timeout=30)
    got = [(tmp_path / "logs" / f"w_{i}.log").read_text().strip() for i in range(3)]
    assert got == ["0,1", "2,0", "1,2"]


@pytest.mark.slow
def test_restartable_jobs_are_restarted_alone_and_killed_on_request(
    tmp_path, no_leftover_processes
):
    marker = tmp_path / "ran"
    s = LocalScheduler(str(tmp_path))
    # The worker fails on its first run and succeeds on its second (same command, same env).
    s.submit(
        "flaky",
        _py(
            f"""
            import os, sys
            first = not os.path.exists({str(marker)!r})
            open({str(marker)!r}, "a").write("x")
            sys.exit(3 if first else 0)
            """
        ),
    )
    (hung,) = s.submit("hung", _py("import time; time.sleep(600)"))
    s.submit("controller", _py("import time; time.sleep(4)"))
    first_pid = hung.pid
    requests = {"hung/0": first_pid}

    def take():
        out = dict(requests)
        requests.clear()
        return out

    s.restartable = {"flaky": 2, "hung": 1}
    s.take_restart_requests = take
    codes = s.wait(timeout=60, exit_grace=1)
    assert marker.read_text() == "xx" and codes["flaky/0"] == 0
    # the hung job was killed on request, restarted, and stopped after the controller ended
    assert hung.pid != first_pid and hung.stopped_as_straggler
    log = (tmp_path / "logs" / "flaky_0.log").read_text()
    assert "flaky/0 restarted after exit code 3" in log
    no_leftover_processes()


@pytest.mark.slow
def test_a_restartable_job_out_of_restarts_fails_the_launch(tmp_path, no_leftover_processes):
    s = LocalScheduler(str(tmp_path))
    s.submit("flaky", _py("import sys; sys.exit(3)"))
    s.submit("controller", _py("import time; time.sleep(30)"))
    s.restartable = {"flaky": 2}
    with pytest.raises(JobFailure, match="flaky/0"):
        s.wait(timeout=60, failure_grace=0.5)
    assert (tmp_path / "logs" / "flaky_0.log").read_text().count("restarted after") == 2
    no_leftover_processes()
