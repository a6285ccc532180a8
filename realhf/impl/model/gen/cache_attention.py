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
        q, k_new, v_new, kc, vc, slots, lens, window, scale, out
    ):  # pragma: no cover
        # q, out: [B, n_kv, g, d]; k_new, v_new: [B, n_kv, d]; kc, vc: [S, n_kv,
        # cap, d]. Per (sequence, kv head): store the new key/value at position
        # lens-1 of the slot, then scores of each of the g query heads against
        # the cached keys (four keys per pass: four independent accumulators
        # keep the FMA units busy), softmax, and the weighted sum of the values.
        # Each work item owns its cache row and output rows (slots are
        # distinct), so there are no races.
        B, n_kv, g, d = q.shape
        for w in _nb.prange(B * n_kv):
            b = w // n_kv
            h = w % n_kv
            s = slots[b]
            hi = lens[b]
            kc[s, h, hi - 1, :] = k_new[b, h, :]
            vc[s, h, hi - 1, :] = v_new[b, h, :]
            lo = 0
            if window > 0 and hi > window:
                lo = hi - window
            n = hi - lo
            K = kc[s, h, lo:hi]
            V = vc[s, h, lo:hi]
            sc = _np.empty((g, n), dtype=_np.float32)
            for gi in range(g):
                qrow = q[b, h, gi] * scale
                t = 0
                while t + 4 <= n:
                    k0 = K[t]
                    k1 = K[t + 1]
                    k2 = K[t + 2]
                    k3 = K[t + 3]
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
                    kr = K[t]
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
                    vr = V[t]
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
        self.impl = impl = DecodeImpl(impl)
        self.window = sliding_window or 0
        self.B = slots.numel()
        if impl is DecodeImpl.NUMBA:
            # Converted once per step, not per layer: the kernel takes numpy arrays.
            self._slots = slots.cpu().numpy().astype(_np.int64)
            self._lens = lens.cpu().numpy().astype(_np.int64)
            return
        # Padded path: view the slot range [0, hi) and scatter queries into it.
        self.hi = int(slots.max().item()) + 1
        self.lmax = int(lens.max().item())
        self.slots = slots
        self.positions = lens - 1
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

    def __call__(self, q, k, v, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        """Store ``k, v [B, n_kv, d]`` at position ``lens - 1`` of each slot of one
        layer's ``kc, vc [S, n_kv, cap, d]``, then attend ``q [B, n_q, d]``;
        returns ``[B, n_q, d]``."""
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
                    self._slots,
                    self._lens,
                    self.window,
                    _np.float32(scale),
                    out.numpy(),
                )
            return out.view(B, n_q, d).to(q.dtype)
        # Index tensors around a slice: the target is [B, n_kv, d], the layout of k and v.
        kc[self.slots, :, self.positions] = k.to(kc.dtype)
        vc[self.slots, :, self.positions] = v.to(vc.dtype)
        qg = q.view(B, n_kv, g, d)
        # SDPA's batch dim runs over cache rows [0, hi); queries of sequences whose slots
        # are not exactly 0..B-1 are scattered into those rows (zeros elsewhere).
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
