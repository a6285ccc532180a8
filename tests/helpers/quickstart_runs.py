"""Running a quickstart experiment in a subprocess from a test: start it, wait for its
first steps (to act mid-run), finish it, read its steps from ``metrics.jsonl``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import List, Mapping, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(exp: str, args, fileroot, trial: str = "t", env: Optional[Mapping] = None):
    """``python -m realhf.apps.quickstart EXP ARGS fileroot=... trial_name=...`` (stdout and
    stderr together in ``proc.stdout``)."""
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", exp, *args]
    cmd += [f"fileroot={fileroot}", f"trial_name={trial}"]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=None if env is None else dict(os.environ, **env),
    )


def steps(run_dir) -> List[int]:
    """The steps ``metrics.jsonl`` records, in order ([] before the first)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def wait_for_steps(proc, run_dir, n: int, timeout: float = 180.0) -> None:
    """Block until the run logged ``n`` steps; fail naming the run's output if it ended."""
    deadline = time.monotonic() + timeout
    while len(steps(run_dir)) < n:
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps within {timeout:g}s"
        time.sleep(0.2)


@contextlib.contextmanager
def killed_on_error(proc):
    """Kill the run if the block raises (a test failing mid-run leaves nothing running)."""
    try:
        yield
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def finish(proc, timeout: float = 400.0, code: int = 0) -> str:
    """Wait for the run; assert its exit code; return its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, out[-4000:]
    return out
