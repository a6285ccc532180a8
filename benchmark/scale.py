"""Real model shapes on this machine: memory against the floor, time against the peaks.

For each model shape (a random model of a released model's shape written by
``python -m realhf.apps.make_model``, or the embedded tiny model as the reference) and
each mode (sync ``ppo-math``, ``async-ppo-math``, ``sft``), one short quickstart run, and:

- **memory**: the peak RSS of every worker process (``VmHWM``, polled from ``/proc``)
  against what :mod:`realhf.apps.memory_plan` says it must hold (weights, gradients,
  optimizer state, activations, logits, KV cache and the runtime): ``rss_over_floor``;
- **time**: the step split from the run's ``trace.json`` (generation, inference, training;
  in async runs the trainer's training and weight publication);
- **training FLOP/s** (``6 x matmul parameters x trained tokens`` plus attention) against
  this host's matmul peak, measured in this process in the run's dtype and threads:
  ``train_flops_over_peak``;
- **decode bytes/s** (weights and KV cache read per decode step, sync runs) against this
  host's memory read bandwidth measured here: ``decode_over_roofline``.

Run (the tiny model only: ~2 minutes; the 0.5B shape: ~5 minutes per mode on 2 cores)::

    python benchmark/scale.py --shapes tiny,qwen2.5-0.5b --modes sync,sft
    python benchmark/scale.py --shapes qwen2.5-0.5b --modes sync --scales 1,2,4

The 0.5B-class shapes are made once under ``--models-dir`` (~1 GB each in bf16).  A table
per run, then one JSON line with every figure and the host's CPU model and flags.
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

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from realhf.api.cli_parser import parse_config  # noqa: E402
from realhf.apps import memory_plan, quickstart  # noqa: E402
from realhf.experiments.registry import get_quickstart_exp  # noqa: E402

EXPERIMENTS = {"sync": "ppo-math", "async": "async-ppo-math", "sft": "sft"}
#: the trace events (MFC names) of each part of a step
PARTS = {
    "generation": ("actor_gen",),
    "inference": ("rew_inf", "ref_inf", "actor_inf", "critic_inf"),
    "training": ("actor_train", "critic_train", "trainDefault"),
}
GiB = 1024**3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,qwen2.5-0.5b")
    p.add_argument("--modes", default="sync,async,sft")
    p.add_argument("--scales", default="1", help="tokens per step x N (batch size x N)")
    p.add_argument("--steps", type=int, default=2, help="steps per run (the last is timed)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step at scale 1")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--answer-len", type=int, default=64, help="max_new_tokens; sft answers")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=0,
        help="prompts of this many tokens (a written dataset); 0: the embedded task's (~10)",
    )
    p.add_argument(
        "--dtypes",
        "--dtype",
        default="float32",
        help="the roles' dtype; several (float32,bfloat16): each run per dtype, and the step "
        "time of bf16 over fp32 (bf16_step_over_fp32)",
    )
    p.add_argument(
        "--lora-ranks",
        default="0",
        help="the trained role's LoRA rank; several (0,16): each run per rank, 0 = full "
        "fine-tuning, and the peak RSS of LoRA over full (lora_peak_over_full)",
    )
    p.add_argument("--extra", default="", help="more key=value overrides, space separated")
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/realhf/shapes"))
    p.add_argument("--timeout", type=float, default=1800)
    return p.parse_args()


# ---- this host's peaks ---------------------------------------------------------------


def host_facts() -> dict:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    keep = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "flags": keep,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def matmul_peak(dtype: torch.dtype, threads: int) -> float:
    """FLOP/s of the best of several (2048 x 896) @ (896 x 4864) products (a 0.5B MLP)."""
    torch.set_num_threads(threads)
    a = torch.randn(2048, 896, dtype=dtype)
    w = torch.randn(4864, 896, dtype=dtype)
    torch.nn.functional.linear(a, w)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 * 896 * 4864 / best


def decode_matmul_rate(dtype: torch.dtype, threads: int, rows: int) -> float:
    """Weight bytes/s of the product a decode step runs: ``rows`` running sequences times
    0.5B-MLP-shaped matrices packed as the generation engine packs them, ~600 MB of them
    so that every weight comes from memory, as in a step.  Decoding cannot read its
    weights faster than this whatever else it does; where this is below the read
    bandwidth, the products are bound by arithmetic, not by memory (``decode_over_roofline``
    then cannot reach 1)."""
    from realhf.impl.model.nn.packed_linear import PackedLinear, packing_supported

    torch.set_num_threads(threads)
    packed = packing_supported(dtype, torch.device("cpu"))
    pair_bytes = (9728 + 4864) * 896 * torch.finfo(dtype).bits // 8  # gate_up + down
    shapes = [(9728, 896), (896, 4864)] * max(1, int(600e6 // pair_bytes))
    mats = []
    for out_dim, in_dim in shapes:
        w = torch.randn(out_dim, in_dim, dtype=dtype)
        mats.append((PackedLinear([w], None, rows) if packed else None, w, in_dim))
    xs = {d: torch.randn(rows, d, dtype=dtype) for d in (896, 4864)}
    nbytes = sum(w.numel() * w.element_size() for _, w, _ in mats)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            t = time.perf_counter()
            for pk, w, d in mats:
                pk(xs[d]) if pk is not None else torch.nn.functional.linear(xs[d], w)
            best = min(best, time.perf_counter() - t)
    return nbytes / best


def read_bandwidth(threads: int) -> float:
    """Bytes/s of summing a 1 GiB tensor (reading memory, as decoding reads weights)."""
    torch.set_num_threads(threads)
    x = torch.ones(GiB // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


# ---- one run -------------------------------------------------------------------------


class PeakWatcher(threading.Thread):
    """Polls ``VmHWM`` of the run's worker processes (by the trial on their command line)."""

    def __init__(self, trial: str, interval: float = 0.25):
        super().__init__(daemon=True)
        self.trial, self.interval = trial, interval
        self.peaks: Dict[str, int] = {}
        #: ``key -> [(unix time, RSS bytes), ...]``: where in the step the memory goes
        self.samples: Dict[str, List[Tuple[float, int]]] = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            for status in glob.glob("/proc/[0-9]*/status"):
                pid_dir = os.path.dirname(status)
                try:
                    # Forked workers set their title: one string with spaces, not NUL-split.
                    with open(os.path.join(pid_dir, "cmdline"), "rb") as f:
                        args = f.read().replace(b"\0", b" ").decode(errors="replace").split()
                    if self.trial not in args or "--type" not in args:
                        continue
                    kind = args[args.index("--type") + 1]
                    index = args[args.index("--index") + 1]
                    with open(status) as f:
                        fields = dict(l.split(":", 1) for l in f if l.startswith("Vm"))
                    hwm = int(fields["VmHWM"].split()[0]) * 1024
                    rss = int(fields["VmRSS"].split()[0]) * 1024
                except (OSError, KeyError, ValueError, IndexError):
                    continue
                key = f"{kind}/{index}"
                self.peaks[key] = max(self.peaks.get(key, 0), hwm)
                self.samples.setdefault(key, []).append((time.time(), rss))
            self.done.wait(self.interval)


