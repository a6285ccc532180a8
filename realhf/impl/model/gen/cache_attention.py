"""Attention of new tokens against the paged KV cache (see :mod:`.kv_cache`).

Two cases, each with a CPU and a device-agnostic path:

- **decode**: one query token per running sequence attends to the first
  ``lens[b]`` cached positions of its slot.
  - ``numba``: a parallel two-pass kernel over (sequence, kv-head) that reads
    exactly ``sum(lens)`` cached positions. Used on CPU for float32 caches.
  - ``padded``: one ``scaled_dot_product_attention`` call over the strided
    view ``cache[:n_slots, :, :max(lens)]`` (no copy) with a length mask. Used
    on GPUs and for other dtypes; it reads ``n_slots * max(lens)`` positions.
  On the 2-core CPU VM, 64 sequences with lengths uniform in [1, 1000]
  (q 4 heads / kv 2 heads / head_dim 64, fp32): numba 1.9 ms per layer,
  padded SDPA 4.0 ms, one SDPA call per sequence 5.2 ms. Decode on CPU is
  bound by reading the cache, so reading only the valid positions is what pays.
- **prefill**: a whole prompt attends causally to itself (prompts always start
  at position 0: the engine keeps no prefix cache): one masked SDPA call over
  the prompts padded to the longest, or one call per prompt when padding would
  more than double the work (:class:`PrefillAttention`).

GQA is handled by viewing the ``n_q`` query heads as ``n_kv`` groups of
``n_q // n_kv`` so that keys and values are never repeated in memory.
"""

from __future__ import annotations

import enum
import math
import threading
from typing import List, Optional

import torch
import torch.nn.functional as F

try:  # numba is a project dependency; the padded path covers its absence.
    import numba as _nb
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numba
    _nb = None

DECODE_IMPLS = ("auto", "numba", "padded")


class DecodeImpl(enum.StrEnum):
    """A resolved decode-attention implementation (``"auto"`` resolves to one of these)."""

    NUMBA = "numba"  # per-slot kernel over the cache in place: float32 CPU caches
    PADDED = "padded"  # SDPA over the padded slot range: any device and dtype


# numba's fallback "workqueue" threading layer aborts the process when two
# threads launch parallel kernels at once (two engines in one process); the
# OpenMP/TBB layers do not, but one lock costs nothing next to a kernel call.
_KERNEL_LOCK = threading.Lock()


