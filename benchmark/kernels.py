"""Benchmark realhf's C++ kernels against Python baselines and the memcpy ceiling.

    python benchmark/kernels.py [--threads N] [--seed S] [--vs-torch-pieces N ...] [--rounds R]

In one process:

1. GAE over a packed batch of ~1M tokens in 4096 sequences of mixed lengths (uniform
   in [1, 512), half of them truncated/bootstrapped):
   * ours: `realhf.impl.kernels.gae_packed` (C++ `realhf._C`, sequences over threads);
   * loop: a per-sequence Python for-loop over t on Python floats (tensors converted
     with `.tolist()` once up front, which is the fastest form of that loop);
   * ref: the vectorised pure-PyTorch reference (`gae_packed_reference`).
2. Flat-buffer intervals: 16384 disjoint intervals (mixed sizes, shuffled order) that
   cover half of a 2^26-element buffer, for fp32 and bf16:
   * ours: `slice_intervals` / `set_intervals` into preallocated buffers;
   * loop: a Python loop of `tensor.copy_` over the intervals;
   * memcpy: one contiguous copy of the same number of bytes (the faster of
     `ctypes.memmove` and `Tensor.copy_`) as the bandwidth ceiling.

3. The fp32 slice at 256 .. 65536 pieces of the same total, against memmove: the cost
   per piece is what separates interval copies from one memcpy.
4. Against what torch already offers, on the same intervals (half of a 2^26 buffer cut
   into 256 .. 65536 shuffled pieces; fp32 and bf16), all writing into preallocated
   outputs and checked to give results identical to ours before any timing:
   * slice (gather): `torch.cat([buf[s:e] for s, e in intervals], out=)` (views built
     inside the timed call), `torch.index_select(buf, 0, idx, out=)` with an int64 and
     with an int32 element index, and `torch._foreach_copy_` over prebuilt views (private
     API; listed because it is torch's fused multi-copy), besides the Python loop;
   * set (scatter): `out.index_copy_(0, idx, src)` (int64 index: it accepts no other),
     a loop of `narrow().copy_()`, and `torch._foreach_copy_` over prebuilt views, besides
     the Python loop of `dst[s:e].copy_()`.
   The element index `idx` and the view lists are built once, outside the timed region;
   the index build time is printed on its own. Methods are timed in interleaved rounds
   (each round runs every method once; the Python-level loops, `torch.cat` included, in
   only the first 3) so that load changes hit them all alike; the figures are medians
   over rounds of the wall time and of the process CPU time (all threads). The ratio is
   the best torch op's time over ours (> 1: ours is faster).

Prints the figures and, as its last line, one JSON object with `gae_speedup_vs_loop`,
`slice_bw_fraction` and `set_bw_fraction` (fp32) among others, and under `vs_torch` one
record per case of section 4. Targets: GAE >= 50x the loop; interval ops >= 50% of memcpy
bandwidth and faster than every torch op. Timings are medians of repeated runs; on a
shared machine they are noisy, so the load average is printed with them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np
import torch

from realhf.impl import kernels as K


def _median_time(fn, repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_gae(rng: np.random.Generator) -> dict:
    n_seqs = 4096
    lens = torch.from_numpy(rng.integers(1, 512, size=n_seqs))
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    T = int(lens.sum())
    rewards = torch.from_numpy(rng.standard_normal(T).astype(np.float32))
    values = torch.from_numpy(rng.standard_normal(T + n_seqs).astype(np.float32))
    boot = torch.from_numpy(rng.random(n_seqs) < 0.5)
    args = (rewards, values, cu, boot, 0.99, 0.95)

    ours = _median_time(lambda: K.gae_packed(*args), repeat=20, warmup=3)
    ref = _median_time(lambda: K.gae_packed_reference(*args), repeat=5)
    loop = _median_time(lambda: K.gae_packed_naive(*args), repeat=3, warmup=0)
    # The three agree (the loop runs in float64, hence the tolerance).
    for a, b, c in zip(
        K.gae_packed(*args), K.gae_packed_reference(*args), K.gae_packed_naive(*args)
    ):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    print(f"GAE: {n_seqs} sequences, {T} tokens (backend {K.backend('cpu')})")
    print(f"  ours (C++)            {ours * 1e3:9.2f} ms   {T / ours / 1e6:8.1f} Mtok/s")
    print(f"  vectorised reference  {ref * 1e3:9.2f} ms   {ref / ours:8.1f}x slower than ours")
    print(f"  per-sequence loop     {loop * 1e3:9.2f} ms   {loop / ours:8.1f}x slower than ours")
    return {
        "gae_tokens": T,
        "gae_ms": ours * 1e3,
        "gae_ref_ms": ref * 1e3,
        "gae_loop_ms": loop * 1e3,
        "gae_speedup_vs_loop": loop / ours,
        "gae_speedup_vs_ref": ref / ours,
    }


def _disjoint_intervals(rng, size: int, n: int) -> np.ndarray:
    """n disjoint intervals of mixed sizes covering about half of [0, size), shuffled."""
    cuts = np.sort(rng.choice(np.arange(1, size), size=2 * n - 1, replace=False))
    bounds = np.concatenate([[0], cuts, [size]])
    iv = np.stack([bounds[0:-1:2], bounds[1::2]], 1)
    return iv[rng.permutation(n)]


def bench_intervals(rng: np.random.Generator, dtype: torch.dtype) -> dict:
    size, n = 1 << 26, 16384
    src = torch.randn(size, dtype=torch.float32).to(dtype)
    iv = _disjoint_intervals(rng, size, n)
    iv_t = torch.from_numpy(iv)
    iv_list = iv.tolist()
    total = int((iv[:, 1] - iv[:, 0]).sum())
    nbytes = total * src.element_size()
    packed = torch.empty(total, dtype=dtype)
    dst = torch.empty_like(src)
    dst.zero_()  # touch every page once, outside the timings

    def loop_slice():
        o = 0
        for s, e in iv_list:
            packed[o : o + e - s].copy_(src[s:e])
            o += e - s

    def loop_set():
        o = 0
        for s, e in iv_list:
            dst[s:e].copy_(packed[o : o + e - s])
            o += e - s

    ours_slice = _median_time(lambda: K.slice_intervals(src, iv_t, out=packed), repeat=10)
    assert torch.equal(packed, K.slice_intervals_reference(src, iv_t))
    ours_set = _median_time(lambda: K.set_intervals(packed, dst, iv_t), repeat=10)
    assert torch.equal(K.slice_intervals(dst, iv_t), packed)
    py_slice = _median_time(loop_slice, repeat=3)
    py_set = _median_time(loop_set, repeat=3)
    contiguous = src[:total]
    memmove = _median_time(
        lambda: ctypes.memmove(packed.data_ptr(), contiguous.data_ptr(), nbytes), repeat=10
    )
    copy_ = _median_time(lambda: packed.copy_(contiguous), repeat=10)
    ceiling = min(memmove, copy_)
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    name = str(dtype).removeprefix("torch.")
    print(f"Intervals ({name}): {n} intervals, {total} elements = {nbytes / 2**20:.0f} MiB moved")
    print(
        f"  memcpy ceiling        {ceiling * 1e3:9.2f} ms   {gbps(ceiling):6.2f} GB/s "
        f"(memmove {gbps(memmove):.2f}, Tensor.copy_ {gbps(copy_):.2f})"
    )
    for label, ours, py in (("slice", ours_slice, py_slice), ("set", ours_set, py_set)):
        print(
            f"  {label:5s} ours          {ours * 1e3:9.2f} ms   {gbps(ours):6.2f} GB/s "
            f"= {ceiling / ours:5.1%} of memcpy"
        )
        print(
            f"  {label:5s} Python loop   {py * 1e3:9.2f} ms   {gbps(py):6.2f} GB/s "
            f"({py / ours:.1f}x slower than ours)"
        )
    return {
        f"{name}_slice_bw_fraction": ceiling / ours_slice,
        f"{name}_set_bw_fraction": ceiling / ours_set,
        f"{name}_slice_speedup_vs_loop": py_slice / ours_slice,
        f"{name}_set_speedup_vs_loop": py_set / ours_set,
        f"{name}_memcpy_gbps": gbps(ceiling),
    }


def bench_piece_sizes(rng: np.random.Generator) -> dict:
    """Slice bandwidth (fp32) as a function of the number of pieces of the same total."""
    size = 1 << 26
    src = torch.randn(size)
    out = {}
    print("Slice vs piece size (fp32, half of a 2^26 buffer, shuffled pieces):")
    for n in (256, 4096, 16384, 65536):
        iv = torch.from_numpy(_disjoint_intervals(rng, size, n))
        total = int((iv[:, 1] - iv[:, 0]).sum())
        packed = torch.empty(total)
        ours = _median_time(lambda: K.slice_intervals(src, iv, out=packed), repeat=10)
        ceiling = _median_time(
            lambda: ctypes.memmove(packed.data_ptr(), src.data_ptr(), total * 4), repeat=10
        )
        kib = total * 4 / n / 1024
        print(f"  {n:6d} pieces (mean {kib:7.1f} KiB): {ceiling / ours:6.1%} of memcpy")
        out[f"slice_bw_fraction_{n}_pieces"] = ceiling / ours
    return out


def _interleaved_times(fns: dict, rounds: int, slow=(), slow_rounds: int = 3) -> dict:
    """{name: (median wall s, median process CPU s)}, running every fn once per round.

    One warm-up round first; the Python loops (names in `slow`) skip it and run only in
    the first `slow_rounds` rounds, to keep the default run short.
    """
    for name, fn in fns.items():
        if name not in slow:
            fn()
    samples = {name: ([], []) for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            if name in slow and r >= slow_rounds:
                continue
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), time.process_time()
            samples[name][0].append(t1 - t0)
            samples[name][1].append(c1 - c0)
    return {n: (statistics.median(w), statistics.median(c)) for n, (w, c) in samples.items()}


def _element_index(iv: torch.Tensor, total: int) -> torch.Tensor:
    """int64 index of every element of the intervals, in packed order (vectorised)."""
    lens = iv[:, 1] - iv[:, 0]
    offsets = lens.cumsum(0) - lens
    shift = torch.repeat_interleave(iv[:, 0] - offsets, lens, output_size=total)
    return shift.add_(torch.arange(total, dtype=torch.int64))


_KEYS = {
    "ours": "ours",
    "torch.cat": "cat",
    "index_select i64": "index_select_i64",
    "index_select i32": "index_select_i32",
    "index_copy_": "index_copy",
    "narrow().copy_ loop": "narrow_loop",
    "_foreach_copy_": "foreach_copy",
    "Python loop": "py_loop",
}


# Python-level loops over the intervals: timed in at most 3 rounds (see _interleaved_times).
_SLOW = ("torch.cat", "narrow().copy_ loop", "Python loop")


def bench_vs_torch(rng: np.random.Generator, dtype: torch.dtype, pieces, rounds: int) -> list:
    """Section 4: slice/set kernels against torch's own ops on the same intervals."""
    size = 1 << 26
    src = torch.randn(size, dtype=torch.float32).to(dtype)
    dst = torch.zeros_like(src)
    print(
        f"Ours vs torch ops ({str(dtype).removeprefix('torch.')}, half of a 2^26 buffer, "
        f"shuffled pieces; {rounds} interleaved rounds (Python loops 3), median; "
        "ms wall / ms CPU of all threads):"
    )
    return [_vs_torch_case(src, dst, _disjoint_intervals(rng, size, n), rounds) for n in pieces]