def model_dir(shape: str, models_dir: str) -> str:
    if shape == "tiny":
        from realhf.experiments.building_blocks import TINY_MODEL

        return TINY_MODEL
    path = os.path.join(models_dir, shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"making the {shape} shape in {path} (once)", flush=True)
        subprocess.run(
            [sys.executable, "-m", "realhf.apps.make_model", "--shape", shape, path], check=True
        )
    return path


def write_data(args, workdir: str) -> Dict[str, str]:
    """Math prompts of ``--prompt-len`` tokens (and sft answers of ``--answer-len``) of the
    embedded tokenizer: arithmetic after filler text, so the reward can still be checked."""
    from realhf.experiments.building_blocks import TINY_MODEL, load_tokenizer

    tok = load_tokenizer(TINY_MODEL)

    def text(n: int, tail: str = "") -> str:
        ids = tok("1+2=3. " * n, add_special_tokens=False)["input_ids"]
        need = n - len(tok(tail, add_special_tokens=False)["input_ids"])
        return tok.decode(ids[: max(0, need)]) + tail

    paths = {"math": os.path.join(workdir, "math.jsonl"), "sft": os.path.join(workdir, "sft.jsonl")}
    with open(paths["math"], "w") as m, open(paths["sft"], "w") as f:
        for i in range(256):
            a, b = 10 + i % 90, 3 + i % 7
            q = text(args.prompt_len, f" Compute {a}+{b}.")
            m.write(
                json.dumps({"query_id": str(i), "prompt": q, "solutions": [f"\\boxed{{{a + b}}}"]})
                + "\n"
            )
            answer = text(args.answer_len - 6, f" \\boxed{{{a + b}}}")
            f.write(json.dumps({"id": str(i), "prompt": q, "answer": answer}) + "\n")
    return paths


