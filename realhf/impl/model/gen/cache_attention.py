"""Attention of new tokens against the paged KV cache (see :mod:`.kv_cache`).

Two cases:

- **decode**: one query token per running sequence attends to the first
  ``lens[b]`` cached positions of its slot. Three implementations, the first that
  applies chosen by ``"auto"`` (:func:`select_decode_impl`):
  - ``cpp``: a C++ kernel (``csrc/decode_attention_simd.h``, in ``realhf._C``), built for
    AVX-512 and for AVX2 (the widest the CPU runs is used), float32 or bfloat16 caches,
    head sizes that are multiples of 16 up to 128, or 256. It makes scores a vector's
    width of keys at a time (that many dot-product vectors reduced into one vector of
    scores) and keeps up to 4 query heads' outputs in registers while the values stream
    past. Same contract and traversal as the numba kernel.
  - ``numba``: a two-pass kernel over sequences (spread over numba's threads, or
    a serial build of it for one thread) that reads exactly ``sum(lens)`` cached
    positions, whole pool rows in page order, prefetching the next page while it
    reads one. Used on CPU for float32 and bfloat16 caches (bfloat16 rows widened
    to float32 as they are read) where the C++ kernel cannot run.
  - ``padded``: one ``scaled_dot_product_attention`` call over the pool rows
    of every sequence's first ``max(lens)`` positions, gathered, with a length
    mask. Used on GPUs and for other dtypes; it reads ``B * max(lens)`` positions.
  Decode on CPU is bound by reading the cache at few query heads per kv head, so
  reading only the valid positions, in order, is what pays; at real model shapes
  (7 query heads per kv head) the arithmetic counts too. One thread of the Xeon VM
  (``python benchmark/decode_kernel.py``, ns per position and layer, pages scattered
  over the pool): float32, 4/2 heads of 64, 256 sequences of 68-136 positions: numba
  122, cpp (AVX-512) 82; bfloat16, 14/2 heads of 64, 16 sequences of 130-253: numba 218,
  cpp 98. On a Zen 1 EPYC (AVX2), the float32 case: numba 167, cpp (AVX2) 150, reading
  the same cache alone 91.
- **prefill**: a whole prompt attends causally to itself (prompts always start
  at position 0: the engine keeps no prefix cache): one masked SDPA call over
  the prompts padded to the longest, or one call per prompt when padding would
  more than double the work (:class:`PrefillAttention`).

GQA is handled by viewing the ``n_q`` query heads as ``n_kv`` groups of
``n_q // n_kv`` so that keys and values are never repeated in memory.
"""

from __future__ import annotations

import enum
import threading
from typing import List, Optional, Union

import torch
import torch.nn.functional as F

try:  # numba is a project dependency; the padded path covers its absence.
    import numba as _nb
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numba
    _nb = None
from realhf.impl.kernels import simd_cpu

DECODE_IMPLS = ("auto", "cpp", "numba", "padded")


class DecodeImpl(enum.StrEnum):
    """A resolved decode-attention implementation (``"auto"`` resolves to one of these)."""

    CPP = "cpp"  # C++ kernel, AVX2 or AVX-512 CPUs: float32 or bf16 caches, most head sizes
    NUMBA = "numba"  # per-sequence kernel over the cache in place: float32 or bf16 CPU caches
    PADDED = "padded"  # SDPA over the padded slot range: any device and dtype


# numba's fallback "workqueue" threading layer aborts the process when two
# threads launch parallel kernels at once (two engines in one process); the
# OpenMP/TBB layers do not, but one lock costs nothing next to a kernel call.
_KERNEL_LOCK = threading.Lock()