if _nb is not None:
    # fastmath lets LLVM reorder the float sums (vectorised dot products); outputs then
    # differ from SDPA in the last bits only. nogil: the engine thread runs it while the
    # HTTP thread keeps serving. cache: the compiled code is kept on disk, so later
    # processes skip the JIT.
    @_nb.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def _decode_kernel(
        q, k_new, v_new, kc, vc, table, lens, page, window, scale, out
    ):  # pragma: no cover
        # q, out: [B, n_kv, g, d]; k_new, v_new: [B, n_kv, d]; kc, vc: [N, n_kv, d] (the
        # pool); table: [B, max_pages]. Position t of sequence b lives at pool row
        # table[b, t // page] * page + t % page. Per (sequence, kv head): store the new
        # key/value at position lens-1, then scores of each of the g query heads against
        # the cached keys (four keys per pass: four independent accumulators keep the FMA
        # units busy), softmax, and the weighted sum of the values. A work item writes
        # only its own sequence's last row (on a page of its own, never shared) and its
        # output rows, so there are no races.
        B, n_kv, g, d = q.shape
        for w in _nb.prange(B * n_kv):
            b = w // n_kv
            h = w % n_kv
            hi = lens[b]
            r = table[b, (hi - 1) // page] * page + (hi - 1) % page
            kc[r, h, :] = k_new[b, h, :]
            vc[r, h, :] = v_new[b, h, :]
            lo = 0
            if window > 0 and hi > window:
                lo = hi - window
            n = hi - lo
            rows = _np.empty(n, dtype=_np.int64)
            for t in range(n):
                p = lo + t
                rows[t] = table[b, p // page] * page + p % page
            sc = _np.empty((g, n), dtype=_np.float32)
            for gi in range(g):
                qrow = q[b, h, gi] * scale
                t = 0
                while t + 4 <= n:
                    k0 = kc[rows[t], h]
                    k1 = kc[rows[t + 1], h]
                    k2 = kc[rows[t + 2], h]
                    k3 = kc[rows[t + 3], h]
                    a0 = _np.float32(0.0)
                    a1 = _np.float32(0.0)
                    a2 = _np.float32(0.0)
                    a3 = _np.float32(0.0)
                    for x in range(d):
                        qx = qrow[x]
                        a0 += qx * k0[x]
                        a1 += qx * k1[x]
                        a2 += qx * k2[x]
                        a3 += qx * k3[x]
                    sc[gi, t] = a0
                    sc[gi, t + 1] = a1
                    sc[gi, t + 2] = a2
                    sc[gi, t + 3] = a3
                    t += 4
                while t < n:
                    kr = kc[rows[t], h]
                    a = _np.float32(0.0)
                    for x in range(d):
                        a += qrow[x] * kr[x]
                    sc[gi, t] = a
                    t += 1
            for gi in range(g):
                # Softmax minus the row max: exp() of raw scores overflows float32.
                row = sc[gi]
                m = row.max()
                den = _np.float32(0.0)
                for t in range(n):
                    e = math.exp(row[t] - m)
                    row[t] = e
                    den += e
                inv = _np.float32(1.0) / den
                acc = _np.zeros(d, dtype=_np.float32)
                for t in range(n):
                    p = row[t] * inv
                    vr = vc[rows[t], h]
                    for x in range(d):
                        acc[x] += p * vr[x]
                out[b, h, gi, :] = acc


def numba_available() -> bool:
    """Whether the numba decode kernel can be used."""
    return _nb is not None


def select_decode_impl(cache: torch.Tensor, impl: str = "auto") -> DecodeImpl:
    """Resolve ``"auto"``: numba for float32 CPU caches, padded SDPA otherwise."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode attention impl {impl!r} is unknown; use one of {DECODE_IMPLS}")
    if impl != "auto":
        if impl == DecodeImpl.NUMBA and (
            _nb is None or cache.device.type != "cpu" or cache.dtype != torch.float32
        ):
            raise ValueError(
                "decode attention impl 'numba' needs numba and a float32 CPU cache; use 'padded'"
            )
        return DecodeImpl(impl)
    if _nb is not None and cache.device.type == "cpu" and cache.dtype == torch.float32:
        return DecodeImpl.NUMBA
    return DecodeImpl.PADDED


class DecodeAttention:
    """Decode attention for one step; built once per step, called once per layer.

    Args:
        tables: per query, the page table of its sequence (:mod:`.kv_cache`).
        lens: per query, valid cached positions (the new token's key/value
            included, so ``lens = position + 1``).
        page_size: positions per page.
        sliding_window: attend to at most this many recent positions, or ``None``.
        impl: ``"numba"`` or ``"padded"`` (resolved with :func:`select_decode_impl`).
        device: where the index tensors live.
    """

    def __init__(
        self,
        tables: List[List[int]],
        lens: List[int],
        *,
        page_size: int,
        sliding_window: Optional[int],
        impl: str,
        device=None,
    ):
        self.impl = impl = DecodeImpl(impl)
        self.window = sliding_window or 0
        self.page = page_size
        self.B = len(lens)
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        if impl is DecodeImpl.NUMBA:
            # Converted once per step, not per layer: the kernel takes numpy arrays.
            self._table = table.numpy()
            self._lens = _np.asarray(lens, dtype=_np.int64)
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
        if self.impl is DecodeImpl.NUMBA:
            qn = q.float().contiguous().view(B, n_kv, g, d)
            out = torch.empty_like(qn)
            with _KERNEL_LOCK:
                _decode_kernel(
                    qn.numpy(),
                    k.float().contiguous().numpy(),
                    v.float().contiguous().numpy(),
                    kc.numpy(),
                    vc.numpy(),
                    self._table,
                    self._lens,
                    self.page,
                    self.window,
                    _np.float32(scale),
                    out.numpy(),
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
