"""Sync ``ppo-math`` vs ``async-ppo-math``: trained samples per second and final accuracy.

Both runs start from the same model (the embedded tiny SFT model unless ``--model``), use the
same training data, group size, batch size, optimizer and number of trained samples
(``--steps`` x ``--batch`` prompts, ``--group-size`` answers each); they differ only in the
system: generate-then-train in one process (sync) vs generation servers and the trainer at
the same time under the staleness bound (async, ``--eta``).  Each run's final weights and the
starting model are graded by the same greedy evaluation (``evaluation/eval_and_aggregate.py``,
the 500 held-out problems of ``tiny_arith``).

samples/s = prompts trained / the run's training seconds (the master's summed step times,
evaluations excluded); the first step includes each system's warm-up.  The runs go one after
the other, so they do not share the CPU.

Run (about 2.5 minutes on the 2-core CPU VM):

    python benchmark/async_vs_sync.py [--steps 60 --batch 32 --group-size 8 --eta 1]

The last line printed is one JSON object with ``async_over_sync_samples_per_s``, ``acc_sft``,
``acc_sync`` and ``acc_async`` among other figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from evaluation.eval_and_aggregate import evaluate  # noqa: E402
from realhf.experiments.building_blocks import TINY_MODEL  # noqa: E402


def _run(name: str, fileroot: str, args) -> dict:
    """Run quickstart ``name``; return its figures and final checkpoint."""
    common = [
        f"fileroot={fileroot}",
        f"train_batch_size={args.batch}",
        f"ppo.group_size={args.group_size}",
        f"exp_ctrl.benchmark_steps={args.steps}",
        f"exp_ctrl.eval_freq_steps={args.steps}",
        f"seed={args.seed}",
    ]
    if args.model:
        common.append(f"actor.path={args.model}")
    extra = [f"max_head_offpolicyness={args.eta}"] if name == "async-ppo-math" else []
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", name, *common, *extra]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(
            f"{name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    run_dir = os.path.join(fileroot, name, "run0")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    samples = sum(r_["n_items"] for r_ in rows)
    seconds = rows[-1]["elapsed"]
    ckpt_root = os.path.join(run_dir, "checkpoints", "actor")
    ckpt = os.path.join(
        ckpt_root, sorted(os.listdir(ckpt_root), key=lambda d: int(d.split("globalstep")[1]))[-1]
    )
    out = {
        "wall_s": round(wall, 1),
        "train_s": round(seconds, 1),
        "samples": samples,
        "samples_per_s": samples / seconds,
        "step_s_median": sorted(r_["time"] for r_ in rows)[len(rows) // 2],
        "in_run_greedy_acc": rows[-1].get("eval/greedy_acc"),
        "checkpoint": ckpt,
    }
    if name == "async-ppo-math":
        out["staleness_max"] = max(r_["rollout/staleness_max"] for r_ in rows)
        out["staleness_mean"] = sum(r_["rollout/staleness_mean"] for r_ in rows) / len(rows)
    print(
        f"{name}: {samples} samples in {seconds:.1f} s of training ({out['samples_per_s']:.2f}/s), "
        f"wall {wall:.0f} s, median step {out['step_s_median']:.2f} s",
        flush=True,
    )
    return out


def _acc(model: str, out: str) -> float:
    summary = evaluate(model, ["tiny_arith"], out, max_gen_tokens=16)
    return summary["tiny_arith"]["greedy_acc"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eta", type=int, default=1, help="async max_head_offpolicyness")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="", help="start model (default: the embedded tiny SFT model)")
    p.add_argument(
        "--fileroot", default="", help="where the runs go (default: a temporary directory)"
    )
    args = p.parse_args()
    fileroot = args.fileroot or tempfile.mkdtemp(prefix="async_vs_sync_")
    sync = _run("ppo-math", fileroot, args)
    asyn = _run("async-ppo-math", fileroot, args)
    print("\ngrading the start model and both final models (greedy, 500 problems) ...", flush=True)
    acc_sft = _acc(args.model or TINY_MODEL, os.path.join(fileroot, "eval_sft"))
    acc_sync = _acc(sync["checkpoint"], os.path.join(fileroot, "eval_sync"))
    acc_async = _acc(asyn["checkpoint"], os.path.join(fileroot, "eval_async"))
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    print(
        f"\nsamples/s   sync {sync['samples_per_s']:.2f}   "
        f"async {asyn['samples_per_s']:.2f}   ratio {ratio:.2f}x"
    )
    print(f"wall        sync {sync['wall_s']:.0f} s   async {asyn['wall_s']:.0f} s")
    print(
        f"greedy acc  sft {100 * acc_sft:.1f}%   "
        f"sync {100 * acc_sync:.1f}%   async {100 * acc_async:.1f}%"
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "steps": args.steps,
        "batch": args.batch,
        "group_size": args.group_size,
        "eta": args.eta,
        "cpu_count": os.cpu_count(),
        "sync_samples_per_s": round(sync["samples_per_s"], 3),
        "async_samples_per_s": round(asyn["samples_per_s"], 3),
        "async_over_sync_samples_per_s": round(ratio, 3),
        "sync_wall_s": sync["wall_s"],
        "async_wall_s": asyn["wall_s"],
        "sync_step_s_median": round(sync["step_s_median"], 3),
        "async_step_s_median": round(asyn["step_s_median"], 3),
        "async_staleness_max": asyn["staleness_max"],
        "async_staleness_mean": round(asyn["staleness_mean"], 3),
        "acc_sft": round(acc_sft, 4),
        "acc_sync": round(acc_sync, 4),
        "acc_async": round(acc_async, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
