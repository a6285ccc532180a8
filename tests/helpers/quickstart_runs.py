"""Running a quickstart experiment from a test: start it, wait for its first steps (to act
mid-run), finish it, read its steps from ``metrics.jsonl``; and running any ``python -m
MODULE`` a test would otherwise execute (``run_module``, ``popen_module``).

A run is forked from realhf's fork server (:func:`realhf.scheduler.forkserver.launch`),
which has imported torch, transformers and numba once for the test process: the launcher
then starts in a fraction of the CPU a fresh interpreter takes (2-step ppo-math here:
~14.5 CPU seconds executed, ~8.5 forked).  A run whose environment or directory the server
cannot give it (see :meth:`~realhf.scheduler.forkserver.ForkServer.can_fork`), or any run
with ``REALHF_FORKSERVER=0``, is executed as ``python -m MODULE``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Dict, List, Mapping, Optional, Sequence

import psutil
import rank_processes

from realhf.scheduler import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = "realhf.apps.quickstart"


def _launch(module: str, args, env: Optional[Mapping], out: str, err: Optional[str] = None):
    argv = [sys.executable, "-m", module, *args]
    env = dict(os.environ, **(env or {}))
    modules = frozenset({module})
    return forkserver.launch(argv, env, out, err_path=err, modules=modules, cwd=ROOT)


def run(args: Sequence[str], timeout: float, env: Optional[Mapping] = None):
    """``python -m realhf.apps.quickstart ARGS`` run to its end (see :func:`run_module`)."""
    return run_module(QUICKSTART, args, timeout, env)


def run_module(module: str, args: Sequence[str], timeout: float, env: Optional[Mapping] = None):
    """``python -m MODULE ARGS`` run to its end, as ``subprocess.run(..., capture_output=True,
    text=True, timeout=timeout, cwd=ROOT)`` would, with ``env`` added to this process's
    environment: its stdout and stderr apart in the returned ``CompletedProcess``; killed,
    then ``TimeoutExpired`` raised, if it runs longer than ``timeout`` s."""
    tmp = tempfile.mkdtemp(prefix="forked-run-")
    try:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = _launch(module, args, env, out, err)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            return subprocess.CompletedProcess(proc.args, rc, f.read(), g.read())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_script(script: str, args: Sequence[str], timeout: float):
    """``python SCRIPT ARGS`` run to its end (see :func:`run_module`)."""
    return run_module(rank_processes.RUNNER, [os.path.abspath(script), *args], timeout)


def make_tiny_model(out: str) -> str:
    """A freshly initialised tiny model in ``out`` (``examples/tiny/make_model.py``; the
    embedded one is trained already); returns ``out``."""
    script = os.path.join(ROOT, "examples", "tiny", "make_model.py")
    r = run_script(script, ["--out", str(out)], 120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return str(out)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class _Output:
    """A run's output file read as the pipe of a ``Popen(stdout=PIPE, text=True)`` is: a line
    is returned once written, and the end comes when the run has exited."""

    def __init__(self, path: str, proc):
        self._file = open(path, errors="replace")
        self._proc = proc
        self._partial = ""

    def readline(self) -> str:
        while True:
            exited = self._proc.poll() is not None  # before reading: all it wrote is there
            self._partial += self._file.readline()
            if self._partial.endswith("\n") or exited:
                line, self._partial = self._partial, ""
                return line
            time.sleep(0.05)

    def __iter__(self):
        return iter(self.readline, "")

    def read(self) -> str:
        self._proc.wait()
        rest, self._partial = self._partial + self._file.read(), ""
        return rest

    def close(self) -> None:
        self._file.close()


class Run:
    """A process started by :func:`popen_module` (a quickstart run: :func:`start`), used as
    ``Popen(stdout=PIPE, stderr=STDOUT, text=True)`` is: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``, ``returncode``, ``communicate`` and ``stdout``."""

    def __init__(self, module: str, args: Sequence[str], env: Optional[Mapping]):
        fd, log = tempfile.mkstemp(prefix="forked-run-", suffix=".log")
        os.close(fd)
        weakref.finalize(self, _remove, log)
        self._proc = _launch(module, args, env, log)
        self.pid = self._proc.pid
        self.args = self._proc.args
        self.stdout = _Output(log, self._proc)
        weakref.finalize(self, self.stdout.close)

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.returncode

    def poll(self) -> Optional[int]:
        return self._proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        return self._proc.wait(timeout=timeout)

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: Optional[float] = None):
        self.wait(timeout=timeout)
        return self.stdout.read(), None


def popen_module(module: str, args: Sequence[str], env: Optional[Mapping] = None) -> Run:
    """``python -m MODULE ARGS`` started (stdout and stderr together in ``run.stdout``), with
    ``env`` added to this process's environment."""
    return Run(module, args, env)


def popen(args: Sequence[str], env: Optional[Mapping] = None) -> Run:
    """``python -m realhf.apps.quickstart ARGS`` started (see :func:`popen_module`)."""
    return popen_module(QUICKSTART, args, env)


def start(exp: str, args, fileroot, trial: str = "t", env: Optional[Mapping] = None) -> Run:
    """``python -m realhf.apps.quickstart EXP ARGS fileroot=... trial_name=...`` started
    (stdout and stderr together in ``run.stdout``)."""
    return popen([exp, *args, f"fileroot={fileroot}", f"trial_name={trial}"], env)


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