def run_args(
    args, mode: str, path: str, scale: int, data: Dict[str, str], dtype: str, lora: int = 0
) -> List[str]:
    role = "model" if mode == "sft" else "actor"
    out = [
        f"{role}.path={path}",
        f"{role}.dtype={dtype}",
        f"{role}.lora.rank={lora}",
        f"train_batch_size={args.batch * scale * (args.group_size if mode == 'sft' else 1)}",
        f"exp_ctrl.benchmark_steps={args.steps}",
    ]
    if mode != "sft":
        out += [
            f"ppo.group_size={args.group_size}",
            f"ppo.gen.max_new_tokens={args.answer_len}",
            "eval=false",
        ]
    if data:
        out.append(f"dataset.path={data['sft' if mode == 'sft' else 'math']}")
        if mode != "sft":
            out.append(f"dataset.max_prompt_len={args.prompt_len + 16}")
    return out + args.extra.split()


def one_run(
    args, shape: str, mode: str, scale: int, workdir: str, data, dtype: str, lora: int = 0
) -> dict:
    path = model_dir(shape, args.models_dir)
    name = EXPERIMENTS[mode]
    trial = f"scale-{shape}-{mode}-x{scale}-{dtype}-r{lora}".replace(".", "_")
    overrides = run_args(args, mode, path, scale, data, dtype, lora)
    overrides += [f"fileroot={workdir}", f"trial_name={trial}"]
    qs = get_quickstart_exp(name)
    cfg = parse_config(qs.config_cls, overrides)
    # What quickstart will do: the memory options the config leaves empty are chosen first
    # (micro-batch token budget, gradient checkpointing), so the estimate is of that run.
    experiment, chosen = memory_plan.choose_unset(cfg, qs.build)
    est_list = memory_plan.estimate(cfg, experiment)
    for note in chosen:
        print(f"{shape} {mode} {dtype}: {note}", flush=True)
    estimates = {e.kind: e for e in est_list}
    need, available = memory_plan.host_total(est_list), memory_plan.available_memory()
    if need > available:  # the run would be refused: say which terms do not fit instead
        return {
            "shape": shape,
            "mode": mode,
            "scale": scale,
            "dtype": dtype,
            "lora_rank": lora,
            "fits": False,
            "need_gib": need / GiB,
            "available_gib": available / GiB,
            "largest_terms": _largest_terms(est_list),
        }

    watcher = PeakWatcher(trial)
    watcher.start()
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "realhf.apps.quickstart", name, *overrides],
        capture_output=True,
        text=True,
        timeout=args.timeout,
        cwd=workdir,
    )
    wall = time.monotonic() - t0
    watcher.done.set()
    watcher.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    run_dir = os.path.join(workdir, name, trial)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "trace.json")) as f:
        trace = json.load(f)
    last = metrics[-1]
    split = step_split(trace, last["step"], last)

    phases = phase_peaks(trace, watcher.samples)
    memory = {}
    for key, peak in sorted(watcher.peaks.items()):
        est = estimates.get(key.split("/")[0])
        if est is None or est.kind not in ("model_worker", "generation_server"):
            continue
        floor = est.total
        memory[key] = {
            "peak_gib": peak / GiB,
            "floor_gib": floor / GiB,
            "over": peak / floor,
            "estimate_gib": {t: v / GiB for t, v in est.terms.items() if v},
            "sampled_peak_gib_by_call": phases.get(key, {}),
        }
    shape_info = memory_plan.Shape.of(path)
    tokens = float(last.get("tokens", 0))
    return {
        "shape": shape,
        "mode": mode,
        "scale": scale,
        "dtype": dtype,
        "lora_rank": lora,
        "wall_s": wall,
        "step_s": float(last.get("time", 0.0)),
        "split_s": split,
        "tokens": tokens,
        "memory": memory,
        "params": shape_info.n_params,
        "shape_info": shape_info,
        "cfg": cfg,
        "last": last,
    }