def _vs_torch_case(src: torch.Tensor, dst: torch.Tensor, iv_np: np.ndarray, rounds: int) -> dict:
    """One case of section 4: verify every baseline against ours, then time them all."""
    n = len(iv_np)
    iv = torch.from_numpy(iv_np)
    iv_list = iv_np.tolist()
    total = int((iv[:, 1] - iv[:, 0]).sum())
    nbytes = total * src.element_size()
    packed = torch.empty(total, dtype=src.dtype)
    # Built once, outside the timed region.
    t0 = time.perf_counter()
    idx = _element_index(iv, total)
    idx_build = time.perf_counter() - t0
    idx32 = idx.to(torch.int32)
    offs = np.concatenate([[0], np.cumsum(iv_np[:, 1] - iv_np[:, 0])]).tolist()
    src_views = [src[s:e] for s, e in iv_list]
    dst_views = [dst[s:e] for s, e in iv_list]
    packed_views = [packed[offs[i] : offs[i + 1]] for i in range(n)]

    def py_loop_slice():
        o = 0
        for s, e in iv_list:
            packed[o : o + e - s].copy_(src[s:e])
            o += e - s

    def py_loop_set():
        o = 0
        for s, e in iv_list:
            dst[s:e].copy_(packed[o : o + e - s])
            o += e - s

    def narrow_set():
        o = 0
        for s, e in iv_list:
            dst.narrow(0, s, e - s).copy_(packed.narrow(0, o, e - s))
            o += e - s

    gather = {
        "ours": lambda: K.slice_intervals(src, iv, out=packed),
        "torch.cat": lambda: torch.cat([src[s:e] for s, e in iv_list], out=packed),
        "index_select i64": lambda: torch.index_select(src, 0, idx, out=packed),
        "index_select i32": lambda: torch.index_select(src, 0, idx32, out=packed),
        "_foreach_copy_": lambda: torch._foreach_copy_(packed_views, src_views),
        "Python loop": py_loop_slice,
    }
    scatter = {
        "ours": lambda: K.set_intervals(packed, dst, iv),
        "index_copy_": lambda: dst.index_copy_(0, idx, packed),
        "narrow().copy_ loop": narrow_set,
        "_foreach_copy_": lambda: torch._foreach_copy_(dst_views, packed_views),
        "Python loop": py_loop_set,
    }
    # Every baseline must give exactly our result before anything is timed.
    want = K.slice_intervals(src, iv)
    assert torch.equal(want, K.slice_intervals_reference(src, iv))
    for label, fn in gather.items():
        packed.zero_()
        fn()
        assert torch.equal(packed, want), f"slice {label} differs from ours"
    dst.zero_()
    want_dst = K.set_intervals(want, dst, iv).clone()
    packed.copy_(want)
    for label, fn in scatter.items():
        dst.zero_()
        fn()
        assert torch.equal(dst, want_dst), f"set {label} differs from ours"
    del want, want_dst

    kib = nbytes / n / 1024
    rec = {
        "dtype": str(src.dtype).removeprefix("torch."),
        "pieces": n,
        "mean_piece_kib": round(kib, 2),
        "index_build_ms": round(idx_build * 1e3, 3),
    }
    print(
        f"  {n} pieces (mean {kib:.1f} KiB), {nbytes / 2**20:.0f} MiB moved; "
        f"int64 index ({total * 8 / 2**20:.0f} MiB) built in {idx_build * 1e3:.0f} ms"
    )
    for op, fns in (("slice", gather), ("set", scatter)):
        times = _interleaved_times(fns, rounds, slow=_SLOW)
        ours_w, ours_c = times["ours"]
        best = min((t[0], label) for label, t in times.items() if label != "ours")
        parts = [f"{label} {w * 1e3:.2f}/{c * 1e3:.2f}" for label, (w, c) in times.items()]
        print(f"    {op:5s} " + ", ".join(parts))
        line = (
            f"    {op:5s} ours {ours_w * 1e3:.2f} ms ({nbytes / ours_w / 1e9:.2f} GB/s); "
            f"best torch: {best[1]} {best[0] * 1e3:.2f} ms -> ours {best[0] / ours_w:.2f}x"
        )
        if best[1].startswith("index"):
            line += f" ({(best[0] + idx_build) / ours_w:.1f}x counting the index build)"
        print(line)
        for label, (w, _) in times.items():
            rec[f"{op}_{_KEYS[label]}_ms"] = round(w * 1e3, 3)
        rec[f"{op}_ours_cpu_ms"] = round(ours_c * 1e3, 3)
        rec[f"{op}_best_torch_op"] = best[1]
        rec[f"{op}_best_torch_ms"] = round(best[0] * 1e3, 3)
        rec[f"{op}_best_torch_cpu_ms"] = round(times[best[1]][1] * 1e3, 3)
        rec[f"{op}_speedup_vs_best_torch"] = round(best[0] / ours_w, 3)
    return rec


