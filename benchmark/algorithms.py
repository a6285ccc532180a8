"""Each ``algo=`` preset of ``ppo-math`` on the embedded task: accuracy gain and wall time.

Every run is the no-argument ``python -m realhf.apps.quickstart ppo-math algo=NAME
seed=S`` (the embedded tiny task: its SFT model, 60 steps, greedy accuracy on the 500
held-out problems before step 1 and every 10 steps), one after the other so that runs do
not share the CPU.  The figures come from each run's ``summary.json`` (start and final
greedy accuracy, wall time).  ``algo=`` (empty) is the default recipe, for comparison.

    python benchmark/algorithms.py                         # every preset x seeds 1 2 3
    python benchmark/algorithms.py --algos dapo gspo --seeds 1 --steps 20

Prints one line per run as it finishes, then a Markdown table (mean and spread over the
seeds of start, final and gain, and the mean wall time; ``collapsed`` counts runs whose
final accuracy fell below their start) and, last, one JSON object with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from realhf.experiments.algo_presets import ALGO_PRESETS  # noqa: E402

#: seconds one run may take before it counts as failed
RUN_TIMEOUT_S = 1800


def run_one(algo: str, seed: int, steps: int, fileroot: str, extra: List[str]) -> Dict:
    """One quickstart run; its summary (``status`` failed with the output's tail on error)."""
    trial = f"{algo or 'default'}-s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "realhf.apps.quickstart",
        "ppo-math",
        *([f"algo={algo}"] if algo else []),
        f"seed={seed}",
        f"fileroot={fileroot}",
        "experiment_name=algorithms",
        f"trial_name={trial}",
        f"exp_ctrl.benchmark_steps={steps}",
        *extra,
    ]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    path = os.path.join(fileroot, "algorithms", trial, "summary.json")
    if r.returncode != 0 or not os.path.isfile(path):
        tail = (r.stdout + r.stderr)[-2000:]
        return {"algo": algo, "seed": seed, "status": "failed", "exit": r.returncode, "tail": tail}
    with open(path) as f:
        s = json.load(f)
    acc = s.get("accuracy") or {}
    return {
        "algo": algo,
        "seed": seed,
        "status": s["status"],
        "start": acc.get("start"),
        "final": acc.get("final"),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _spread(xs: List[float]) -> str:
    mean = statistics.fmean(xs)
    half = (max(xs) - min(xs)) / 2
    return f"{100 * mean:.1f} ± {100 * half:.1f}" if len(xs) > 1 else f"{100 * mean:.1f}"


def table(runs: List[Dict]) -> str:
    """Markdown: per preset, start / final / gain in accuracy points (mean ± half the range
    over seeds), mean wall time, runs that collapsed (final < start) and failed runs."""
    lines = [
        "| algo | seeds | start % | final % | gain (points) | wall s | collapsed | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for algo in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == algo]
        ok = [r for r in mine if r["status"] == "finished" and r["final"] is not None]
        failed = len(mine) - len(ok)
        if not ok:
            lines.append(f"| {algo or '(default)'} | {len(mine)} | | | | | | {failed} |")
            continue
        gains = [r["final"] - r["start"] for r in ok]
        lines.append(
            f"| {algo or '(default)'} | {len(ok)} | {_spread([r['start'] for r in ok])} | "
            f"{_spread([r['final'] for r in ok])} | {_spread(gains)} | "
            f"{statistics.fmean(r['wall_s'] for r in ok):.0f} | "
            f"{sum(g < 0 for g in gains)} | {failed} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", nargs="*", default=list(ALGO_PRESETS), help="presets ('' = none)")
    p.add_argument("--seeds", nargs="*", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--fileroot", default="", help="run directories (default: a temp dir)")
    p.add_argument("extra", nargs="*", help="more key=value options for every run")
    args = p.parse_args()
    unknown = [a for a in args.algos if a not in ALGO_PRESETS]
    if unknown:
        p.error(f"unknown presets {unknown}; known: {sorted(ALGO_PRESETS)}")
    fileroot = args.fileroot or tempfile.mkdtemp(prefix="realhf-algos-")
    runs = []
    for algo in args.algos:
        for seed in args.seeds:
            r = run_one(algo, seed, args.steps, fileroot, args.extra)
            runs.append(r)
            if r["status"] == "failed":
                print(f"{algo or '(default)'} seed {seed}: FAILED\n{r['tail']}", flush=True)
            else:
                print(
                    f"{algo or '(default)'} seed {seed}: {100 * r['start']:.1f}% -> "
                    f"{100 * r['final']:.1f}% in {r['wall_s']:.0f}s",
                    flush=True,
                )
    print(table(runs))
    print(json.dumps({"steps": args.steps, "runs": runs}))
    return 0 if all(r["status"] == "finished" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