if _nb is not None:
    from llvmlite import binding as _llvm
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils
    from numba.core import types as _nbtypes
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    # LLVM's prefetch intrinsic takes an opaque pointer from LLVM 15 on.
    _PREFETCH = "llvm.prefetch.p0" if _llvm.llvm_version_info >= (15,) else "llvm.prefetch.p0i8"

    @_intrinsic
    def _prefetch(typingctx, ary, i, j, k):
        """Ask the CPU to start loading the cache line of ``ary[i, j, k]`` (a 3-D array)
        for reading: no result, no fault, no wait."""

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            arr = context.make_array(aryty)(context, builder, args[0])
            ptr = _cgutils.get_item_pointer(
                context, builder, aryty, arr, list(args[1:]), wraparound=False
            )
            i8p, i32 = _ir.IntType(8).as_pointer(), _ir.IntType(32)
            fnty = _ir.FunctionType(_ir.VoidType(), [i8p, i32, i32, i32])
            fn = _cgutils.get_or_insert_function(builder.module, fnty, _PREFETCH)
            # (read, keep in all cache levels, data)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return _nbtypes.void(ary, i, j, k), codegen

    @_nb.njit(fastmath=True, cache=True, nogil=True, inline="always")
    def _prefetch_rows(pool, first_row, end_row):  # pragma: no cover
        # Every 64-byte line of pool rows [first_row, end_row) (16 float32 or 32 bfloat16).
        n_kv, d = pool.shape[1], pool.shape[2]
        per_line = 64 // pool.itemsize
        for r in range(first_row, end_row):
            for h in range(n_kv):
                for x in range(0, d, per_line):
                    _prefetch(pool, r, h, x)

    @_nb.njit(fastmath=True, cache=True, nogil=True, inline="always")
    def _page_rows(table, s, pg, lo, hi, page):  # pragma: no cover
        # The pool rows [start, end) sequence ``s`` reads on its page ``pg`` when it attends
        # to positions [lo, hi): a sequence's first and last pages may be partly read.
        base = table[s, pg] * page
        return base + max(lo - pg * page, 0), base + min(hi - pg * page, page)

    @_nb.njit(fastmath=True, cache=True, nogil=True, inline="always")
    def _prefetch_page(pool, table, s, pg, lo, hi, page):  # pragma: no cover
        start, end = _page_rows(table, s, pg, lo, hi, page)
        _prefetch_rows(pool, start, end)

    def _as_f32(src, bits, as_f32):  # pragma: no cover - replaced by the overload below
        """A pool row's ``[d]`` values as float32: the row itself in a float32 pool; in a
        bfloat16 pool (held as int16 bits) the row widened into ``bits`` and returned as
        its float32 view ``as_f32`` (a bfloat16 is the top half of a float32)."""

    @_overload(_as_f32, inline="always")
    def _as_f32_impl(src, bits, as_f32):
        if src.dtype == _nbtypes.float32:
            return lambda src, bits, as_f32: src
        if src.dtype == _nbtypes.int16:

            def widen(src, bits, as_f32):  # pragma: no cover
                for x in range(src.shape[0]):
                    bits[x] = (_np.int32(src[x]) & 0xFFFF) << 16
                return as_f32

            return widen
        return None

    @_nb.njit(fastmath=True, cache=True, inline="always")
    def _exp_split(x):  # pragma: no cover
        # exp(x) for x <= 0 as (e^r, the float32 bits of 2^k), x = k ln2 + r, |r| <= ln2/2:
        # Cephes' expf polynomial (relative error ~1e-7), with no libm call, so that a loop
        # of these vectorises (math.exp is a scalar call: a fifth of the kernel's time).
        # Below -87 the result is that of -87 (~1.6e-38: nothing next to the row max's 1).
        x = max(x, _np.float32(-87.0))
        # np.floor keeps float32 (math.floor gives an int64, and int64 * float32 is
        # float64: the whole polynomial would run in double, half as wide a vector).
        k = _np.floor(x * _np.float32(1.44269504) + _np.float32(0.5))
        r = x - k * _np.float32(0.693359375) + k * _np.float32(2.12194440e-4)
        p = _np.float32(1.9875691500e-4)
        p = p * r + _np.float32(1.3981999507e-3)
        p = p * r + _np.float32(8.3334519073e-3)
        p = p * r + _np.float32(4.1665795894e-2)
        p = p * r + _np.float32(1.6666665459e-1)
        p = p * r + _np.float32(5.0000001201e-1)
        return p * (r * r) + r + _np.float32(1.0), (_np.int32(k) + _np.int32(127)) << 23

    # fastmath lets LLVM reorder the float sums (vectorised dot products); outputs then
    # differ from SDPA in the last bits only. nogil: the engine thread runs it while the
    # HTTP thread keeps serving. cache: the compiled code is kept on disk, so later
    # processes skip the JIT.
    @_nb.njit(fastmath=True, cache=True, nogil=True, inline="always")
    def _decode_one(
        b, q, k_new, v_new, kc, vc, table, lens, page, window, scale, out, scores, rowbuf
    ):  # pragma: no cover
        # q, out: [B, n_kv, g, d] float32; k_new, v_new: [B, n_kv, d] and kc, vc: [N, n_kv,
        # d] (the pool), float32, or bfloat16 as int16 bits (rows are widened to float32 as
        # they are read; arithmetic is float32 either way); table: [B, max_pages];
        # scores: [B, n_kv * g + 1, >= max(lens)] and rowbuf: [B, d] int32, scratch.
        # Position t of sequence b lives at pool row table[b, t // page] * page + t % page.
        #
        # One work item per sequence: store its new key/value at position lens-1 (a row
        # on a page of its own, never shared, so items do not race), then two passes
        # over its pages, each reading whole pool rows (all kv heads) in order: scores
        # of the g query heads of every kv head against each key, a softmax per query
        # head, and the probability-weighted sum of the values. Decode is bound by
        # reading the cache and a sequence's pages lie anywhere in the pool, so while
        # one page is read the next one is prefetched (the values' first page during
        # the keys' last, the next sequence's first key page during the values' last).
        B, n_kv, g, d = q.shape
        hi = lens[b]
        r = table[b, (hi - 1) // page] * page + (hi - 1) % page
        kc[r] = k_new[b]
        vc[r] = v_new[b]
        lo = 0
        if window > 0 and hi > window:
            lo = hi - window
        first, last = lo // page, (hi - 1) // page
        sc = scores[b]
        qb = q[b]
        bits = rowbuf[b]
        as_f32 = bits.view(_np.float32)
        t = 0
        for pg in range(first, last + 1):
            if pg < last:
                _prefetch_page(kc, table, b, pg + 1, lo, hi, page)
            else:
                _prefetch_page(vc, table, b, first, lo, hi, page)
            start, end = _page_rows(table, b, pg, lo, hi, page)
            for row in range(start, end):
                for h in range(n_kv):
                    kr = _as_f32(kc[row, h], bits, as_f32)
                    for gi in range(g):
                        qr = qb[h, gi]
                        a = _np.float32(0.0)
                        for x in range(d):
                            a += qr[x] * kr[x]
                        sc[h * g + gi, t] = a * scale
                t += 1
        n = t
        two_k = scores[b, n_kv * g].view(_np.int32)  # the scratch's last row
        pow2 = two_k.view(_np.float32)
        for j in range(n_kv * g):
            # Softmax minus the row max: exp() of raw scores overflows float32.
            row_s = sc[j]
            m = row_s[0]
            for t in range(1, n):
                m = max(m, row_s[t])
            for t in range(n):
                row_s[t], two_k[t] = _exp_split(row_s[t] - m)
            den = _np.float32(0.0)
            for t in range(n):
                e = row_s[t] * pow2[t]
                row_s[t] = e
                den += e
            inv = _np.float32(1.0) / den
            for t in range(n):
                row_s[t] *= inv
        ob = out[b]
        ob[:] = 0.0
        t = 0
        for pg in range(first, last + 1):
            if pg < last:
                _prefetch_page(vc, table, b, pg + 1, lo, hi, page)
            elif b + 1 < B:
                nhi = lens[b + 1]
                nlo = nhi - window if window > 0 and nhi > window else 0
                _prefetch_page(kc, table, b + 1, nlo // page, nlo, nhi, page)
            start, end = _page_rows(table, b, pg, lo, hi, page)
            for row in range(start, end):
                for h in range(n_kv):
                    vr = _as_f32(vc[row, h], bits, as_f32)
                    for gi in range(g):
                        p = sc[h * g + gi, t]
                        o = ob[h, gi]
                        for x in range(d):
                            o[x] += p * vr[x]
                t += 1

    # One work item per sequence, over numba's threads (prange), or in a plain loop for
    # one thread. Same per-sequence code; the serial build is what one thread should run:
    # numba's parallel build of the loop, loaded from its on-disk cache, ran ~20% slower
    # on one thread (float32, 256 sequences of ~72 positions, 4 layers: 70 against 56 ns
    # per position and layer; the tiny model's server, 256 x 128 over HTTP, one thread:
    # 18.0-18.7k against 19.3-20.6k tokens/s). With two threads the parallel build
    # halves the time, as before.
    @_nb.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _decode_kernel(
        q, k_new, v_new, kc, vc, table, lens, page, window, scale, out, scores, rowbuf
    ):  # pragma: no cover
        for b in _nb.prange(q.shape[0]):
            _decode_one(
                b, q, k_new, v_new, kc, vc, table, lens, page, window, scale, out, scores, rowbuf
            )

    @_nb.njit(fastmath=True, cache=True, nogil=True)
    def _decode_kernel_serial(
        q, k_new, v_new, kc, vc, table, lens, page, window, scale, out, scores, rowbuf
    ):  # pragma: no cover
        for b in range(q.shape[0]):
            _decode_one(
                b, q, k_new, v_new, kc, vc, table, lens, page, window, scale, out, scores, rowbuf
            )


def numba_available() -> bool:
    """Whether the numba decode kernel can be used."""
    return _nb is not None


def cpp_available() -> bool:
    """Whether the C++ decode kernel can run here: ``realhf._C`` built with it (by GCC) and
    a CPU with AVX2 and FMA, or AVX-512 (:func:`realhf.impl.kernels.simd_isa`)."""
    return simd_cpu() is not None


def _cpp_reason(cache: torch.Tensor) -> Optional[str]:
    """Why the C++ kernel cannot serve ``cache`` ([..., n_kv, head_dim]), or None."""
    ext = simd_cpu()
    if ext is None:
        return (
            "this CPU has neither AVX2 with FMA nor AVX-512, or realhf._C is not built "
            "(pip install --no-build-isolation -e .)"
        )
    if cache.device.type != "cpu" or cache.dtype not in _NUMBA_DTYPES:
        return (
            "it needs a float32 or bfloat16 CPU cache, this one is "
            f"{cache.dtype} on {cache.device.type}"
        )
    if not ext.decode_attention_head_size_ok(cache.shape[-1]):
        return f"head size {cache.shape[-1]} is not a multiple of 16 up to 128, or 256"
    return None


#: cache dtypes the numba kernel reads (bfloat16 as its bits, widened row by row)
_NUMBA_DTYPES = (torch.float32, torch.bfloat16)


def select_decode_impl(cache: torch.Tensor, impl: str = "auto") -> DecodeImpl:
    """Resolve ``"auto"`` for ``cache`` (one layer's pool, ``[..., n_kv, head_dim]``): the
    C++ kernel where it can run, else numba for float32 and bfloat16 CPU caches, else
    padded SDPA."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode attention impl {impl!r} is unknown; use one of {DECODE_IMPLS}")
    numba_ok = _nb is not None and cache.device.type == "cpu" and cache.dtype in _NUMBA_DTYPES
    cpp_why_not = _cpp_reason(cache)
    if impl != "auto":
        if impl == DecodeImpl.CPP and cpp_why_not is not None:
            raise ValueError(
                f"decode attention impl 'cpp' cannot run: {cpp_why_not}; use 'numba' or 'padded'"
            )
        if impl == DecodeImpl.NUMBA and not numba_ok:
            raise ValueError(
                "decode attention impl 'numba' needs numba and a float32 or bfloat16 CPU "
                f"cache (this one: {cache.dtype} on {cache.device.type}); use 'padded'"
            )
        return DecodeImpl(impl)
    if cpp_why_not is None:
        return DecodeImpl.CPP
    return DecodeImpl.NUMBA if numba_ok else DecodeImpl.PADDED


def _bits(t: torch.Tensor):
    """A CPU tensor as the numpy array the kernel takes: float32 as is, bfloat16 as its
    int16 bits."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class DecodeAttention:
    """Decode attention for one step; built once per step, called once per layer.

    Args:
        tables: per query, the page table of its sequence (:mod:`.kv_cache`), or all of
            them as one ``[B, width]`` long tensor on the host (rows padded past each
            sequence's pages with anything: only the first ``lens`` positions are read).
        lens: per query, valid cached positions (the new token's key/value
            included, so ``lens = position + 1``).
        page_size: positions per page.
        sliding_window: attend to at most this many recent positions, or ``None``.
        impl: ``"cpp"``, ``"numba"`` or ``"padded"`` (resolved with
            :func:`select_decode_impl`).
        device: where the index tensors live.
        isa: for ``"cpp"``, the build of the kernel to run (``"avx512"`` or ``"avx2"``;
            :func:`realhf.impl.kernels.simd_isas`); ``""``, the widest this CPU runs.
    """

    def __init__(
        self,
        tables: Union[List[List[int]], torch.Tensor],
        lens: List[int],
        *,
        page_size: int,
        sliding_window: Optional[int],
        impl: str,
        device=None,
        isa: str = "",
    ):
        self.impl = impl = DecodeImpl(impl)
        self.isa = isa
        self.window = sliding_window or 0
        self.page = page_size
        self.B = len(lens)
        if isinstance(tables, torch.Tensor):
            table = tables
        else:
            width = max(len(t) for t in tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        if impl is DecodeImpl.CPP:
            self._table_t = table.contiguous()
            self._lens_t = torch.tensor(lens, dtype=torch.long)
            return
        if impl is DecodeImpl.NUMBA:
            # Converted once per step, not per layer: the kernel takes numpy arrays.
            self._table = table.numpy()
            self._lens = _np.asarray(lens, dtype=_np.int64)
            self._scores = None  # [B, n_q + 1, max(lens)], made by the first layer's call
            # numba's thread count is the calling thread's (the engine sets its own)
            one = _nb.get_num_threads() == 1
            self._kernel = _decode_kernel_serial if one else _decode_kernel
            return
        # Padded path: pool rows of every sequence's positions [0, max(lens)).
        lens_t = torch.tensor(lens, dtype=torch.long)
        self.lmax = int(lens_t.max())
        pos = torch.arange(self.lmax)
        rows = table[:, pos // page_size] * page_size + pos % page_size
        self.new_rows = rows[torch.arange(self.B), lens_t - 1].to(device)
        self.rows = rows.flatten().to(device)
        valid = pos.unsqueeze(0) < lens_t.unsqueeze(1)
        if self.window:
            valid &= pos.unsqueeze(0) >= (lens_t - self.window).unsqueeze(1)
        self.mask = valid[:, None, None, :].to(device)

    def __call__(self, q, k, v, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Store ``k, v [B, n_kv, d]`` at position ``lens - 1`` of each sequence in one
        layer's pool ``kc, vc [N, n_kv, d]``, then attend ``q [B, n_q, d]``; returns
        ``[B, n_q, d]``."""
        B, n_q, d = q.shape
        n_kv = kc.shape[1]
        g = n_q // n_kv
        scale = d**-0.5
        if self.impl is DecodeImpl.CPP:
            qn = q.float().contiguous().view(B, n_kv, g, d)
            out = torch.empty_like(qn)
            simd_cpu().decode_attention(
                qn,
                k.to(kc.dtype).contiguous(),
                v.to(vc.dtype).contiguous(),
                kc,
                vc,
                self._table_t,
                self._lens_t,
                self.page,
                self.window,
                scale,
                out,
                self.isa,
            )
            return out.view(B, n_q, d).to(q.dtype)
        if self.impl is DecodeImpl.NUMBA:
            qn = q.float().contiguous().view(B, n_kv, g, d)
            out = torch.empty_like(qn)
            if self._scores is None or self._scores.shape[1] != n_q + 1:
                self._scores = _np.empty((B, n_q + 1, int(self._lens.max())), dtype=_np.float32)
                self._rowbuf = _np.empty((B, d), dtype=_np.int32)
            with _KERNEL_LOCK:
                self._kernel(
                    qn.numpy(),
                    _bits(k.to(kc.dtype).contiguous()),
                    _bits(v.to(vc.dtype).contiguous()),
                    _bits(kc),
                    _bits(vc),
                    self._table,
                    self._lens,
                    self.page,
                    self.window,
                    _np.float32(scale),
                    out.numpy(),
                    self._scores,
                    self._rowbuf,
                )
            return out.view(B, n_q, d).to(q.dtype)
        kc.index_copy_(0, self.new_rows, k.to(kc.dtype))
        vc.index_copy_(0, self.new_rows, v.to(vc.dtype))
        # One gather per layer: [B, L, n_kv, d], viewed as SDPA's [B, n_kv, L, d]
        # (index_select: ~8x faster than advanced indexing on a CPU).
        shape = (B, self.lmax, n_kv, d)
        keys = kc.index_select(0, self.rows).view(shape).transpose(1, 2)
        values = vc.index_select(0, self.rows).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.view(B, n_kv, g, d), keys, values, attn_mask=self.mask)
        return o.reshape(B, n_q, d)


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


class PrefillAttention:
    """Causal attention within each packed prompt; built once per prefill step.

    Two layouts, chosen by padding waste: when the prompts padded to the
    longest one hold at most twice the real tokens (the usual case: RL prompts
    of a batch have similar lengths, and a group repeats one prompt), one SDPA
    call over ``[B, heads, L_max, d]`` with a causal/length mask; otherwise one
    SDPA call per prompt.

    Args:
        bounds: host-side ``cu_seqlens`` (``[B+1]`` offsets, last is ``T``).
        sliding_window: attention window in tokens, or ``None``.
        device: where the index tensors live.
    """

    def __init__(self, bounds: List[int], *, sliding_window: Optional[int], device):
        self.bounds = bounds
        self.window = sliding_window
        lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        self.lmax = max(lens)
        self.padded = len(lens) > 1 and len(lens) * self.lmax <= 2 * bounds[-1]
        if not self.padded:
            return
        lens_t = torch.tensor(lens, device=device)
        self.rows = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
        starts = torch.tensor(bounds[:-1], device=device)
        self.cols = torch.arange(bounds[-1], device=device) - starts[self.rows]
        i = torch.arange(self.lmax, device=device)
        # Causal and within the prompt. A padding query row (i >= len) still sees the
        # prompt's keys, so no row is fully masked (that would be NaN); those rows are
        # never gathered back.
        mask = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < lens_t[:, None, None])
        if sliding_window is not None:
            mask &= (i[:, None] - i[None, :] < sliding_window)[None]
        self.mask = mask[:, None]  # [B, 1, L, L]
        self.B = len(lens)

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.B, self.lmax, *x.shape[1:])
        out[self.rows, self.cols] = x
        return out.transpose(1, 2)  # [B, heads, L, d]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, n_q, d]``, ``k, v [T, n_kv, d]`` -> ``[T, n_q, d]``."""
        if self.padded:
            o = F.scaled_dot_product_attention(
                self._pad(q), self._pad(k), self._pad(v), attn_mask=self.mask, enable_gqa=True
            )
            return o.transpose(1, 2)[self.rows, self.cols]
        out = torch.empty_like(q)
        for s, e in zip(self.bounds[:-1], self.bounds[1:]):
            n = e - s
            if n == 0:
                continue
            # [n, h, d] -> [h, n, d]: SDPA wants heads before positions.
            qq, kk, vv = (t[s:e].transpose(0, 1) for t in (q, k, v))
            if self.window is not None and n > self.window:
                mask = _window_mask(n, self.window, q.device)
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
            out[s:e] = o.transpose(0, 1)
        return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: List[int],
    *,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """One-off :class:`PrefillAttention`: ``q [T, n_q, d]``, ``k, v [T, n_kv, d]``."""
    return PrefillAttention(bounds, sliding_window=sliding_window, device=q.device)(q, k, v)