def _largest_terms(estimates, n: int = 3) -> List[str]:
    """The ``n`` largest terms over all processes, as ``"model_worker x2: optimizer 8.63 GiB"``
    (GiB per process): what to cut for a run that does not fit."""
    terms = [
        (v * e.count, f"{e.kind} x{e.count}: {t} {v / GiB:.2f} GiB")
        for e in estimates
        for t, v in e.terms.items()
    ]
    return [label for _, label in sorted(terms, reverse=True)[:n]]


def step_split(trace, step: int, last: dict) -> Dict[str, float]:
    """Seconds of each part of the step from the trace (``timing/*`` metrics as fallback)."""
    spans = [e for e in trace if e.get("ph") == "X"]
    steps = [e for e in spans if e["name"] == f"step {step}"]
    out: Dict[str, float] = {}
    if steps:
        s = steps[0]
        inside = [e for e in spans if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        for part, names in PARTS.items():
            out[part] = sum(e["dur"] for e in inside if e["name"] in names) / 1e6
    for k, v in last.items():
        if k.startswith("timing/") and k[7:] not in sum(PARTS.values(), ()):
            out[k[7:]] = float(v)
    published = [float(v) for k, v in last.items() if k.endswith("weights/publish_s")]
    if published:
        out["publication"] = sum(published)
    return {k: v for k, v in out.items() if v > 0}


def phase_peaks(trace, samples) -> Dict[str, Dict[str, float]]:
    """The highest sampled RSS (GiB) of each worker during each kind of call of the trace
    (its ``ts`` are microseconds of the Unix clock) and outside any call."""
    spans = [e for e in trace if e.get("ph") == "X" and not e["name"].startswith("step ")]
    out: Dict[str, Dict[str, float]] = {}
    for key, points in samples.items():
        best: Dict[str, float] = {}
        for t, rss in points:
            us = t * 1e6
            names = [e["name"] for e in spans if e["ts"] <= us <= e["ts"] + e["dur"]] or ["other"]
            for name in names:
                best[name] = max(best.get(name, 0.0), rss / GiB)
        out[key] = best
    return out


def train_flops(r: dict) -> Optional[float]:
    """FLOPs of the step's training: 6 x matmul parameters x tokens (x sample reuse) plus
    causal attention (``6 x 2 x L x q_dim x T x mean_ctx``)."""
    s = r["shape_info"]
    tokens = r["tokens"]
    if not tokens:
        return None
    # Tied or not, each parameter matrix is one matmul (a tied embedding's lookup is free,
    # its head product counted once); an untied embedding's lookup is counted too (~V x h
    # of extra FLOPs, a few % at these shapes).
    matmul_params = s.n_params
    reuse = getattr(getattr(r["cfg"], "ppo", None), "sample_reuse", 1) or 1
    seq = r["last"].get("actor_train/ppo/seq_len") or 128
    attn = 6 * 2 * s.n_layers * s.hidden * tokens * seq / 2
    return (6 * matmul_params * tokens + attn) * reuse


def decode_bytes_per_s(r: dict, args) -> Optional[float]:
    """Bytes the decode steps of the generation read per second: the weights once per step
    and each running sequence's KV cache."""
    gen = r["split_s"].get("generation")
    if not gen:
        return None
    s = r["shape_info"]
    b = memory_plan.DTYPE_BYTES[r["dtype"]]
    n_seqs = args.batch * r["scale"] * args.group_size
    steps = args.answer_len
    weights = s.n_params * b * steps
    kv_per_token = 2 * s.n_layers * s.kv_dim * b
    kv = n_seqs * kv_per_token * steps * steps / 2  # the cache grows by a token per step
    return (weights + kv) / gen


def main():
    args = parse_args()
    quickstart._load_experiments()
    threads = os.cpu_count() or 1
    dtypes = args.dtypes.split(",")
    facts = host_facts()
    peaks = {d: matmul_peak(getattr(torch, d), threads) for d in dtypes}
    bandwidth = read_bandwidth(threads)
    n_decode = args.batch * args.group_size  # running sequences at scale 1
    decode_mm = {d: decode_matmul_rate(getattr(torch, d), threads, n_decode) for d in dtypes}
    matmul = ", ".join(f"{d} {p / 1e9:.0f}" for d, p in peaks.items())
    dmm = ", ".join(f"{d} {p / 1e9:.1f}" for d, p in decode_mm.items())
    print(
        f"host: {facts['cpu']}, {facts['cores']} cores, {facts['torch_cpu_capability']}; "
        f"matmul GFLOP/s {matmul}; read {bandwidth / 1e9:.1f} GB/s; decode products at "
        f"{n_decode} rows read weights at GB/s {dmm}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="realhf-scale-") as workdir:
        data = write_data(args, workdir) if args.prompt_len else {}
        for shape in args.shapes.split(","):
            for mode in args.modes.split(","):
                for scale, dtype, lora in [
                    (sc, d, int(lr))
                    for sc in [int(x) for x in args.scales.split(",")]
                    for d in dtypes
                    for lr in args.lora_ranks.split(",")
                ]:
                    # The neighbours of a VM move its peaks: measured again before each
                    # run, and every ratio is against the best seen in the whole script.
                    peaks[dtype] = max(peaks[dtype], matmul_peak(getattr(torch, dtype), threads))
                    bandwidth = max(bandwidth, read_bandwidth(threads))
                    r = one_run(args, shape, mode, scale, workdir, data, dtype, lora)
                    if r.get("fits") is False:
                        results.append(r)
                        print(
                            f"\n{shape} {mode} x{scale} {dtype} r{lora}: does not fit, "
                            f"nothing started: {r['need_gib']:.1f} GiB of "
                            f"{r['available_gib']:.1f} available; largest: "
                            f"{'; '.join(r['largest_terms'])}",
                            flush=True,
                        )
                        continue
                    # (6 x parameters counts full training; LoRA's is not comparable)
                    fl = train_flops(r) if mode != "async" and not lora else None
                    t_train = r["split_s"].get("training")
                    r["train_flops"] = fl / t_train if fl and t_train else None
                    r["decode_bytes_per_s"] = (
                        decode_bytes_per_s(r, args) if mode == "sync" else None
                    )
                    r["tokens_per_train_s"] = r["tokens"] / t_train if t_train else None
                    _ratios(r, peaks, bandwidth)
                    results.append(r)
                    report(r)
    not_fit = [r for r in results if r.get("fits") is False]
    results = [r for r in results if r.get("fits") is not False]
    matmul = ", ".join(f"{d} {p / 1e9:.0f}" for d, p in peaks.items())
    print(f"\nbest seen: matmul GFLOP/s {matmul}; read {bandwidth / 1e9:.1f} GB/s", flush=True)
    for r in results:
        _ratios(r, peaks, bandwidth)
    rows = [{k: v for k, v in r.items() if k not in ("shape_info", "cfg", "last")} for r in results]
    worst = {}
    for r in results:
        over = max((m["over"] for m in r["memory"].values()), default=None)
        if over is not None:
            key = r["mode"]
            worst[key] = max(worst.get(key, 0.0), over)
    flops = [r["train_flops_over_peak"] for r in results if r["train_flops_over_peak"]]
    decode = [r["decode_over_roofline"] for r in results if r["decode_over_roofline"]]
    # The same run in bf16 and fp32 (this script, this host, one after the other).
    step = {
        (r["shape"], r["mode"], r["scale"], r["dtype"]): r["step_s"]
        for r in results
        if not r["lora_rank"]
    }
    bf16_over_fp32 = {
        f"{sh}/{mo}/x{sc}": t / step[(sh, mo, sc, "float32")]
        for (sh, mo, sc, d), t in step.items()
        if d == "bfloat16" and step.get((sh, mo, sc, "float32"))
    }
    # The trainer's peak RSS with LoRA over full fine-tuning (None: full did not fit).
    trainer_peak = {
        (r["shape"], r["mode"], r["scale"], r["dtype"], r["lora_rank"]): max(
            (m["peak_gib"] for k, m in r["memory"].items() if k.startswith("model_worker")),
            default=None,
        )
        for r in results
    }
    lora_peak = {
        f"{sh}/{mo}/x{sc}/{d}/r{lr}": {
            "peak_gib": p,
            "full_peak_gib": trainer_peak.get((sh, mo, sc, d, 0)),
            "over_full": p / trainer_peak[(sh, mo, sc, d, 0)]
            if p and trainer_peak.get((sh, mo, sc, d, 0))
            else None,
        }
        for (sh, mo, sc, d, lr), p in trainer_peak.items()
        if lr
    }
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "host": facts,
                "dtypes": dtypes,
                "matmul_peak_gflops": {d: p / 1e9 for d, p in peaks.items()},
                "read_bandwidth_gbs": bandwidth / 1e9,
                # what decode_over_roofline could reach if nothing but the products ran
                "decode_matmul_over_bandwidth": {d: p / bandwidth for d, p in decode_mm.items()},
                "rss_over_floor": worst,
                "train_flops_over_peak": min(flops) if flops else None,
                "decode_over_roofline": min(decode) if decode else None,
                "bf16_step_over_fp32": bf16_over_fp32,
                "lora_peak_over_full": lora_peak,
                "does_not_fit": not_fit,
                "runs": rows,
            },
            default=str,
        )
    )


