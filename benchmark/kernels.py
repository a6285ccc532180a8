"""Benchmark realhf's C++ kernels against Python baselines and the memcpy ceiling.

    python benchmark/kernels.py [--threads N] [--seed S]

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

Prints the figures and, as its last line, one JSON object with `gae_speedup_vs_loop`,
`slice_bw_fraction` and `set_bw_fraction` (fp32) among others. Targets: GAE >= 50x the
loop; interval ops >= 50% of memcpy bandwidth. Timings are medians of repeated runs;
on a shared machine they are noisy, so the load average is printed with them.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
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
    result["slice_bw_fraction"] = result["float32_slice_bw_fraction"]
    result["set_bw_fraction"] = result["float32_set_bw_fraction"]
    result["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