def _print_vs_torch_summary(records: list) -> None:
    print(
        "Summary: ours vs the best torch op, wall ms (ratio = best torch / ours; > 1: ours faster)"
    )
    head = f"{'ours':>8s} {'best torch op':>17s} {'ms':>8s} {'ratio':>6s}"
    print(f"  {'dtype':8s} {'pieces':>6s} {'KiB':>6s} | slice {head} | set {head}")
    for r in records:
        cols = [
            f"{r[f'{op}_ours_ms']:8.2f} {r[f'{op}_best_torch_op']:>17s} "
            f"{r[f'{op}_best_torch_ms']:8.2f} {r[f'{op}_speedup_vs_best_torch']:5.2f}x"
            for op in ("slice", "set")
        ]
        print(
            f"  {r['dtype']:8s} {r['pieces']:6d} {r['mean_piece_kib']:6.1f} | "
            f"      {cols[0]} |     {cols[1]}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vs-torch-pieces",
        type=int,
        nargs="+",
        default=[256, 4096, 16384, 65536],
        help="interval counts for the comparison with torch ops (section 4)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds per method in section 4"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    result = {"threads": torch.get_num_threads(), "backend": K.backend("cpu")}
    result.update(bench_gae(rng))
    for dtype in (torch.float32, torch.bfloat16):
        result.update(bench_intervals(rng, dtype))
    result.update(bench_piece_sizes(rng))
    records = []
    for dtype in (torch.float32, torch.bfloat16):
        records += bench_vs_torch(rng, dtype, pieces=args.vs_torch_pieces, rounds=args.rounds)
    _print_vs_torch_summary(records)
    result["vs_torch"] = records
    for op in ("slice", "set"):
        result[f"{op}_speedup_vs_best_torch_min"] = min(
            r[f"{op}_speedup_vs_best_torch"] for r in records
        )
    result["slice_bw_fraction"] = result["float32_slice_bw_fraction"]
    result["set_bw_fraction"] = result["float32_set_bw_fraction"]
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
