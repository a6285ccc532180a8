"""Train-step throughput of every parallel layout, and the share of it spent communicating.

For each layout (``d1p1m1`` … ``d1p2m2``, up to 4 processes) and each model — the embedded
tiny model's architecture and a ~50M-parameter random model — the script starts one process
per rank (gloo on CPU, nccl on GPUs), builds the layout with the engines the model workers use
(``ParallelGrid``, ``load_model``, ``TrainEngine``), and times ``--steps`` optimizer steps on
the same global batch of random tokens (after one warm-up step).

tokens/s = tokens of the global batch / mean step seconds (rank 0's clock).
comm share = seconds spent inside torch.distributed calls (all-reduce, all-gather, broadcast,
point-to-point; waiting included) / step seconds, on rank 0 — with several ranks on few
cores, waiting for a slower peer counts as communication.

No speed target on a 2-core CPU: 4 ranks share 2 cores and gloo is slow, so the figures show
how the layouts compare and what each costs in communication, which tells a GPU run what
to expect.  Run (about 3 minutes on the 2-core CPU VM):

    python benchmark/parallel.py [--steps 3 --tokens 512]

The last line printed is one JSON object: ``{"results": [{"model", "layout",
"tokens_per_s", "comm_share", "step_s"}, ...]}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = ["d1p1m1", "d2p1m1", "d1p1m2", "d1p2m1", "d2p1m2", "d2p2m1", "d1p2m2"]
# A ~50M-parameter qwen2-like model (tied 32k vocabulary: 16.8M in the embedding).
MEDIUM = dict(
    family="qwen2",
    n_layers=10,
    hidden_dim=512,
    n_q_heads=8,
    n_kv_heads=4,
    head_dim=64,
    intermediate_dim=1536,
    vocab_size=32768,
    n_positions=1024,
    use_attention_bias=True,
    tied_embedding=True,
)


# ---- rank process -----------------------------------------------------------------------


class _CommClock:
    """Wall seconds spent inside torch.distributed calls (patched module functions)."""

    NAMES = (
        "all_reduce",
        "all_gather",
        "broadcast",
        "send",
        "recv",
        "broadcast_object_list",
        "gather_object",
        "all_gather_object",
    )

    def __init__(self):
        import torch.distributed as dist

        self.seconds = 0.0
        for name in self.NAMES:
            setattr(dist, name, self._timed(getattr(dist, name)))
        batch = self._timed(dist.batch_isend_irecv)
        clock = self

        class TimedWork:  # a point-to-point work whose wait() is timed (waited once only)
            def __init__(self, work):
                self.work = work

            def wait(self, *args):
                t = time.perf_counter()
                try:
                    return self.work.wait(*args)
                finally:
                    clock.seconds += time.perf_counter() - t

        dist.batch_isend_irecv = lambda ops: [TimedWork(w) for w in batch(ops)]

    def _timed(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        return run


def _model_dir(kind: str, out: str) -> str:
    """An HF directory with the model's weights (random for ``medium``)."""
    import torch

    from realhf.experiments.building_blocks import TINY_MODEL
    from realhf.impl.model import ReaLModel, ReaLModelConfig

    if kind == "tiny":
        return TINY_MODEL
    path = os.path.join(out, "medium")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        ReaLModel(ReaLModelConfig(**MEDIUM)).save_hf(path)
    return path


def _rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from realhf.api.cli_args import OptimizerConfig
    from realhf.api.core.allocation import parse_parallelism
    from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
    from realhf.base import shutdown
    from realhf.impl.model.backend import TrainEngine
    from realhf.impl.model.parallelism import ParallelGrid, load_model
    from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", args.rank % torch.cuda.device_count()) if cuda else "cpu"
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=600),
    )
    layout = parse_parallelism(args.layout)
    grid = ParallelGrid.create(layout)
    model = load_model(args.model_dir, grid, device=device)
    engine = TrainEngine(model, OptimizerConfig(lr=1e-5), grid=grid)
    tp = model.tp
    # The global batch: sequences of 64 tokens; each replica trains its share.
    n_seqs = args.tokens // 64
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (n_seqs * 64,), generator=g)
    full = SequenceSample.from_default(
        ids=[f"s{i}" for i in range(n_seqs)], seqlens=[64] * n_seqs, data={"packed_input_ids": ids}
    )
    per = n_seqs // layout.data
    mine = full.select_items(list(range(grid.dp_rank * per, (grid.dp_rank + 1) * per)))
    spec = MicroBatchSpec(max_tokens_per_mb=args.mb_tokens)

    def loss_fn(logits, mb):
        lp = gather_packed_shifted_log_probs(
            logits, mb.cu_seqlens("packed_input_ids"), mb.data["packed_input_ids"], tp=tp
        )
        return -lp.mean(), {}

    def weight(mb):
        return sum(n - 1 for n in mb.flat_seqlens("packed_input_ids"))

    engine.train_batch(mine, spec, loss_fn, weight)  # warm-up
    clock = _CommClock()
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        clock.seconds = 0.0
        t = time.perf_counter()
        engine.train_batch(mine, spec, loss_fn, weight)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t, clock.seconds))
    if args.rank == 0:
        step = sum(t for t, _ in times) / len(times)
        comm = sum(c for _, c in times) / len(times)
        with open(args.result, "w") as f:
            json.dump({"step_s": step, "comm_s": comm, "tokens": n_seqs * 64}, f)
    dist.destroy_process_group()
    shutdown.hard_exit(0)


# ---- driver -----------------------------------------------------------------------------


def _run_layout(model_dir: str, layout: str, args, tmp: str) -> dict:
    from realhf.api.core.allocation import parse_parallelism

    world = parse_parallelism(layout).world_size
    store = os.path.join(tmp, f"store-{layout}-{time.monotonic_ns()}")
    result = os.path.join(tmp, f"result-{layout}.json")
    common = [
        "--layout",
        layout,
        "--model-dir",
        model_dir,
        "--store",
        store,
        "--result",
        result,
        "--world",
        str(world),
        "--steps",
        str(args.steps),
        "--tokens",
        str(args.tokens),
        "--mb-tokens",
        str(args.mb_tokens),
    ]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common])
        for r in range(world)
    ]
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"layout {layout}: a rank exited with code {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(result) as f:
        r = json.load(f)
    return {
        "layout": layout,
        "step_s": round(r["step_s"], 4),
        "tokens_per_s": round(r["tokens"] / r["step_s"], 1),
        "comm_share": round(r["comm_s"] / r["step_s"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    p.add_argument("--tokens", type=int, default=512, help="tokens of the global batch")
    p.add_argument("--mb-tokens", type=int, default=256, help="max tokens per micro-batch")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--models", default="tiny,medium")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per layout")
    # rank-process arguments
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--layout", default=None)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--result", default=None)
    args = p.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'model':<8} {'layout':<8} {'step s':>8} {'tokens/s':>10} {'comm share':>11}")
        for kind in args.models.split(","):
            model_dir = _model_dir(kind, tmp)
            for layout in args.layouts.split(","):
                r = {"model": kind, **_run_layout(model_dir, layout, args, tmp)}
                results.append(r)
                print(
                    f"{kind:<8} {layout:<8} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.1f} "
                    f"{r['comm_share']:>11.1%}",
                    flush=True,
                )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
