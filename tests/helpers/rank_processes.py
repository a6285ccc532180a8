"""Run a test script once per rank as separate processes and collect what each wrote.

Multi-rank gloo tests run their own file as a script (``python test_x.py --rank r ...``) so
that each rank is a fresh process; every rank writes ``{out_dir}/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence


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

    Whatever happens, no rank outlives the call: leftovers are killed and reaped.
    """
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--rank",
                str(r),
                "--world",
                str(world),
                *args(r),
                "--out-dir",
                str(out_dir),
            ],
            env=env,
        )
        for r in range(world)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0
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
