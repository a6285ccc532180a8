"""Attention of new tokens against the slot KV cache (see :mod:`.kv_cache`).

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
  at position 0: the engine keeps no prefix cache), one SDPA call per prompt.

GQA is handled by viewing the ``n_q`` query heads as ``n_kv`` groups of
``n_q // n_kv`` so that keys and values are never repeated in memory.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

try:  # numba is a project dependency; the padded path covers its absence.
    import numba as _nb
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numba
    _nb = None

DECODE_IMPLS = ("auto", "numba", "padded")


if _nb is not None:

    @_nb.njit(parallel=True, fastmath=True, cache=True)
    def _decode_kernel(q, kc, vc, slots, lens, window, scale, out):  # pragma: no cover
        # q, out: [B, n_kv, g, d]; kc, vc: [S, n_kv, cap, d]. Two passes per
        # (sequence, kv head): scores for the g query heads, then softmax and
        # the weighted sum of values. Each work item owns its output rows.
        B, n_kv, g, d = q.shape
        for w in _nb.prange(B * n_kv):
            b = w // n_kv
            h = w % n_kv
            s = slots[b]
            hi = lens[b]
            lo = 0
            if window > 0 and hi > window:
                lo = hi - window
            n = hi - lo
            sc = _np.empty((g, n), dtype=_np.float32)
            for t in range(n):
                for gi in range(g):
                    acc = _np.float32(0.0)
                    for x in range(d):
                        acc += q[b, h, gi, x] * kc[s, h, lo + t, x]
                    sc[gi, t] = acc * scale
            for gi in range(g):
                m = sc[gi, 0]
                for t in range(1, n):
                    if sc[gi, t] > m:
                        m = sc[gi, t]
                den = _np.float32(0.0)
                for t in range(n):
                    e = math.exp(sc[gi, t] - m)
                    sc[gi, t] = e
                    den += e
                for x in range(d):
                    out[b, h, gi, x] = 0.0
                inv = _np.float32(1.0) / den
                for t in range(n):
                    p = sc[gi, t] * inv
                    for x in range(d):
                        out[b, h, gi, x] += p * vc[s, h, lo + t, x]


def numba_available() -> bool:
    """Whether the numba decode kernel can be used."""
    return _nb is not None


def select_decode_impl(cache: torch.Tensor, impl: str = "auto") -> str:
    """Resolve ``"auto"``: numba for float32 CPU caches, padded SDPA otherwise."""
    if impl not in DECODE_IMPLS:
        raise ValueError(f"decode attention impl {impl!r} is unknown; use one of {DECODE_IMPLS}")
    if impl != "auto":
        if impl == "numba" and (_nb is None or cache.device.type != "cpu" or cache.dtype != torch.float32):
            raise ValueError(
                "decode attention impl 'numba' needs numba and a float32 CPU cache; use 'padded'"
            )
        return impl
    if _nb is not None and cache.device.type == "cpu" and cache.dtype == torch.float32:
        return "numba"
    return "padded"


class DecodeAttention:
    """Decode attention for one step; built once per step, called once per layer.

    Args:
        slots: ``[B]`` long, the cache slot of each query.
        lens: ``[B]`` long, valid cached positions per query (the new token's
            key/value already written, so ``lens = position + 1``).
        n_slots: number of slots that may be in use (``max(slots) + 1`` is enough).
        sliding_window: attend to at most this many recent positions, or ``None``.
        impl: ``"numba"`` or ``"padded"`` (resolved with :func:`select_decode_impl`).
    """

    def __init__(
        self,
        slots: torch.Tensor,
        lens: torch.Tensor,
        *,
        sliding_window: Optional[int],
        impl: str,
    ):
        self.impl = impl
        self.window = sliding_window or 0
        self.B = slots.numel()
        if impl == "numba":
            self._slots = slots.cpu().numpy().astype(_np.int64)
            self._lens = lens.cpu().numpy().astype(_np.int64)
            return
        # Padded path: view the slot range [0, hi) and scatter queries into it.
        self.hi = int(slots.max().item()) + 1
        self.lmax = int(lens.max().item())
        self.slots = slots
        self.contiguous = self.hi == self.B and bool(
            (slots == torch.arange(self.B, device=slots.device)).all()
        )
        row_len = torch.zeros(self.hi, dtype=torch.long, device=slots.device)
        row_len[slots] = lens
        pos = torch.arange(self.lmax, device=slots.device)
        valid = pos.unsqueeze(0) < row_len.unsqueeze(1)
        if self.window:
            valid &= pos.unsqueeze(0) >= (row_len - self.window).unsqueeze(1)
        # Idle rows keep one valid position so that softmax stays finite; their
        # outputs are never read.
        valid[:, 0] |= row_len == 0
        self.mask = valid[:, None, None, :]

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """``q [B, n_q, d]`` against one layer's ``kc, vc [S, n_kv, cap, d]`` -> ``[B, n_q, d]``."""
        B, n_q, d = q.shape
        n_kv = kc.shape[1]
        g = n_q // n_kv
        scale = d**-0.5
        if self.impl == "numba":
            qn = q.float().contiguous().view(B, n_kv, g, d)
            out = torch.empty_like(qn)
            _decode_kernel(
                qn.numpy(),
                kc.numpy(),
                vc.numpy(),
                self._slots,
                self._lens,
                self.window,
                _np.float32(scale),
                out.numpy(),
            )
            return out.view(B, n_q, d).to(q.dtype)
        qg = q.view(B, n_kv, g, d)
        if not self.contiguous:
            full = q.new_zeros(self.hi, n_kv, g, d)
            full[self.slots] = qg
            qg = full
        o = F.scaled_dot_product_attention(
            qg, kc[: self.hi, :, : self.lmax], vc[: self.hi, :, : self.lmax], attn_mask=self.mask
        )
        if not self.contiguous:
            o = o[self.slots]
        return o.reshape(B, n_q, d)


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    i = torch.arange(n, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: List[int],
    *,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention within each packed prompt.

    Args:
        q: ``[T, n_q, d]``; k, v: ``[T, n_kv, d]``.
        bounds: host-side ``cu_seqlens`` (``[B+1]`` offsets, last is ``T``).
        sliding_window: attention window in tokens, or ``None``.

    Returns:
        ``[T, n_q, d]``.
    """
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        n = e - s
        if n == 0:
            continue
        # [n, h, d] -> [h, n, d]: SDPA wants heads before positions.
        qq, kk, vv = (t[s:e].transpose(0, 1) for t in (q, k, v))
        if sliding_window is not None and n > sliding_window:
            mask = _window_mask(n, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        out[s:e] = o.transpose(0, 1)
    return out
