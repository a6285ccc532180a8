"""Decode/prefill attention against the paged cache, checked against plain softmax attention."""

import contextlib
import math

import pytest
import torch

from realhf.impl.kernels import simd_isas
from realhf.impl.model.gen.cache_attention import (
    DecodeAttention,
    PrefillAttention,
    cpp_available,
    numba_available,
    prefill_attention,
    select_decode_impl,
)
from realhf.impl.model.gen.kv_cache import PagedKVCache, pages_for

N_Q, N_KV, D = 4, 2, 16


def _ref_attn(q, k, v, window=None):
    """q [n_q, d] for the last position; k, v [n_kv, L, d]."""
    g = q.shape[0] // k.shape[0]
    L = k.shape[1]
    lo = 0 if window is None else max(0, L - window)
    kk = k[:, lo:].repeat_interleave(g, 0)
    vv = v[:, lo:].repeat_interleave(g, 0)
    w = torch.softmax((q[:, None, :] * kk).sum(-1) / math.sqrt(q.shape[-1]), -1)
    return (w[..., None] * vv).sum(1)


def _impls():
    # "numba/1": the numba kernel built for one thread (its serial driver); "numba": on
    # numba's default threads, the parallel one where there is more than one; "cpp/ISA":
    # the C++ kernel's build for ISA, each this CPU runs (AVX-512 CPUs run both)
    return (
        ["padded"]
        + (["numba", "numba/1"] if numba_available() else [])
        + [f"cpp/{isa}" for isa in simd_isas()]
    )


@contextlib.contextmanager
def _numba_threads(n):
    """numba's thread count set to ``n`` for a while (a DecodeAttention picks its driver
    when it is made)."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(before)


@contextlib.contextmanager
def _threads_of(impl):
    """The impl name DecodeAttention takes for ``impl``, under ``impl``'s thread count."""
    if impl != "numba/1":
        yield "numba" if impl.startswith("numba") else impl
        return
    with _numba_threads(1):
        yield "numba"


def _decode_attention(tables, lens, *, page_size, sliding_window, impl):
    if impl.startswith("cpp/"):
        return DecodeAttention(
            tables,
            lens,
            page_size=page_size,
            sliding_window=sliding_window,
            impl="cpp",
            isa=impl.split("/")[1],
        )
    with _threads_of(impl) as name:
        return DecodeAttention(
            tables, lens, page_size=page_size, sliding_window=sliding_window, impl=name
        )


