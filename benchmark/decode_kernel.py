"""The CPU decode-attention kernels alone (the C++ one, each build the CPU runs, and the
numba one, side by side): their time per cached position and layer, split into what
reading the cache costs and what their arithmetic costs.

    python benchmark/decode_kernel.py [--seqs 256] [--positions 72] [--dtype float32]
                                      [--q-heads 4 --kv-heads 2 --head-dim 64] [--threads 1]
                                      [--page 16] [--impls cpp/avx2,numba]

Defaults: the embedded tiny model's attention (4 query / 2 kv heads of 64) at the
vs-vLLM benchmark's 256 running sequences, lengths drawn from [positions/2, positions],
4 layers, pages of 16 positions (the engine's ``PAGE_SIZE``), one thread (as the server
runs it).  In one process, timed in interleaved rounds (each round runs every case once, so
a VM's slow minutes hit them all alike), medians and minimums over the rounds:

Each kernel (``--impls``: by default every one that can run here: ``cpp/avx512`` and
``cpp/avx2``, the C++ kernel's builds, on AVX-512 CPUs, ``cpp/avx2`` on AVX2 ones, and
``numba``) is timed on three layouts of the same cache:

- ``scattered``: every sequence's pages lie anywhere in a pool twice the size needed (as
  in a long-running server): the kernel as it runs;
- ``contiguous``: each sequence's pages follow one another, and the sequences' runs one
  another, as the engine's lowest-first allocator lays out a batch admitted at once;
- ``resident``: every sequence reads the same few pages, which stay in L1/L2: the kernel's
  arithmetic (and per-call overhead) with almost no memory traffic;
- ``read``: a numba loop that only reads (sums) the same keys and values as ``scattered``,
  in the same page order, with the same prefetch: what reading the cache alone costs.

If a kernel hid all its memory traffic behind its arithmetic, ``scattered`` would be
``max(resident, read)``; ``scattered / (resident + read)`` near 1 says the two do not
overlap.  The last line is one JSON object with the figures (ns per position and layer),
per kernel, and ``numba_over_cpp`` (scattered pages; the widest C++ build that ran) when
both ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numba
import numpy as np
import torch

from realhf.impl.kernels import simd_isas
from realhf.impl.model.gen import cache_attention as ca
from realhf.impl.model.gen.kv_cache import PAGE_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 4


@numba.njit(fastmath=True, nogil=True, cache=True)
def _read_only(kc, vc, table, lens, page):  # pragma: no cover - timed, not tested
    """Sum every cached key and value the kernel reads, sequence by sequence, page by page,
    prefetching the next page as the kernel does."""
    s = np.float32(0.0)
    for b in range(lens.shape[0]):
        hi = lens[b]
        n_pages = (hi + page - 1) // page
        for pool in (kc, vc):
            for pg in range(n_pages):
                if pg + 1 < n_pages:
                    ca._prefetch_page(pool, table, b, pg + 1, 0, hi, page)
                start, end = ca._page_rows(table, b, pg, 0, hi, page)
                for r in range(start, end):
                    for h in range(pool.shape[1]):
                        for x in range(pool.shape[2]):
                            s += pool[r, h, x]
    return s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--positions", type=int, default=72, help="longest sequence")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--page", type=int, default=PAGE_SIZE, help="positions per page")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--impls",
        default=None,
        help="comma-separated kernels to time (cpp/avx512, cpp/avx2, numba); default: those "
        "that can run",
    )
    args = p.parse_args(argv)
    available = [f"cpp/{isa}" for isa in simd_isas()]
    available += ["numba"] if ca.numba_available() else []
    args.impls = args.impls.split(",") if args.impls else available
    for name in args.impls:
        if name not in available:
            p.error(f"--impls: {name!r} cannot run here; these can: {available}")
    if not args.impls:
        p.error("no CPU decode kernel can run here (install numba, or build realhf._C)")
    for name in ("seqs", "positions", "page", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    B, L, nkv, d, page = args.seqs, args.positions, args.kv_heads, args.head_dim, args.page
    rng = np.random.default_rng(args.seed)
    lens = [int(x) for x in rng.integers(max(1, L // 2), L + 1, B)]
    per_seq = (L + page - 1) // page
    n_pages = 2 * B * per_seq
    scattered = torch.from_numpy(rng.permutation(n_pages)[: B * per_seq].reshape(B, per_seq))
    contiguous = torch.arange(B * per_seq).view(B, per_seq)
    resident = torch.arange(per_seq).repeat(B, 1)
    g = torch.Generator().manual_seed(args.seed)
    pools = [
        [torch.randn(n_pages * page, nkv, d, generator=g).to(dtype) for _ in range(2)]
        for _ in range(LAYERS)
    ]
    q = torch.randn(B, args.q_heads, d, generator=g)
    k, v = (torch.randn(B, nkv, d, generator=g).to(dtype) for _ in range(2))
    lens_np = np.asarray(lens, dtype=np.int64)

    def attention(impl, table):
        name, _, isa = impl.partition("/")
        return ca.DecodeAttention(
            table, lens, page_size=page, sliding_window=None, impl=name, isa=isa
        )

    def kernel(impl, table):
        def run():
            att = attention(impl, table)
            for kc, vc in pools:
                att(q, k, v, kc, vc)

        return run

    def read():
        for kc, vc in pools:
            _read_only(ca._bits(kc), ca._bits(vc), scattered.numpy(), lens_np, page)

    # Each kernel against SDPA over the same cache, once, before any timing.
    ref = ca.DecodeAttention(scattered, lens, page_size=page, sliding_window=None, impl="padded")
    kc, vc = pools[0]
    want = ref(q.to(dtype), k, v, kc.clone(), vc.clone())
    errs = {}
    for impl in args.impls:
        a = attention(impl, scattered)(q, k, v, kc.clone(), vc.clone())
        errs[impl] = err = float((a.float() - want.float()).abs().max())
        if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
            sys.exit(f"the {impl} kernel differs from SDPA by {err:.3g}: not timing a wrong kernel")

    layouts = {"scattered": scattered, "contiguous": contiguous, "resident": resident}
    cases = {
        f"{impl} {name}": kernel(impl, t) for impl in args.impls for name, t in layouts.items()
    }
    cases["read"] = read
    for run in cases.values():  # compile (or load numba's cache) and warm up
        run()
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    per = sum(lens) * LAYERS
    ns = {
        name: {"median": statistics.median(ts) / per * 1e9, "min": min(ts) / per * 1e9}
        for name, ts in times.items()
    }
    sys.path.insert(0, ROOT)
    from benchmark.scale import host_facts

    bytes_per = 2 * nkv * d * (2 if dtype == torch.bfloat16 else 4)
    print(
        f"decode kernels, {args.dtype}, {B} sequences of {min(lens)}-{max(lens)} positions, "
        f"{args.q_heads}/{nkv} heads of {d}, {LAYERS} layers, pages of {page}, "
        f"{args.threads} thread(s)"
    )
    print(f"{'case':>18}  {'median':>8}  {'min':>8}  ns per position and layer")
    for name, f in ns.items():
        print(f"{name:>18}  {f['median']:8.1f}  {f['min']:8.1f}")
    read_med = ns["read"]["median"]
    per_impl = {}
    for impl in args.impls:
        med = {name: ns[f"{impl} {name}"]["median"] for name in layouts}
        per_impl[impl] = {
            "max_abs_err_vs_sdpa": errs[impl],
            "ns_per_position_layer": {name: ns[f"{impl} {name}"] for name in layouts},
            "scattered_over_sum": med["scattered"] / (med["resident"] + read_med),
            "scattered_over_max": med["scattered"] / max(med["resident"], read_med),
        }
        print(
            f"{impl}: scattered / (resident + read) {per_impl[impl]['scattered_over_sum']:.2f}, "
            f"/ max(resident, read) {per_impl[impl]['scattered_over_max']:.2f}"
        )
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "host": host_facts(),
        "dtype": args.dtype,
        "seqs": B,
        "positions": [min(lens), max(lens)],
        "heads": [args.q_heads, nkv, d],
        "threads": args.threads,
        "page": page,
        "rounds": args.rounds,
        "impls": per_impl,
        "read_ns_per_position_layer": ns["read"],
        "read_gb_per_s": bytes_per / read_med,
        "load_average": list(os.getloadavg()[:2]),
    }
    cpp = [i for i in per_impl if i.startswith("cpp/")]
    if cpp and "numba" in per_impl:
        scat = {i: per_impl[i]["ns_per_position_layer"]["scattered"]["median"] for i in per_impl}
        out["numba_over_cpp"] = scat["numba"] / scat[cpp[0]]
        print(f"numba / {cpp[0]} on scattered pages: {out['numba_over_cpp']:.2f}")
    print(f"reading alone: {out['read_gb_per_s']:.1f} GB/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
