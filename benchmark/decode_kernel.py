"""The numba decode-attention kernel alone: its time per cached position and layer, split
into what reading the cache costs and what its arithmetic costs.

    python benchmark/decode_kernel.py [--seqs 256] [--positions 72] [--dtype float32]
                                      [--q-heads 4 --kv-heads 2 --head-dim 64] [--threads 1]
                                      [--page 16]

Defaults: the embedded tiny model's attention (4 query / 2 kv heads of 64) at the
vs-vLLM benchmark's 256 running sequences, lengths drawn from [positions/2, positions],
4 layers, pages of 16 positions (the engine's ``PAGE_SIZE``), one thread (as the server
runs it).  In one process, timed in interleaved rounds (each round runs every case once, so
a VM's slow minutes hit them all alike), medians and minimums over the rounds:

- ``scattered``: every sequence's pages lie anywhere in a pool twice the size needed (as
  in a long-running server): the kernel as it runs;
- ``contiguous``: each sequence's pages follow one another, and the sequences' runs one
  another, as the engine's lowest-first allocator lays out a batch admitted at once;
- ``resident``: every sequence reads the same few pages, which stay in L1/L2: the kernel's
  arithmetic (and per-call overhead) with almost no memory traffic;
- ``read``: a numba loop that only reads (sums) the same keys and values as ``scattered``,
  in the same page order, with the same prefetch: what reading the cache alone costs.

If the kernel hid all its memory traffic behind its arithmetic, ``scattered`` would be
``max(resident, read)``; ``scattered / (resident + read)`` near 1 says the two do not
overlap.  The last line is one JSON object with the figures (ns per position and layer).
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
    args = p.parse_args(argv)
    for name in ("seqs", "positions", "page", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not ca.numba_available():
        sys.exit("numba is not installed: the decode kernel is numba's (pip install numba)")
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

    def kernel(table):
        def run():
            att = ca.DecodeAttention(table, lens, page_size=page, sliding_window=None, impl="numba")
            for kc, vc in pools:
                att(q, k, v, kc, vc)

        return run

    def read():
        for kc, vc in pools:
            _read_only(ca._bits(kc), ca._bits(vc), scattered.numpy(), lens_np, page)

    # The kernel against SDPA over the same cache, once, before any timing.
    got = ca.DecodeAttention(scattered, lens, page_size=page, sliding_window=None, impl="numba")
    ref = ca.DecodeAttention(scattered, lens, page_size=page, sliding_window=None, impl="padded")
    kc, vc = pools[0]
    a = got(q, k, v, kc.clone(), vc.clone())
    b = ref(q.to(dtype), k, v, kc.clone(), vc.clone())
    err = float((a.float() - b.float()).abs().max())
    if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
        sys.exit(f"the kernel differs from SDPA by {err:.3g}: not timing a wrong kernel")

    cases = {
        "scattered": kernel(scattered),
        "contiguous": kernel(contiguous),
        "resident": kernel(resident),
        "read": read,
    }
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
        f"decode kernel, {args.dtype}, {B} sequences of {min(lens)}-{max(lens)} positions, "
        f"{args.q_heads}/{nkv} heads of {d}, {LAYERS} layers, pages of {page}, "
        f"{args.threads} thread(s)"
    )
    print(f"{'case':>10}  {'median':>8}  {'min':>8}  ns per position and layer")
    for name, f in ns.items():
        print(f"{name:>10}  {f['median']:8.1f}  {f['min']:8.1f}")
    med = {name: f["median"] for name, f in ns.items()}
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
        "max_abs_err_vs_sdpa": err,
        "ns_per_position_layer": ns,
        "read_gb_per_s": bytes_per / med["read"],
        "scattered_over_sum": med["scattered"] / (med["resident"] + med["read"]),
        "scattered_over_max": med["scattered"] / max(med["resident"], med["read"]),
        "load_average": list(os.getloadavg()[:2]),
    }
    print(
        f"reading alone: {out['read_gb_per_s']:.1f} GB/s; scattered / (resident + read) "
        f"{out['scattered_over_sum']:.2f}, / max(resident, read) {out['scattered_over_max']:.2f}"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
