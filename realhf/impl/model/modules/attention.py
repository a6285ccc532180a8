"""Causal self-attention over packed sequences.

Tokens of all sequences are concatenated into ``[T, heads, head_dim]`` and
``cu_seqlens: [B+1]`` marks where each sequence starts; a token only attends to
earlier tokens of its own sequence.  Four implementations:

- ``"flash"``: ``flash_attn.flash_attn_varlen_func`` — used automatically on
  CUDA for fp16/bf16 when the ``flash_attn`` package is installed.  One kernel
  for the whole packed batch, no padding, native GQA.
- ``"sdpa_bucketed"``: sequences of similar length (within 1.25x) are padded at
  their ends into one ``[b, heads, L, head_dim]`` batch per bucket and run through
  ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` and
  ``enable_gqa``; a real token never attends to the padding after it, so the result is
  exact.  The default everywhere else (CPU, CUDA without flash-attn, fp32).  On a CPU,
  buckets of up to ``_SHORT_LEN`` tokens that need gradients keep torch's fused forward
  with a backward of our own (:class:`_ShortCausalAttention`: torch's is slow there).
- ``"sdpa_per_seq"``: one SDPA call per sequence (also used for sliding windows); a
  sequence within its window takes the same causal call as a bucket (:func:`causal_sdpa`).
- ``"sdpa_masked"``: a single SDPA call over the whole pack with a
  ``[T, T]`` block-diagonal causal mask.  Kept for comparison and tests.

Why buckets: the per-call cost of SDPA (and of the views around it) dominates for the RL
workload's many short answers. On the 2-core CPU VM (AVX2), a train forward + backward
of the embedded model over 256 sequences of 12-18 tokens took 0.56 s bucketed vs 0.77 s
per sequence (2026-11-26), and over 8 sequences of 100-1,024 tokens 1.12 s vs 1.53 s.
The block-diagonal mask is far slower (2.64 s on the first shape): SDPA scores all
T^2 pairs across sequence boundaries.  Inputs go to SDPA as 4-D tensors because torch's
fused CPU kernel only takes 4-D inputs (3-D falls back to the unfused math path).
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F

ATTN_IMPLS = ("auto", "flash", "sdpa_bucketed", "sdpa_per_seq", "sdpa_masked")


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
    return "sdpa_bucketed"


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
            o = causal_sdpa(qq, kk, vv, scale)
        outs.append(o[0].transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)


# A bucket's padded length is at most this factor of its shortest sequence's length.
_BUCKET_SLACK = 1.25


def _length_buckets(lens: List[int]) -> List[List[int]]:
    """Sequence indices grouped so that each group pads to at most ``_BUCKET_SLACK`` times
    its shortest member (longest first; a lone long sequence is a group of its own)."""
    order = sorted((i for i, n in enumerate(lens) if n > 0), key=lambda i: -lens[i])
    buckets: List[List[int]] = []
    for i in order:
        if buckets and lens[buckets[-1][0]] <= _BUCKET_SLACK * lens[i]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def _bucketed(q, k, v, bounds: List[int], scale) -> torch.Tensor:
    """Sequences of similar length run as one padded batch per bucket (see
    :func:`gathered_causal_attention`; here every sequence owns its rows)."""
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    return gathered_causal_attention(
        q, k, v, [0] * len(lens), [0] * len(lens), bounds[:-1], lens, scale
    )


# A padded bucket this short runs through _ShortCausalAttention where it can (below).
_SHORT_LEN = 128
# The fp32 score-sized temporaries of its backward, per slice of the batch (bytes).
_SHORT_BWD_BYTES = 32 << 20


class _ShortCausalAttention(torch.autograd.Function):
    """Causal GQA attention of ``[b, heads, L, d]`` for short L on a CPU: torch's fused
    forward, and a backward of plain products from the log-sum-exp that forward saves.

    Torch's fused CPU backward works in blocks sized for long sequences: at L = 72 (16
    sequences, 14 query heads over 2 kv heads, head dim 64) it took 22-46 ms a layer in
    bf16 against 4.4 ms for the forward.  Here the probabilities are recomputed from q, k
    and the saved log-sum-exp in fp32, a slice of the batch at a time, and the gradients
    are the textbook ones (dS = P * (dP - rowsum(dO * O))); the saved tensors are the fused
    path's (q, k, v, o and the log-sum-exp), so memory is unchanged.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = q.shape[-1] ** -0.5 if scale is None else scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        b, h, n, d = q.shape
        kv = k.shape[1]
        r = h // kv  # query heads per kv head, adjacent (as enable_gqa repeats them)
        s = ctx.scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # A query head's rows follow its kv head's: [b, kv, r * n, d], row i is position i % n.
        pos = torch.arange(n, device=q.device)
        future = (pos[None, :] > pos[:, None]).repeat(r, 1)  # [r * n, n]
        step = max(1, _SHORT_BWD_BYTES // (4 * h * n * n))
        for a in range(0, b, step):
            e = min(b, a + step)
            qf = q[a:e].float().reshape(e - a, kv, r * n, d)
            kf, vf = k[a:e].float(), v[a:e].float()
            dof = do[a:e].float().reshape(e - a, kv, r * n, d)
            p = torch.matmul(qf, kf.transpose(-1, -2)).mul_(s)
            p.sub_(lse[a:e].reshape(e - a, kv, r * n, 1)).exp_().masked_fill_(future, 0.0)
            dv[a:e] = torch.matmul(p.transpose(-1, -2), dof)
            delta = (dof * o[a:e].float().reshape(e - a, kv, r * n, d)).sum(-1, keepdim=True)
            ds = torch.matmul(dof, vf.transpose(-1, -2)).sub_(delta).mul_(p).mul_(s)
            dq[a:e] = torch.matmul(ds, kf).reshape(e - a, h, n, d)
            dk[a:e] = torch.matmul(ds.transpose(-1, -2), qf)
        return dq, dk, dv, None


def causal_sdpa(q, k, v, scale: Optional[float] = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
    enable_gqa=True)`` for ``[b, heads, L, d]`` inputs; short sequences that need gradients
    on a CPU take :class:`_ShortCausalAttention`'s faster backward."""
    if (
        q.device.type == "cpu"
        and q.shape[-2] <= _SHORT_LEN
        and q.dtype in (torch.float32, torch.bfloat16)
        and torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v))
        and q.shape[1] % k.shape[1] == 0
    ):
        return _ShortCausalAttention.apply(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def gathered_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_start: List[int],
    prefix_len: List[int],
    own_start: List[int],
    own_len: List[int],
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention over sequences gathered from the packed rows.

    Sequence ``i`` is rows ``prefix_start[i] : + prefix_len[i]`` (a prefix it shares with
    other sequences, possibly empty) followed by its own rows ``own_start[i] : +
    own_len[i]``; every packed row is some sequence's own row exactly once, and the output
    row is that sequence's attention output.  Sequences of similar length run as one padded
    ``[b, heads, L, head_dim]`` SDPA call per bucket: the padding goes at the end and the
    attention is causal, so a real token never sees it and its output is exact; the padded
    rows are dropped.  The gathers (``index_select``) keep the backward O(T); a shared
    prefix row gets the gradient of every sequence that reads it.
    """
    dev = q.device
    lens = [p + o for p, o in zip(prefix_len, own_len)]
    outs, where = [], []
    for rows in _length_buckets([n if o else 0 for n, o in zip(lens, own_len)]):
        n = lens[rows[0]]
        pstart, plen, ostart, olen = (
            torch.tensor([x[i] for i in rows], device=dev)[:, None]
            for x in (prefix_start, prefix_len, own_start, own_len)
        )
        pos = torch.arange(n, device=dev)[None, :]
        # position < plen: the prefix; then the own rows; past the end: the last own row
        own_pos = torch.minimum(pos - plen, olen - 1)
        idx = torch.where(pos < plen, pstart + pos, ostart + own_pos)  # [b, n]
        flat = idx.reshape(-1)
        qq, kk, vv = (
            t.index_select(0, flat).unflatten(0, idx.shape).transpose(1, 2) for t in (q, k, v)
        )
        o = causal_sdpa(qq, kk, vv, scale)
        valid = ((pos >= plen) & (pos < plen + olen)).reshape(-1)
        outs.append(o.transpose(1, 2).reshape(-1, *o.shape[1:2], o.shape[-1])[valid])
        where.append(flat[valid])
    if not outs:
        return q.new_empty(q.shape)
    order = torch.cat(where)
    if order.numel() != q.shape[0]:
        raise ValueError(
            f"the gathered sequences own {order.numel()} rows of a pack of {q.shape[0]}; "
            "every packed row must be one sequence's own row exactly once"
        )
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=dev)
    return torch.cat(outs).index_select(0, inverse)


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
    # One host sync to learn the boundaries; the loops below launch per bucket / sequence.
    bounds = cu_seqlens.tolist()
    if impl == "sdpa_bucketed" and sliding_window is None:
        return _bucketed(q, k, v, bounds, scale)
    return _per_seq(q, k, v, bounds, scale, sliding_window)
