"""Run a test script once per rank as separate processes and collect what each wrote.

Multi-rank gloo tests run their own file as a script (``python test_x.py --rank r ...``) so
that each rank is a fresh process; every rank writes ``{out_dir}/rank{r}.json``.

The ranks are forked from realhf's fork server (:mod:`realhf.scheduler.forkserver`), which
has imported torch, transformers and numba once for the test process: a rank then starts
in ~0.5 s of CPU instead of ~4 s.  A rank that the server cannot start as it would start
afresh (its environment differs in what those libraries read at import, or forking is
off: ``REALHF_FORKSERVER=0``) is executed as before.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from realhf.scheduler import forkserver

#: the module that runs a script as ``python SCRIPT`` would (tests/helpers/rank_script.py)
RUNNER = "rank_script"
MODULES = frozenset({RUNNER})


def fresh_context():
    """The multiprocessing context for a test's rank processes started from a function:
    ``forkserver``, whose server imports what realhf's fork server preloads
    (:data:`realhf.scheduler.forkserver.PRELOAD`) once for this test process.  A
    process forked from it is as fresh as a spawned one (the server is a new interpreter
    that has run nothing else and started no thread) and starts in a fraction of the
    CPU; as with spawn, it gets the target and its arguments pickled and this process's
    ``sys.path``, but the environment the server had when it started."""
    multiprocessing.set_forkserver_preload(list(forkserver.PRELOAD))
    return multiprocessing.get_context("forkserver")


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"(no log: {e})"


def run_ranks(
    script: str,
    world: int,
    args: Callable[[int], Sequence[str]],
    out_dir: str,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 120.0,
) -> List[dict]:
    """Start ``python script --rank r --world W *args(r) --out-dir out_dir`` for every rank,
    require exit code 0 from each within ``timeout`` s, and return the ranks' JSON outputs.
    Each rank's output goes to ``{out_dir}/rank{r}.log``; a failure shows their tails.

    Whatever happens, no rank outlives the call: leftovers are killed and reaped.
    """
    env = dict(os.environ if env is None else env)
    procs, logs = [], []
    try:
        for r in range(world):
            argv = [sys.executable, "-m", RUNNER, os.path.abspath(script)]
            argv += ["--rank", str(r), "--world", str(world), *args(r), "--out-dir", str(out_dir)]
            logs.append(os.path.join(out_dir, f"rank{r}.log"))
            procs.append(forkserver.launch(argv, env, logs[-1], modules=MODULES))
        for r, p in enumerate(procs):
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = f"still running after {timeout:g}s"
            if rc != 0:
                tails = "\n".join(
                    f"--- rank {i} ({logs[i]}):\n{_tail(logs[i])}" for i in range(world)
                )
                raise AssertionError(f"rank {r} of {script}: exit {rc}\n{tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results
