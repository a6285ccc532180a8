"""Sync ``ppo-math`` vs ``async-ppo-math``: trained samples per second and final accuracy.

Both runs start from the same model (the embedded task's SFT model unless ``--model``), use
the same training data, group size, batch size, optimizer and number of trained samples
(``--steps`` x ``--batch`` prompts, ``--group-size`` answers each); they differ only in the
system: generate-then-train in one process (sync) vs generation servers and the trainer at
the same time under the staleness bound (async, ``--eta``).  Each run's final weights and the
starting model are graded by the same greedy evaluation (``evaluation/eval_and_aggregate.py``,
the 500 held-out problems of the task).

Tasks (``--task``): ``tiny_arith`` (2-digit arithmetic, ~6-token answers of equal length) and
``tiny_long`` (worked chains, 10-240 token answers with a long tail; the regime asynchrony is
for).  Per run it reports:

- samples/s = prompts trained / the run's training seconds (the master's summed step times,
  evaluations excluded; the first step includes each system's warm-up);
- generation-batch occupancy: running sequences / slots of every engine step, weighted by
  time (engines record it when ``REALHF_GEN_OCCUPANCY_DIR`` is set), overall and per tenth
  of the run;
- trainer idle share: the part of the training span the trainer spent outside ``actor_train``
  (from the run's ``trace.json``; for sync this is the generation and reward time);
- final greedy accuracy.

``--sweep`` adds async points: ``max_head_offpolicyness`` over ``--etas`` and the
generation/training thread split over ``--splits`` (``G:T`` = generation-server threads :
trainer threads).  The runs go one after the other, so they do not share the CPU.

    python benchmark/async_vs_sync.py                       # tiny_arith, ~2.5 min
    python benchmark/async_vs_sync.py --task tiny_long --steps 20 --sweep

The last line printed is one JSON object with ``async_over_sync_samples_per_s`` (the
default async point), ``best_async_over_sync``, the accuracies, and every point's figures.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from evaluation.eval_and_aggregate import evaluate  # noqa: E402
from realhf.api.core.rollout_config import RolloutWorkerConfig  # noqa: E402
from realhf.base import constants  # noqa: E402
from realhf.experiments.async_ppo_math import WEIGHT_POLL_INTERVAL_S  # noqa: E402
from realhf.experiments.building_blocks import task_data, task_model  # noqa: E402
from realhf.impl.model.gen.engine import OCCUPANCY_DIR_ENV  # noqa: E402

#: greedy answer budget of each task's evaluation (the tasks' own max_new_tokens)
EVAL_TOKENS = {"tiny_arith": 16, "tiny_long": 256}


def _trace_events(run_dir: str) -> list:
    with open(os.path.join(run_dir, "trace.json")) as f:
        text = f.read().strip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


def trainer_idle_share(run_dir: str) -> float:
    """Share of the training span (first step start → last step end) outside ``actor_train``."""
    ev = _trace_events(run_dir)
    steps = [e for e in ev if e.get("ph") == "X" and str(e.get("name", "")).startswith("step ")]
    train = [e for e in ev if e.get("ph") == "X" and e.get("name") == "actor_train"]
    if not steps or not train:
        return float("nan")
    # The span starts when the first step does (launch and model loading are not in it).
    span = max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps)
    busy = sum(e["dur"] for e in train)
    return max(0.0, 1.0 - busy / span) if span > 0 else float("nan")


def _engine_steps(occ_dir: str, t0: float, t1: float):
    """``(end time, running, slots, seconds)`` of every engine step ending in [t0, t1].

    Each engine step's row holds its end time and the sequences it advanced; a step lasts
    from the previous row of the same engine.  A gap of more than ten median steps (at
    least 0.2 s) is idle time, not a step: the engine waited for work (sync: while the
    model trained); such a row has ``seconds`` None and counts as one median step where
    time is summed.  Yields ``(t, running, slots, seconds, median)``.
    """
    for path in glob.glob(os.path.join(occ_dir, "occupancy-*.tsv")):
        with open(path) as f:
            rows = [line.split("\t") for line in f if line.strip()]
        times = [float(r[0]) for r in rows]
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        if not gaps:
            continue
        median = gaps[len(gaps) // 2]
        idle = max(0.2, 10 * median)
        for prev, t, r in zip(times, times[1:], rows[1:]):
            if t0 <= t <= t1:
                yield t, int(r[1]), int(r[2]), (t - prev if t - prev <= idle else None), median


def occupancy(occ_dir: str, t0: float, t1: float, buckets: int = 10) -> dict:
    """Time-weighted occupancy (running / slots) of every engine step in [t0, t1], overall
    and per ``buckets``-th of the span, and the share of the span with a step going."""
    total = [0.0, 0.0]  # occupied slot-seconds, busy seconds
    per = [[0.0, 0.0] for _ in range(buckets)]
    width = (t1 - t0) / buckets
    for t, running, slots, dt, median in _engine_steps(occ_dir, t0, t1):
        dt, frac = median if dt is None else dt, running / slots
        total[0] += frac * dt
        total[1] += dt
        b = min(buckets - 1, int((t - t0) / width))
        per[b][0] += frac * dt
        per[b][1] += dt
    return {
        "mean": total[0] / total[1] if total[1] else float("nan"),
        "busy_share": total[1] / (t1 - t0) if t1 > t0 else float("nan"),
        "series": [round(o / s, 3) if s else 0.0 for o, s in per],
    }


#: Upper edges (exclusive) of the running-sequence bins of :func:`decode_table`.
DECODE_BINS = (4, 16, 64, 128, 192, 1 << 20)


def decode_table(occ_dir: str, t0: float, t1: float) -> List[List[float]]:
    """The engine's step cost inside the run: ``[b, seconds]`` per bin of running sequences
    (``DECODE_BINS``), ``b`` the bin's median running count and ``seconds`` its median step
    (idle gaps left out) -- what ``benchmark/simulate.py --validate --costs in-run`` uses
    in place of the isolated profile's decode cost."""
    bins: List[List[Tuple[int, float]]] = [[] for _ in DECODE_BINS]
    for _, running, _, dt, _ in _engine_steps(occ_dir, t0, t1):
        if dt is not None and running > 0:
            bins[next(i for i, e in enumerate(DECODE_BINS) if running < e)].append((running, dt))
    table = []
    for rows in bins:
        if len(rows) >= 5:
            bs, ss = sorted(r for r, _ in rows), sorted(s for _, s in rows)
            table.append([bs[len(bs) // 2], round(ss[len(ss) // 2], 6)])
    return table


def train_s_per_token(rows: List[dict]) -> float:
    """Seconds of ``actor_train`` per trained token inside the run (the master's per-step
    ``timing/actor_train`` over its ``tokens``), the first step (warm-up) left out."""
    rows = rows[1:] or rows
    tokens = sum(r.get("tokens", 0) for r in rows)
    return sum(r.get("timing/actor_train", 0.0) for r in rows) / tokens if tokens else float("nan")


def step_other_s(rows: List[dict]) -> float:
    """Median seconds of a sync step outside ``actor_gen`` and ``actor_train`` (rewards,
    data movement, the master), the first step left out."""
    rest = sorted(
        r["time"] - r.get("timing/actor_gen", 0.0) - r.get("timing/actor_train", 0.0)
        for r in rows[1:] or rows
    )
    return max(0.0, rest[len(rest) // 2])


class CpuSampler(threading.Thread):
    """CPU seconds each worker kind of a run used: every process under ``pid`` (the
    launcher), by its ``--type`` (or ``controller`` / ``launcher``), sampled each second."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done = pid, threading.Event()
        self.seen: Dict[int, tuple] = {}  # pid -> (kind, cpu seconds)

    def run(self):
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.done.wait(1.0):
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                return
            for proc in procs:
                try:
                    cmd, t = " ".join(proc.cmdline()).split(), proc.cpu_times()
                except psutil.Error:
                    continue
                kind = "launcher"
                if "--type" in cmd:
                    kind = cmd[cmd.index("--type") + 1]
                elif "controller" in cmd:
                    kind = "controller"
                self.seen[proc.pid] = (kind, t.user + t.system)

    def by_kind(self) -> Dict[str, float]:
        self.done.set()
        self.join()
        out: Dict[str, float] = {}
        for kind, cpu in self.seen.values():
            out[kind] = round(out.get(kind, 0.0) + cpu, 1)
        return out


def _run(name: str, fileroot: str, args, extra: List[str], label: str, steps: int) -> dict:
    """Run quickstart ``name`` in ``fileroot/label``; return its figures and final checkpoint."""
    root = os.path.join(fileroot, label)
    occ_dir = os.path.join(root, "occupancy")
    common = [
        f"fileroot={root}",
        f"task={args.task}",
        f"train_batch_size={args.batch}",
        f"ppo.group_size={args.group_size}",
        f"exp_ctrl.benchmark_steps={steps}",
        f"exp_ctrl.eval_freq_steps={steps}",
        "exp_ctrl.eval_at_start=false",  # the SFT start is evaluated once, outside the runs
        f"seed={args.seed}",
    ]
    if args.model:
        common.append(f"actor.path={args.model}")
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", name, *common, *extra]
    print(f"\n[{label}] $ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    wall0 = time.time()
    env = dict(os.environ, **{OCCUPANCY_DIR_ENV: occ_dir})
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    sampler = CpuSampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    cpu = sampler.by_kind()
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(
            f"{name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    run_dir = os.path.join(root, name, "run0")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    samples = sum(r_["n_items"] for r_ in rows)
    seconds = rows[-1]["elapsed"]
    ckpt = constants.hf_checkpoints(run_dir, "actor")[-1][2]
    marks = [e for e in _trace_events(run_dir) if str(e.get("name", "")).startswith("step ")]
    span = (
        (min(e["ts"] for e in marks) / 1e6, max(e["ts"] + e["dur"] for e in marks) / 1e6)
        if marks
        else (wall0, wall0 + wall)
    )
    occ = occupancy(occ_dir, *span)
    out = {
        "label": label,
        "steps": steps,
        "wall_s": round(wall, 1),
        "train_s": round(seconds, 1),
        "samples": samples,
        "samples_per_s": samples / seconds,
        # the same without the first step (each system's warm-up): what the simulator models
        "samples_per_s_after_first": (
            (samples - rows[0]["n_items"]) / (seconds - rows[0]["time"])
            if len(rows) > 1
            else samples / seconds
        ),
        "step_s_median": sorted(r_["time"] for r_ in rows)[len(rows) // 2],
        "occupancy_mean": round(occ["mean"], 3),
        "gen_busy_share": round(occ["busy_share"], 3),
        "occupancy_series": occ["series"],
        "trainer_idle_share": round(trainer_idle_share(run_dir), 3),
        "decode_table": decode_table(occ_dir, *span),
        "train_s_per_token": train_s_per_token(rows),
        # trained sequence length (prompt + answer), mean over steps: the run's workload
        "seq_len_mean": round(sum(r_["actor_train/ppo/seq_len"] for r_ in rows) / len(rows), 2),
        "cpu_s": cpu,
        "checkpoint": ckpt,
    }
    if name == "ppo-math":
        out["step_other_s"] = round(step_other_s(rows), 4)
    if name == "async-ppo-math":
        out["staleness_max"] = max(r_["rollout/staleness_max"] for r_ in rows)
        out["staleness_mean"] = round(
            sum(r_["rollout/staleness_mean"] for r_ in rows) / len(rows), 3
        )
    print(
        f"[{label}] {samples} samples in {seconds:.1f} s of training "
        f"({out['samples_per_s']:.2f}/s), wall {wall:.0f} s, median step "
        f"{out['step_s_median']:.2f} s, occupancy {out['occupancy_mean']:.2f}, "
        f"trainer idle {out['trainer_idle_share']:.2f}",
        flush=True,
    )
    return out


def start_lengths(
    model: str, task: str, n: int = 512, seed: int = 1
) -> Tuple[List[int], List[int]]:
    """Prompt and answer lengths (tokens, EOS included) of ``model`` sampled at temperature 1
    on the first ``n`` training prompts of ``task``: the lengths a run starts from."""
    from transformers import AutoTokenizer

    from realhf.api.core.gen_api import GenerateRequest, SamplingParams
    from realhf.impl.model.gen.engine_config import EngineConfig
    from realhf.impl.model.gen.loading import load_engine

    tok = AutoTokenizer.from_pretrained(model)
    with open(task_data(task, "train")) as f:
        prompts = [
            tuple(tok(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"])
            for _, line in zip(range(n), f)
        ]
    sp = SamplingParams(max_new_tokens=EVAL_TOKENS[task], temperature=1.0)
    engine = load_engine(model, EngineConfig(max_running_requests=256, seed=seed), tok).start()
    try:
        outs = engine.generate([GenerateRequest(p, sp) for p in prompts], timeout=600)
    finally:
        engine.close()
    return [len(p) for p in prompts], [len(o.output_ids) for o in outs]


def simulator_rows(args, runs: List[dict], lengths_file: str, prompt_len: float) -> List[dict]:
    """The runs as ``benchmark/simulate.py --validate`` rows."""
    rows = []
    for r in runs:
        row = {
            "task": args.task,
            "label": r["label"],
            "batch": args.batch,
            "group_size": args.group_size,
            "steps": r["steps"],
            "samples_per_s": round(r["samples_per_s"], 3),
            "samples_per_s_after_first": round(r["samples_per_s_after_first"], 3),
            "max_new_tokens": EVAL_TOKENS[args.task],
            "prompt_len": round(prompt_len),
            "lengths_file": os.path.basename(lengths_file),
            "decode_table": r["decode_table"],
            "train_s_per_token": r["train_s_per_token"],
            "seq_len_mean": r["seq_len_mean"],
        }
        other = sum(
            v for k, v in r["cpu_s"].items() if k not in ("model_worker", "generation_server")
        )
        row.update(
            cpu_count=os.cpu_count(),
            overhead_cpu_s_per_answer=round(other / (r["samples"] * args.group_size), 6),
            cpu_s=r["cpu_s"],
        )
        if r["label"] == "sync":
            row.update(mode="sync", threads=os.cpu_count(), step_other_s=r["step_other_s"])
        else:
            g, t = r["threads"]
            row.update(
                mode="async",
                eta=r["eta"],
                gen_threads=g,
                train_threads=t,
                weight_poll_interval_s=WEIGHT_POLL_INTERVAL_S,
                allocate_retry_interval_s=RolloutWorkerConfig.allocate_retry_interval_s,
            )
        rows.append(row)
    return rows


def _acc(model: str, out: str, task: str) -> float:
    summary = evaluate(model, [task], out, max_gen_tokens=EVAL_TOKENS[task])
    return summary[task]["greedy_acc"]


def _async_extra(eta: int, split: Optional[str]) -> List[str]:
    extra = [f"max_head_offpolicyness={eta}"]
    if split:
        g, t = split.split(":")
        extra += [f"gen_server.num_threads={int(g)}", f"torch_threads={int(t)}"]
    return extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="tiny_arith", choices=sorted(EVAL_TOKENS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eta", type=int, default=1, help="async max_head_offpolicyness")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", default="", help="start model (default: the task's SFT model)")
    p.add_argument("--sweep", action="store_true", help="also run the --etas and --splits points")
    p.add_argument("--etas", default="0,1,2,4", help="η values of the sweep")
    p.add_argument(
        "--splits",
        default="2:1,1:2,2:2",
        help="generation:trainer thread splits of the sweep (at --eta)",
    )
    p.add_argument("--sweep-steps", type=int, default=15, help="steps of each extra sweep point")
    p.add_argument("--no-eval", action="store_true", help="skip the greedy evaluations")
    p.add_argument(
        "--async-extra",
        default="",
        help="more key=value overrides of the async runs, space separated (e.g. "
        "share_gpus=0.3: server and trainer on one GPU)",
    )
    p.add_argument(
        "--rows-out",
        default="",
        help="also write the runs as benchmark/simulate.py --validate rows (with the start "
        "model's sampled answer lengths beside them)",
    )
    p.add_argument(
        "--fileroot", default="", help="where the runs go (default: a temporary directory)"
    )
    args = p.parse_args()
    fileroot = args.fileroot or tempfile.mkdtemp(prefix="async_vs_sync_")
    sync = _run("ppo-math", fileroot, args, [], "sync", args.steps)
    default_threads = max(1, ((os.cpu_count() or 1) - 1) // 2)  # async_ppo_math._threads(1)
    points = [(f"async_eta{args.eta}", args.eta, None)]
    if args.sweep:
        points += [
            (f"async_eta{e}", int(e), None) for e in args.etas.split(",") if int(e) != args.eta
        ]
        points += [
            (f"async_eta{args.eta}_split{s.replace(':', '-')}", args.eta, s)
            for s in args.splits.split(",")
            if s
        ]
    runs = [sync]
    for i, (label, eta, split) in enumerate(points):
        steps = args.steps if i == 0 else args.sweep_steps
        extra = _async_extra(eta, split) + args.async_extra.split()
        r = _run("async-ppo-math", fileroot, args, extra, label, steps)
        g, t = map(int, split.split(":")) if split else (default_threads, default_threads)
        r.update(eta=eta, threads=(g, t))
        runs.append(r)
    if not args.no_eval:
        print("\ngrading the start model and every final model (greedy, 500 problems) ...")
        acc_sft = _acc(
            args.model or task_model(args.task), os.path.join(fileroot, "eval_sft"), args.task
        )
        for r in runs:
            r["acc"] = round(
                _acc(r["checkpoint"], os.path.join(fileroot, f"eval_{r['label']}"), args.task), 4
            )
    else:
        acc_sft = float("nan")
    base = sync["samples_per_s"]
    print(f"\n{'run':<24}{'samples/s':>10}{'ratio':>7}{'occupancy':>10}{'idle':>6}{'acc':>7}")
    for r in runs:
        r["ratio"] = round(r["samples_per_s"] / base, 3)
        print(
            f"{r['label']:<24}{r['samples_per_s']:>10.2f}{r['ratio']:>7.2f}"
            f"{r['occupancy_mean']:>10.2f}{r['trainer_idle_share']:>6.2f}"
            f"{100 * r.get('acc', float('nan')):>6.1f}%"
        )
    print(f"start model greedy accuracy {100 * acc_sft:.1f}%")
    default = runs[1]
    result = {
        "date": datetime.date.today().isoformat(),
        "task": args.task,
        "steps": args.steps,
        "batch": args.batch,
        "group_size": args.group_size,
        "eta": args.eta,
        "cpu_count": os.cpu_count(),
        "sync_samples_per_s": round(base, 3),
        "async_samples_per_s": round(default["samples_per_s"], 3),
        "async_over_sync_samples_per_s": default["ratio"],
        "best_async_over_sync": max(r["ratio"] for r in runs[1:]),
        "acc_sft": round(acc_sft, 4),
        "acc_sync": sync.get("acc"),
        "acc_async": default.get("acc"),
        "runs": [{k: v for k, v in r.items() if k != "checkpoint"} for r in runs],
    }
    if args.rows_out:
        model = args.model or task_model(args.task)
        plens, lengths = start_lengths(model, args.task, seed=args.seed)
        lengths_file = os.path.splitext(args.rows_out)[0] + "_lengths.json"
        with open(lengths_file, "w") as f:
            json.dump(lengths, f)
        rows = simulator_rows(args, runs, lengths_file, sum(plens) / len(plens))
        with open(args.rows_out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
        print(f"simulator rows: {args.rows_out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
