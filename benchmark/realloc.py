"""Parameter reallocation between layouts against one broadcast of as many bytes.

For a ~90M-parameter random qwen2-like model and each pair of layouts (``m2→d2``, ``p2→m2``,
``d2m2→p2m2``, and the one-to-many ``d1→d4`` and ``m2→d4``; both layouts on the same 4 gloo
processes, or NCCL on GPUs), every process holds its source shard (random values: only the
sizes matter), and the script times

- ``realloc``: :meth:`realhf.impl.model.parallelism.realloc_exec.RankPlan.run` of the pair's
  plan (planned and compiled beforehand, as the system caches them per pair), one-to-many
  messages sent as broadcasts;
- ``p2p``: the same plan compiled with ``broadcast=False`` (one message per receiver), only
  for pairs whose plan has broadcasts (else it is the same plan), its runs interleaved with
  those of ``realloc``;
- ``broadcast``: one ``dist.broadcast`` among the same 4 ranks of a flat buffer as large as
  the most any destination rank *writes* (receives plus copies locally) — the ReaL paper's
  yardstick: reallocation should cost about a broadcast of the parameters a rank needs.  A
  pair of local copies only is thus compared with a broadcast of as many bytes as it copies.

Each figure is the median of ``--repeats`` runs after one warm-up, on rank 0's clock after a
barrier.  Run (about 30 seconds on the 2-core CPU VM):

    python benchmark/realloc.py [--repeats 3]

The last line printed is one JSON object ``{"realloc_over_broadcast": {"m2->d2": ratio, ...},
"results": [{"pair", "layouts", "realloc_s", "p2p_s", "broadcast_s", "realloc_over_broadcast",
"broadcast_received_s", "max_written_mb", "max_received_mb"}, ...]}`` (``p2p_s``: null for a
plan without broadcasts; ``broadcast_received_s``: a broadcast of only the most any rank
receives, the yardstick of results before 2026-11-25; null when nothing is received).
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
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# short name -> (source layout, destination layout)
PAIRS = {
    "m2->d2": ("d1p1m2", "d2p1m1"),
    "p2->m2": ("d1p2m1", "d1p1m2"),
    "d2m2->p2m2": ("d2p1m2", "d1p2m2"),
    # one-to-many: every rank needs what rank 0 holds; each shard goes to three replicas
    "d1->d4": ("d1p1m1", "d4p1m1"),
    "m2->d4": ("d1p1m2", "d4p1m1"),
}
WORLD = 4
MODEL = dict(
    family="qwen2",
    n_layers=12,
    hidden_dim=640,
    n_q_heads=10,
    n_kv_heads=2,
    head_dim=64,
    intermediate_dim=2560,
    vocab_size=32000,
    n_positions=1024,
    use_attention_bias=True,
    tied_embedding=True,
)


def _rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from realhf.api.core.allocation import parse_parallelism
    from realhf.base import shutdown
    from realhf.impl.model.nn.model_config import ReaLModelConfig
    from realhf.impl.model.parallelism.realloc import plan_reallocation, rank_model
    from realhf.impl.model.parallelism.realloc_exec import compile_plan

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", args.rank % torch.cuda.device_count()) if cuda else "cpu"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=dist.FileStore(args.store, WORLD),
        rank=args.rank,
        world_size=WORLD,
        timeout=timedelta(seconds=900),
    )
    config = ReaLModelConfig(**MODEL)
    results = []

    def timed(*fns) -> list:
        """The median time of each of ``fns``, run in turn (interleaved: this VM's load
        drifts, and it should not favour whichever ran first)."""
        for fn in fns:
            fn()  # warm-up
        times = [[] for _ in fns]
        for _ in range(args.repeats):
            for fn, ts in zip(fns, times):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                ts.append(time.perf_counter() - t)
        return [statistics.median(ts) for ts in times]

    for name, (src, dst) in PAIRS.items():
        src_l, dst_l = parse_parallelism(src), parse_parallelism(dst)
        plan = plan_reallocation(config, src_l, dst_l)
        r = args.rank
        mine = compile_plan(plan, r)
        # Every rank compiles every rank's part, so all agree whether to time p2p-only.
        has_bcast = any(compile_plan(plan, q).broadcasts for q in range(WORLD))
        p2p = compile_plan(plan, r, broadcast=False)

        def numel(layout):
            if r >= layout.world_size:
                return None
            return rank_model(config, layout, r)[0].flat_params.numel()

        n_src, n_dst = numel(src_l), numel(dst_l)
        have = None if n_src is None else torch.randn(n_src, device=device)
        got = None if n_dst is None else torch.empty(n_dst, device=device)
        written, received = [0] * WORLD, [0] * WORLD
        for c in plan:
            written[c.dst] += c.length
            if c.src != c.dst:
                received[c.dst] += c.length
        flat = torch.empty(max(written), device=device)
        runs = [lambda: mine.run(have, got)] + ([lambda: p2p.run(have, got)] if has_bcast else [])
        t_realloc, t_p2p = (timed(*runs) + [None])[:2]
        (t_bcast,) = timed(lambda: dist.broadcast(flat, src=0))
        # The former yardstick (received bytes only), for comparison with older results.
        part = flat[: max(received)]
        t_bcast_in = timed(lambda: dist.broadcast(part, src=0))[0] if max(received) else None
        results.append(
            {
                "pair": name,
                "layouts": f"{src}->{dst}",
                "realloc_s": round(t_realloc, 4),
                "p2p_s": None if t_p2p is None else round(t_p2p, 4),
                "broadcast_s": round(t_bcast, 4),
                "realloc_over_broadcast": round(t_realloc / t_bcast, 3),
                "broadcast_received_s": None if t_bcast_in is None else round(t_bcast_in, 4),
                "max_written_mb": round(max(written) * 4 / 2**20, 1),
                "max_received_mb": round(max(received) * 4 / 2**20, 1),
            }
        )
    if args.rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    shutdown.hard_exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--result", default=None)
    args = p.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        common = ["--store", store, "--result", result, "--repeats", str(args.repeats)]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common])
            for r in range(WORLD)
        ]
        try:
            for proc in procs:
                if proc.wait(timeout=args.timeout) != 0:
                    raise SystemExit(f"a rank exited with code {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        with open(result) as f:
            results = json.load(f)
    print(
        f"{'pair':<12} {'layouts':<16} {'realloc s':>10} {'p2p s':>7} {'broadcast s':>12} "
        f"{'ratio':>7} {'MB written':>11} {'MB received':>12} {'bcast recv s':>13}"
    )
    for r in results:
        b_in, p2p = r["broadcast_received_s"], r["p2p_s"]
        print(
            f"{r['pair']:<12} {r['layouts']:<16} {r['realloc_s']:>10.3f} "
            f"{'-' if p2p is None else f'{p2p:.3f}':>7} "
            f"{r['broadcast_s']:>12.3f} {r['realloc_over_broadcast']:>7.2f} "
            f"{r['max_written_mb']:>11.1f} {r['max_received_mb']:>12.1f} "
            f"{'-' if b_in is None else f'{b_in:.3f}':>13}"
        )
    ratios = {r["pair"]: r["realloc_over_broadcast"] for r in results}
    print(json.dumps({"realloc_over_broadcast": ratios, "results": results}))


if __name__ == "__main__":
    main()