def _ratios(r: dict, peaks: Dict[str, float], bandwidth: float) -> None:
    """Train FLOP/s over the dtype's matmul peak and decode bytes/s over read bandwidth."""
    fl, db = r.get("train_flops"), r.get("decode_bytes_per_s")
    r["train_flops_over_peak"] = fl / peaks[r["dtype"]] if fl else None
    r["decode_over_roofline"] = db / bandwidth if db else None


def report(r: dict) -> None:
    split = ", ".join(f"{k} {v:.1f}s" for k, v in r["split_s"].items())
    print(
        f"\n{r['shape']} {r['mode']} x{r['scale']} {r['dtype']} r{r['lora_rank']}: "
        f"step {r['step_s']:.1f}s ({split}); {r['tokens']:.0f} tokens",
        flush=True,
    )
    for key, m in r["memory"].items():
        print(
            f"  {key:22s} peak {m['peak_gib']:6.2f} GiB  floor {m['floor_gib']:6.2f} GiB  "
            f"x{m['over']:.2f}"
        )
        calls = ", ".join(f"{k} {v:.2f}" for k, v in m["sampled_peak_gib_by_call"].items())
        print(f"  {'':22s} sampled RSS peaks (GiB): {calls}")
    for k in ("train_flops_over_peak", "decode_over_roofline"):
        if r.get(k):
            print(f"  {k}: {r[k]:.2f}")


if __name__ == "__main__":
    main()
