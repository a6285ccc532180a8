"""Running a quickstart experiment in a subprocess from a test: start it, wait for its
first steps (to act mid-run), finish it, read its steps from ``metrics.jsonl``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional

import psutil

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


def rows(path) -> List[dict]:
    """The JSON lines of ``path``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_per_step(records: List[dict]) -> List[dict]:
    """One record per step, the last one (a replayed step's later line is the one that
    counts), in step order."""
    out: Dict[int, dict] = {}
    for r in records:
        out[r["step"]] = r
    return [out[s] for s in sorted(out)]


def check_trained(run_dir, n_steps: int, batch_size: int, eta: int) -> List[dict]:
    """From ``trajectories.jsonl``: every step s trained exactly indices [sB, (s+1)B), each
    trajectory within the staleness bound ``eta``, no prompt twice per (worker, epoch)."""
    batches = last_per_step(rows(os.path.join(run_dir, "trajectories.jsonl")))
    assert [b["step"] for b in batches] == list(range(1, n_steps + 1))
    seen = set()
    for b in batches:
        s = b["trained_version"]
        assert b["indices"] == list(range(s * batch_size, (s + 1) * batch_size))
        for vs in b["version_start"]:
            assert all(0 <= s - v <= eta for v in vs), (s, b["version_start"])
        for p, w, e in zip(b["prompts"], b["workers"], b["data_epochs"]):
            assert (w, e, p) not in seen, f"prompt {p} of {w} epoch {e} trained twice"
            seen.add((w, e, p))
    return batches


def worker_processes(proc, worker_type: str) -> List[psutil.Process]:
    """The live worker processes of type ``worker_type`` that the run ``proc`` launched."""
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            argv = " ".join(p.cmdline()).split()  # a forked worker's title may be one word
        except psutil.Error:
            continue
        if "realhf.apps.remote" in argv and worker_type in argv:
            out.append(p)
    return out
