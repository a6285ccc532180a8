"""Causal self-attention over packed sequences.

Tokens of all sequences are concatenated into ``[T, heads, head_dim]`` and
``cu_seqlens: [B+1]`` marks where each sequence starts; a token only attends to
earlier tokens of its own sequence.  Three implementations:

- ``"flash"``: ``flash_attn.flash_attn_varlen_func`` — used automatically on
  CUDA for fp16/bf16 when the ``flash_attn`` package is installed.  One kernel
  for the whole packed batch, no padding, native GQA.
- ``"sdpa_per_seq"``: one ``torch.nn.functional.scaled_dot_product_attention``
  call per sequence with ``is_causal=True`` and ``enable_gqa``.  The default
  everywhere else (CPU, CUDA without flash-attn, fp32).
- ``"sdpa_masked"``: a single SDPA call over the whole pack with a
  ``[T, T]`` block-diagonal causal mask.  Kept for comparison and tests.

Why per-sequence is the CPU default: on the 2-core CPU VM, attention alone
(forward + backward, 4 q / 2 kv heads of 64) on ``benchmark/train_step.py``'s
lengths (8 sequences, 10-100% of 1,024 tokens, T = 4,145) took 0.258 s with one
call per sequence vs 2.161 s with the block-diagonal mask; for 16 sequences of 51-512
tokens 0.094 s vs 0.584 s, and for 64 sequences of 3-32 tokens 0.038 s vs
0.061 s (see benchmark/results/train_step.md).  The mask makes SDPA score all
T^2 pairs across sequence boundaries.  Inputs go to SDPA as 4-D
``[1, heads, L, head_dim]`` because torch's fused CPU kernel only takes 4-D
inputs (3-D falls back to the unfused math path).
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F

ATTN_IMPLS = ("auto", "flash", "sdpa_per_seq", "sdpa_masked")


@functools.lru_cache(maxsize=1)
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package can be imported."""
    return _flash_varlen() is not None


def select_attn_impl(q: torch.Tensor, impl: str = "auto") -> str:
    """Resolve ``"auto"`` to the implementation used for tensors like ``q``."""
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown; use one of {ATTN_IMPLS}")
    if impl != "auto":
        return impl
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available():
        return "flash"
    return "sdpa_per_seq"


def _window_mask(length: int, window: int, device) -> torch.Tensor:
    """Boolean ``[L, L]`` mask: causal and at most ``window - 1`` tokens back."""
    i = torch.arange(length, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def _per_seq(q, k, v, bounds: List[int], scale, window) -> torch.Tensor:
    outs = []
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    # ``split`` rather than one slice per sequence: the backward of a slice writes its
    # gradient into a zero-filled tensor of the whole pack, so B slices cost O(B * T) in
    # the backward (30% of a 256-answer train step); split's backward is one cat.
    for n, qq, kk, vv in zip(lens, q.split(lens), k.split(lens), v.split(lens)):
        if n == 0:
            continue
        # [L, H, D] -> [1, H, L, D]: SDPA wants heads before the sequence dim, and
        # only 4-D inputs reach torch's fused CPU kernel (3-D falls back to math).
        qq, kk, vv = (t.transpose(0, 1)[None] for t in (qq, kk, vv))
        if window is not None and n > window:
            mask = _window_mask(n, window, q.device)
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            o = F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True
            )
        outs.append(o[0].transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)


def _masked(q, k, v, cu_seqlens, scale, window) -> torch.Tensor:
    T = q.shape[0]
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    seg = torch.repeat_interleave(
        torch.arange(seqlens.numel(), device=q.device), seqlens.to(q.device)
    )
    pos = torch.arange(T, device=q.device)
    d = pos[:, None] - pos[None, :]
    # Block-diagonal (same sequence) and causal; every row keeps its diagonal, so no row
    # is fully masked.
    mask = (seg[:, None] == seg[None, :]) & (d >= 0)
    if window is not None:
        mask &= d < window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: Optional[int] = None,
    sliding_window: Optional[int] = None,
    scale: Optional[float] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Causal attention within each packed sequence.

    Args:
        q: ``[T, n_q_heads, head_dim]``.
        k, v: ``[T, n_kv_heads, head_dim]``; ``n_q_heads % n_kv_heads == 0``.
        cu_seqlens: ``[B+1]`` integer offsets, ``cu_seqlens[-1] == T``.
        max_seqlen: longest sequence (computed when absent; flash needs it).
        sliding_window: attend to at most this many most recent tokens
            (including the token itself); ``None`` for full causal attention.
        scale: softmax scale, default ``head_dim ** -0.5``.
        impl: one of ``ATTN_IMPLS``; see the module docstring.

    Returns:
        ``[T, n_q_heads, head_dim]``.
    """
    impl = select_attn_impl(q, impl)
    if impl == "flash":
        fn = _flash_varlen()
        if fn is None:
            raise RuntimeError(
                "attention impl 'flash' was requested but flash_attn is not installed; "
                "install flash-attn or use impl='sdpa_per_seq'"
            )
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)  # flash-attn takes int32 only
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
        # flash-attn's window counts the tokens left of the query (itself excluded);
        # ours counts the query too. (-1, -1) is no window.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return fn(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
    if impl == "sdpa_masked":
        return _masked(q, k, v, cu_seqlens, scale, sliding_window)
    # One host sync to learn the boundaries; the loop itself launches per sequence.
    bounds = cu_seqlens.tolist()
    return _per_seq(q, k, v, bounds, scale, sliding_window)