def _cache(n_tokens=128, page_size=4, n_layers=2, dtype=torch.float32):
    return PagedKVCache(
        n_layers=n_layers,
        n_kv_heads=N_KV,
        head_dim=D,
        n_tokens=n_tokens,
        page_size=page_size,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def _positions(cache, table, n, layer):
    """[n_kv, n, d] keys and values of a sequence's first n positions (reference gather)."""
    rows = torch.tensor(cache.rows(table, 0, n))
    return cache.k[layer, rows].transpose(0, 1), cache.v[layer, rows].transpose(0, 1)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("window", [None, 5])
def test_decode_follows_scattered_page_tables(impl, window):
    torch.manual_seed(0)
    cache = _cache()
    cache.k.normal_()
    cache.v.normal_()
    # Tables out of order, of different lengths, and two sequences sharing their first
    # page (a group's prompt); every last position is on a page of the sequence's own.
    tables = [[7, 2, 30], [7, 13], [11, 3, 20, 5, 0, 9]]
    lens = [9, 6, 21]
    q = torch.randn(3, N_Q, D)
    k_new, v_new = torch.randn(3, N_KV, D), torch.randn(3, N_KV, D)
    attn = _decode_attention(tables, lens, page_size=4, sliding_window=window, impl=impl)
    out = attn(q, k_new, v_new, cache.k[1], cache.v[1])
    for b in range(3):  # the new key/value landed at position lens - 1
        (row,) = cache.rows(tables[b], lens[b] - 1, lens[b])
        torch.testing.assert_close(cache.k[1, row], k_new[b])
        torch.testing.assert_close(cache.v[1, row], v_new[b])
    for b in range(3):
        k, v = _positions(cache, tables[b], lens[b], 1)
        ref = _ref_attn(q[b], k, v, window)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("window", [None, 5])
def test_a_bfloat16_cache_is_read_in_place_and_attended_in_float32(impl, window):
    """bf16 cache and activations: the new key/value is stored rounded to bf16, and the
    output is float32 attention over the bf16 values, rounded to bf16 once (the numba
    kernel widens rows as it reads them; SDPA runs on the gathered bf16 rows)."""
    torch.manual_seed(2)
    cache = _cache(dtype=torch.bfloat16)
    cache.k.normal_()
    cache.v.normal_()
    tables = [[7, 2, 30], [7, 13], [11, 3, 20, 5, 0, 9]]
    lens = [9, 6, 21]
    q = torch.randn(3, N_Q, D, dtype=torch.bfloat16)
    k_new = torch.randn(3, N_KV, D, dtype=torch.bfloat16)
    v_new = torch.randn(3, N_KV, D, dtype=torch.bfloat16)
    attn = _decode_attention(tables, lens, page_size=4, sliding_window=window, impl=impl)
    out = attn(q, k_new, v_new, cache.k[0], cache.v[0])
    assert out.dtype == torch.bfloat16
    for b in range(3):
        (row,) = cache.rows(tables[b], lens[b] - 1, lens[b])
        assert torch.equal(cache.k[0, row], k_new[b]) and torch.equal(cache.v[0, row], v_new[b])
        k, v = _positions(cache, tables[b], lens[b], 0)
        ref = _ref_attn(q[b].float(), k.float(), v.float(), window)
        # one bf16 rounding of the output (8 bits of mantissa: 2^-8 relative)
        torch.testing.assert_close(out[b].float(), ref, atol=2e-3, rtol=2**-8)


@pytest.mark.parametrize("impl", _impls())
def test_decode_one_page_per_sequence_equals_contiguous_attention(impl):
    torch.manual_seed(1)
    cache = _cache(n_tokens=64, page_size=16, n_layers=1)
    cache.k.normal_()
    cache.v.normal_()
    tables, lens = [[0], [1], [2], [3]], [3, 16, 1, 7]
    q = torch.randn(4, N_Q, D)
    k_new = torch.stack([cache.k[0, 16 * b + n - 1] for b, n in enumerate(lens)]).clone()
    v_new = torch.stack([cache.v[0, 16 * b + n - 1] for b, n in enumerate(lens)]).clone()
    attn = _decode_attention(tables, lens, page_size=16, sliding_window=None, impl=impl)
    out = attn(q, k_new, v_new, cache.k[0], cache.v[0])
    for b, n in enumerate(lens):
        kk = cache.k[0, 16 * b : 16 * b + n].transpose(0, 1)
        vv = cache.v[0, 16 * b : 16 * b + n].transpose(0, 1)
        torch.testing.assert_close(out[b], _ref_attn(q[b], kk, vv), atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_one_thread_runs_the_serial_driver_and_more_run_the_parallel_one():
    """The engine's one-thread servers get the serial build of the kernel (numba's
    parallel build, loaded from its cache, ran ~20% slower on one thread); both read the
    same per-sequence code, so both give the reference's answer."""
    import numba

    from realhf.impl.model.gen import cache_attention as ca

    torch.manual_seed(3)
    tables = [[7, 2, 30], [7, 13], [11, 3, 20, 5, 0, 9]]
    lens = [9, 6, 21]
    q = torch.randn(3, N_Q, D)
    k_new, v_new = torch.randn(3, N_KV, D), torch.randn(3, N_KV, D)
    outs = {}
    for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
        with _numba_threads(threads):
            attn = DecodeAttention(tables, lens, page_size=4, sliding_window=None, impl="numba")
        serial = threads == 1
        assert attn._kernel is (ca._decode_kernel_serial if serial else ca._decode_kernel)
        cache = _cache()
        torch.manual_seed(4)
        cache.k.normal_()
        cache.v.normal_()
        outs[threads] = attn(q, k_new, v_new, cache.k[0], cache.v[0])
        for b in range(3):
            k, v = _positions(cache, tables[b], lens[b], 0)
            torch.testing.assert_close(
                outs[threads][b], _ref_attn(q[b], k, v), atol=1e-5, rtol=1e-4
            )
    if len(outs) == 2:
        torch.testing.assert_close(outs[1], outs[2], atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_the_kernels_exp_matches_libm_over_the_softmax_range():
    import numpy as np

    from realhf.impl.model.gen.cache_attention import _exp_split

    xs = np.concatenate([np.linspace(-87, 0, 20001), [-1e-7, -0.3466, -0.3467, -86.99]])
    got = []
    for x in xs.astype(np.float32):
        mant, bits = _exp_split(x)
        got.append(mant * np.array([bits], dtype=np.int32).view(np.float32)[0])
    rel = np.abs(np.array(got, dtype=np.float64) / np.exp(xs.astype(np.float32)) - 1)
    assert rel.max() < 3e-7, (rel.max(), xs[rel.argmax()])
    assert _exp_split(np.float32(0.0)) == (1.0, 127 << 23)  # the row max weighs exactly 1
    mant, bits = _exp_split(np.float32(-1000.0))  # clamped at -87, still a normal float
    assert 0 < mant * np.array([bits], dtype=np.int32).view(np.float32)[0] < 2e-38


def test_select_decode_impl():
    cpu32 = torch.empty(8, N_KV, 64)
    kernel = "numba" if numba_available() else "padded"
    assert select_decode_impl(cpu32, "auto") == ("cpp" if cpp_available() else kernel)
    assert select_decode_impl(cpu32.bfloat16(), "auto") == select_decode_impl(cpu32, "auto")
    assert select_decode_impl(cpu32.half(), "auto") == "padded"
    # a head size the C++ kernel does not take falls to numba
    assert select_decode_impl(torch.empty(8, N_KV, 72), "auto") == kernel
    with pytest.raises(ValueError, match="unknown"):
        select_decode_impl(cpu32, "flash")
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU"):
        select_decode_impl(cpu32.half(), "numba")
    with pytest.raises(ValueError, match="'cpp' cannot run: .*(head size 72|AVX2|not built)"):
        select_decode_impl(torch.empty(8, N_KV, 72), "cpp")
    with pytest.raises(
        ValueError, match="'cpp' cannot run: .*(float32 or bfloat16|AVX2|not built)"
    ):
        select_decode_impl(cpu32.half(), "cpp")


@pytest.mark.skipif(
    not cpp_available(), reason="this CPU has neither AVX2 nor AVX-512, or realhf._C not built"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_q, n_kv, d, window",
    [(14, 2, 64, None), (14, 2, 64, 37), (12, 2, 128, None), (6, 2, 80, 20), (8, 1, 256, None)],
)
def test_the_cpp_kernel_equals_numba_at_real_head_shapes(dtype, n_q, n_kv, d, window):
    """The C++ kernel, each build this CPU runs, against the numba one (and the
    reference) at the shapes of real models: 7 and 6 query heads per kv head (register
    blocks of up to 4 query heads, and the rest), head sizes 64, 80, 128 and 256,
    sequences of 1-70 positions (score blocks of 16 or 8 that cross page ends, and a
    shorter last block), windows, on one thread and on two."""
    torch.manual_seed(5)
    page = 8
    lens = [1, 16, 17, 33, 70, 5, 48]
    tables = [
        [(7 * b + 3 * i) % 64 + 64 * (b % 2) for i in range(pages_for(n, page))]
        for b, n in enumerate(lens)
    ]
    cache = PagedKVCache(
        n_layers=1,
        n_kv_heads=n_kv,
        head_dim=d,
        n_tokens=128 * page,
        page_size=page,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    cache.k.normal_()
    cache.v.normal_()
    B = len(lens)
    q = torch.randn(B, n_q, d).to(dtype)
    k_new, v_new = torch.randn(B, n_kv, d).to(dtype), torch.randn(B, n_kv, d).to(dtype)
    outs = {}
    runs = [("numba/1", 1)] if numba_available() else []
    runs += [(f"cpp/{isa}", threads) for isa in simd_isas() for threads in (1, 2)]
    for impl, threads in runs:
        kc, vc = cache.k[0].clone(), cache.v[0].clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            attn = _decode_attention(tables, lens, page_size=page, sliding_window=window, impl=impl)
            outs[impl, threads] = attn(q, k_new, v_new, kc, vc)
        finally:
            torch.set_num_threads(before)
        for b in range(B):
            (row,) = cache.rows(tables[b], lens[b] - 1, lens[b])
            assert torch.equal(kc[row], k_new[b]) and torch.equal(vc[row], v_new[b])
            rows = torch.tensor(cache.rows(tables[b], 0, lens[b]))
            ref = _ref_attn(
                q[b].float(),
                kc[rows].transpose(0, 1).float(),
                vc[rows].transpose(0, 1).float(),
                window,
            )
            tol = (
                dict(atol=2e-3, rtol=2**-8)
                if dtype == torch.bfloat16
                else dict(atol=1e-5, rtol=1e-4)
            )
            torch.testing.assert_close(outs[impl, threads][b].float(), ref, **tol)
    # the two kernels sum in different orders: float32 rounding apart, not more
    first = outs[runs[0]]
    for out in outs.values():
        if dtype == torch.float32:
            torch.testing.assert_close(out, first, atol=1e-6, rtol=1e-5)
        else:  # one bf16 rounding of the output: at most one unit in the last place apart
            torch.testing.assert_close(out.float(), first.float(), atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    "lens, padded", [([9, 1, 1], False), ([5, 1, 7], True), ([5, 4, 7], True), ([6], False)]
)
def test_prefill_is_causal_per_prompt(window, lens, padded):
    torch.manual_seed(2)
    T = sum(lens)
    q, k, v = torch.randn(T, N_Q, D), torch.randn(T, N_KV, D), torch.randn(T, N_KV, D)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    assert PrefillAttention(bounds, sliding_window=window, device="cpu").padded == padded
    out = prefill_attention(q, k, v, bounds, sliding_window=window)
    for s, e in zip(bounds[:-1], bounds[1:]):
        for t in range(s, e):
            ref = _ref_attn(
                q[t], k[s : t + 1].transpose(0, 1), v[s : t + 1].transpose(0, 1), window
            )
            torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-4)


def test_cache_rows_and_write_follow_the_page_table():
    cache = _cache(n_tokens=32, page_size=4, n_layers=3)
    assert cache.rows([5, 2], 2, 7) == [22, 23, 8, 9, 10]
    k, v = torch.randn(3, N_KV, D), torch.randn(3, N_KV, D)
    cache.write(2, torch.tensor(cache.rows([5, 2], 3, 6)), k, v)
    torch.testing.assert_close(cache.k[2, 23], k[0])
    torch.testing.assert_close(cache.k[2, 8], k[1])
    torch.testing.assert_close(cache.v[2, 9], v[2])


def test_pages_are_lowest_first_reference_counted_and_checked():
    cache = _cache(n_tokens=10, page_size=4, n_layers=1)  # rounded up to 3 pages
    assert cache.n_pages == 3 and cache.n_tokens == 12
    assert cache.alloc(2) == [0, 1]
    cache.share([0])  # a group mate holds page 0 too
    cache.free([0, 1])
    assert cache.n_free == 2  # page 0 is still held
    assert cache.alloc(2) == [1, 2] and cache.n_free == 0
    with pytest.raises(RuntimeError, match="1 pages asked, 0 free"):
        cache.alloc(1)
    cache.free([0])
    with pytest.raises(RuntimeError, match="page 0 is not allocated"):
        cache.free([0])
    with pytest.raises(RuntimeError, match="page 0 is not allocated"):
        cache.share([0])
    assert cache.nbytes == 2 * 1 * 12 * N_KV * D * 4
    assert cache.bytes_per_token == 1 * N_KV * D * 4 * 2
    assert pages_for(17, 16) == 2 and pages_for(16, 16) == 1


def test_new_cache_is_finite_even_in_reused_memory():
    # The padded decode path multiplies masked positions by weight 0, and
    # 0 * NaN is NaN: a cache that reused freed memory holding NaNs made the
    # engine emit token 0 (seen only when the whole suite ran in one process).
    for _ in range(3):
        junk = torch.full((2, 64, N_KV, D), float("nan"))
        del junk
        cache = _cache(n_tokens=64, page_size=4)
        assert torch.count_nonzero(cache.k) == 0 and torch.count_nonzero(cache.v) == 0
    attn = DecodeAttention([[0], [3, 1]], [3, 1], page_size=4, sliding_window=None, impl="padded")
    out = attn(
        torch.randn(2, N_Q, D),
        torch.randn(2, N_KV, D),
        torch.randn(2, N_KV, D),
        cache.k[0],
        cache.v[0],
    )
    assert torch.isfinite(out).all()
