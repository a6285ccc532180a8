"""A decode step's float32 products alone: realhf's decode kernel (``realhf._C.decode_linear``,
``csrc/decode_linear_simd.h``) against oneDNN's packed product and ``F.linear``, in GB/s of
weights read, at several row counts (running sequences).

    python benchmark/decode_linear.py [--rows 1,4,8,16,24,32,64] [--mb 600] [--threads N]
                                      [--rounds 3] [--dtype float32]

The matrices are the 0.5B shape's MLP (``[9728, 896]`` gate/up and ``[896, 4864]`` down),
``--mb`` of them so that every weight comes from memory, as in a decode step.  Each round
runs every product once over all the matrices, in turn, so a VM's slow minutes hit them
alike; the best round counts.  The read bandwidth (a sum over 1 GiB) is measured in the same
process.  The last line is one JSON object: the host (CPU model and flags), and per row
count, GB/s of each product and ``kernel_over_onednn``.  (``--dtype bfloat16`` times oneDNN
and ``F.linear`` only: the kernel is float32; bf16 products keep oneDNN's AMX or AVX-512
kernels.)

On the 2-core Xeon (AMX) VM of 2026-12-02, float32, GB/s kernel / oneDNN / F.linear: 1 row
29.3 / 25.0 / 27.8, 16 rows 18.1 / 16.0 / 9.0, 32 rows 10.7 / 11.1 / 7.7, 64 rows 5.4 / 7.2 /
5.2 (``benchmark/results/scale.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark.scale import host_facts, read_bandwidth  # noqa: E402
from realhf.impl.kernels import simd_cpu  # noqa: E402
from realhf.impl.model.nn.packed_linear import pack_blocks  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,16,24,32,64", help="row counts, comma-separated")
    p.add_argument("--mb", type=float, default=600.0, help="MB of weight matrices")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes whole numbers separated by commas, got {args.rows!r}")
    if not args.rows or min(args.rows) < 1:
        p.error("--rows must be >= 1")
    if args.mb <= 0 or args.rounds < 1 or args.threads < 1:
        p.error("--mb must be > 0, --rounds and --threads >= 1")
    return args


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ext = simd_cpu() if dtype == torch.float32 else None
    onednn = torch.backends.mkldnn.is_available()
    pair = (9728 + 4864) * 896 * torch.finfo(dtype).bits // 8
    shapes = [(9728, 896), (896, 4864)] * max(1, round(args.mb * 1e6 / pair))
    ws = [torch.randn(n, k).to(dtype) for n, k in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    blocks = [pack_blocks(w, None)[0] for w in ws] if ext is not None else None
    bandwidth = read_bandwidth(args.threads)
    print(
        f"{len(ws)} {args.dtype} matrices, {nbytes / 1e6:.0f} MB; {args.threads} threads; "
        f"read {bandwidth / 1e9:.1f} GB/s; kernel {'ran' if ext else 'not run'} "
        f"({'realhf._C ' + (ext.simd_isa() or '') if ext else 'no AVX2/AVX-512 build or bf16'})",
        flush=True,
    )
    out = {"host": host_facts(), "dtype": args.dtype, "threads": args.threads,
           "mb": nbytes / 1e6, "read_gbs": bandwidth / 1e9, "rows": {}}  # fmt: skip
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k).to(dtype) for k in (896, 4864)}
            cases = {"F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws]}
            if onednn:
                packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
                cases["onednn"] = lambda: [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(ws, packed)
                ]
            if ext is not None:
                cases["kernel"] = lambda: [
                    ext.decode_linear(xs[w.shape[1]], b, None, w.shape[0])
                    for w, b in zip(ws, blocks)
                ]
            best = {k: float("inf") for k in cases}
            for _ in range(args.rounds + 1):  # (the first round warms up)
                for k, fn in cases.items():
                    best[k] = min(best[k], _timed(fn))
            gbs = {k: nbytes / t / 1e9 for k, t in best.items()}
            rec = dict(gbs)
            if "kernel" in gbs and "onednn" in gbs:
                rec["kernel_over_onednn"] = gbs["kernel"] / gbs["onednn"]
            out["rows"][m] = rec
            print(f"{m:4d} rows: GB/s " + ", ".join(f"{k} {v:.1f}" for k, v in gbs.items()),
                  flush=True)  # fmt: skip
            if onednn:
                del packed
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
