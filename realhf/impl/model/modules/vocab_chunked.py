"""Log-probabilities and entropies over a large vocabulary without a ``[T, V]`` fp32 tensor.

The model's logits ``[T, V]`` (V up to ~152k) stay in the model's dtype; these functions
read them a block of rows at a time, in float32, so the extra memory is one block
(:data:`BLOCK_BYTES`, 64 MiB by default: ~110 rows of a 152k vocabulary) instead of the
2-3 fp32 copies of the whole tensor that ``logits.float()`` and a log-softmax make (at 8k
tokens and 152k entries each copy is ~5 GB).  Backward recomputes the softmax block by block
from the saved logits and writes the gradient in the logits' dtype.

Both work on vocabulary-sharded logits too (``group``: the tensor-parallel group, each rank
holding ``[T, V/m]`` from vocabulary row ``start``): per block, the row maxima and the sums
are all-reduced (vectors of the block's length, never ``[T, V]``), and the gradients are
local.  Every rank must call with the same rows, so that the collectives pair up.

On a CPU with AVX2 or AVX-512, token log-probs of float32 or bfloat16 logits run in one C++
pass per row instead (``realhf._C.row_logsumexp`` / ``row_softmax_grad``,
``csrc/vocab_logprob_simd.h``): each row is read in its own dtype and its gradient written
once, with no float32 block (~6 bytes of memory traffic per logit against ~50 for the
block-wise torch ops, which remain the path elsewhere).

Math, for the tempered logits z = logits / temperature of one row, p = softmax(z),
lse = log sum_v exp z_v:
- log-prob of label y: z_y - lse;  d/dz = onehot(y) - p;
- entropy: H = lse - sum_v p_v z_v;  d/dz = -p (z - E_p[z]);
and d/dlogits = d/dz / temperature.
"""

from __future__ import annotations

import bisect
from typing import Optional

import torch
import torch.distributed as dist

from realhf.impl.kernels import simd_cpu

__all__ = ["BLOCK_BYTES", "token_log_probs", "token_entropy"]

#: the float32 working memory of one block of rows (bytes)
BLOCK_BYTES = 64 << 20


def _spans(n: int, n_vocab_local: int, block_bytes: int):
    """(start, end) of the blocks of rows of n rows: as many rows as fit in block_bytes."""
    step = max(1, block_bytes // (4 * max(1, n_vocab_local)))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _buffers(logits: torch.Tensor, spans, k: int = 1):
    """``k`` float32 buffers of the largest block, allocated once per call: a fresh block per
    iteration would be a fresh mapping of its pages (glibc maps allocations this large), and
    the page faults cost ten times the copy into it."""
    rows = max((e - s for s, e in spans), default=0)
    return [logits.new_empty((rows, logits.shape[-1]), dtype=torch.float32) for _ in range(k)]


class _Rows:
    """Where block s:e of the selected rows lies in the logits, and its copies.

    On a CPU the rows (e.g. every position but the last of each sequence) are copied as
    runs of consecutive logits rows, each a plain slice that ``copy_`` converts to or from
    float32 on the way: advanced indexing gathers element by element and makes a copy of
    its own before the conversion (2.5x the time of the slices at 1,152 x 152k in bf16).
    Elsewhere (CUDA) one indexing kernel does the block.  All rows (``rows`` None) are one
    run on any device."""

    def __init__(self, rows: Optional[torch.Tensor], n_logits_rows: int, device: torch.device):
        self.rows = rows
        #: [(i, r, n)]: selected rows i ... i + n - 1 are logits rows r ... r + n - 1
        #: (None: the block is indexed)
        self.runs = None
        if rows is None:
            self.runs = [(0, 0, n_logits_rows)]
        elif device.type == "cpu":
            r = rows.tolist()
            starts = [i for i in range(len(r)) if i == 0 or r[i] != r[i - 1] + 1]
            ends = starts[1:] + [len(r)]
            self.runs = [(a, r[a], b - a) for a, b in zip(starts, ends)]
        self._starts = None if self.runs is None else [i for i, _, _ in self.runs]

    def _pieces(self, s: int, e: int):
        """(offset in the block, first logits row, length) of block s:e, as slices."""
        for i, r, n in self.runs[max(0, bisect.bisect_right(self._starts, s) - 1) :]:
            if i >= e:
                break
            a, b = max(i, s), min(i + n, e)
            yield a - s, r + a - i, b - a

    def read(self, logits: torch.Tensor, s: int, e: int, z: torch.Tensor) -> None:
        """Selected rows s:e of ``logits`` into ``z`` (converted to its dtype)."""
        if self.runs is None:
            z.copy_(logits[self.rows[s:e]])
            return
        for at, r, n in self._pieces(s, e):
            z[at : at + n].copy_(logits[r : r + n])

    def write(self, grad: torch.Tensor, s: int, e: int, block: torch.Tensor) -> None:
        """``block`` (converted to the dtype of ``grad``) into selected rows s:e of ``grad``."""
        if self.runs is None:
            grad[self.rows[s:e]] = block.to(grad.dtype)
            return
        for at, r, n in self._pieces(s, e):
            grad[r : r + n].copy_(block[at : at + n])


def _block(logits: torch.Tensor, where: _Rows, s: int, e: int, t: float, buf):
    """Selected rows s:e in float32, divided by t, in ``buf``."""
    z = buf[: e - s]
    where.read(logits, s, e, z)
    return z.div_(t) if t != 1.0 else z


def _row_max(z: torch.Tensor, group) -> torch.Tensor:
    """Row maxima of a block over the whole (sharded) vocabulary."""
    m = z.max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def _grad_like(logits: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    # Rows the blocks write need no zeros first: only the others (e.g. the last token of
    # each sequence, which predicts nothing) are zeroed, not the whole [T, V].
    grad = torch.empty_like(logits)
    if rows is not None:
        mask = torch.ones(logits.shape[0], dtype=torch.bool, device=rows.device)
        mask[rows] = False
        unwritten = mask.nonzero().squeeze(-1)
        if unwritten.numel():
            grad.index_fill_(0, unwritten, 0)
    return grad


def _fused_ext(logits: torch.Tensor):
    """``realhf._C`` where its row kernels take these logits (a CPU that runs them, float32
    or bfloat16 ``[T, V]`` with the last dim contiguous), else None."""
    if (
        logits.device.type != "cpu"
        or logits.dtype not in (torch.float32, torch.bfloat16)
        or logits.dim() != 2
        or logits.stride(-1) != 1
    ):
        return None
    return simd_cpu()


# The loops work in place on one float32 block: each block is read from the logits once
# per pass, and every elementwise step reuses its memory (memory traffic is the cost).


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, labels, temperature, start, group, block_bytes):
        n = labels.shape[0]
        n_local = logits.shape[-1]
        local = labels.long() - start
        mine = (local >= 0) & (local < n_local)  # this rank holds the label's row
        idx = torch.where(mine, local, torch.zeros_like(local))
        ext = _fused_ext(logits)
        ctx.temperature, ctx.block_bytes, ctx.ext = temperature, block_bytes, ext
        if ext is not None:  # one C++ pass per row
            r = torch.arange(logits.shape[0]) if rows is None else rows.long().contiguous()
            m, sums = ext.row_logsumexp(logits, r, temperature)
            if group is not None:  # the sums below the row maxima over all ranks
                m_all = m.clone()
                dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
                sums = _all_reduce(sums.mul_(torch.exp(m - m_all)), group)
                m = m_all
            lse = m + sums.log()
            picked = logits[r, idx].float() / temperature
            picked = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group)
            ctx.save_for_backward(logits, idx, mine, lse, r)
            ctx.rows = rows
            return picked - lse
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        spans = _spans(n, n_local, block_bytes)
        (buf,) = _buffers(logits, spans)
        where = _Rows(rows, logits.shape[0], logits.device)
        for s, e in spans:
            z = _block(logits, where, s, e, temperature, buf)
            picked = z.gather(-1, idx[s:e].unsqueeze(-1)).squeeze(-1)
            picked = _all_reduce(torch.where(mine[s:e], picked, torch.zeros_like(picked)), group)
            m = _row_max(z, group)
            sums = _all_reduce(z.sub_(m.unsqueeze(-1)).exp_().sum(-1), group)
            lse[s:e] = m + sums.log()
            out[s:e] = picked - lse[s:e]
        ctx.save_for_backward(logits, idx, mine, lse)
        ctx.where = where
        return out

    @staticmethod
    def backward(ctx, g):
        t = ctx.temperature
        if ctx.ext is not None:
            logits, idx, mine, lse, r = ctx.saved_tensors
            grad = _grad_like(logits, ctx.rows)
            gt = g.float() / t
            ctx.ext.row_softmax_grad(logits, r, lse, -gt, idx, mine * gt, t, grad)
            return grad, None, None, None, None, None, None
        logits, idx, mine, lse = ctx.saved_tensors
        where = ctx.where
        grad = _grad_like(logits, where.rows)
        n = lse.shape[0]
        spans = _spans(n, logits.shape[-1], ctx.block_bytes)
        (buf,) = _buffers(logits, spans)
        for s, e in spans:
            gt = g[s:e].float() / t
            z = _block(logits, where, s, e, t, buf)
            z.sub_(lse[s:e].unsqueeze(-1)).exp_().mul_(-gt.unsqueeze(-1))  # -p g/t
            z.scatter_add_(-1, idx[s:e].unsqueeze(-1), (mine[s:e] * gt).unsqueeze(-1))
            where.write(grad, s, e, z)
        return grad, None, None, None, None, None, None


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, temperature, group, block_bytes):
        n = logits.shape[0] if rows is None else rows.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        mean_z = torch.empty_like(out)  # E_p[z]
        spans = _spans(n, logits.shape[-1], block_bytes)
        buf, buf_ex = _buffers(logits, spans, 2)
        where = _Rows(rows, logits.shape[0], logits.device)
        for s, e in spans:
            z = _block(logits, where, s, e, temperature, buf)
            m = _row_max(z, group)
            z.sub_(m.unsqueeze(-1))  # z - m
            ex = torch.exp(z, out=buf_ex[: e - s])
            sums = _all_reduce(torch.stack([ex.sum(-1), ex.mul_(z).sum(-1)]), group)
            lse[s:e] = m + sums[0].log()
            mean_z[s:e] = m + sums[1] / sums[0]
            out[s:e] = lse[s:e] - mean_z[s:e]
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature, ctx.block_bytes, ctx.where = temperature, block_bytes, where
        return out

    @staticmethod
    def backward(ctx, g):
        logits, lse, mean_z = ctx.saved_tensors
        t, where = ctx.temperature, ctx.where
        grad = _grad_like(logits, where.rows)
        n = lse.shape[0]
        spans = _spans(n, logits.shape[-1], ctx.block_bytes)
        buf, buf_p = _buffers(logits, spans, 2)
        for s, e in spans:
            z = _block(logits, where, s, e, t, buf)
            p = torch.sub(z, lse[s:e].unsqueeze(-1), out=buf_p[: e - s]).exp_()
            z.sub_(mean_z[s:e].unsqueeze(-1)).mul_(p).mul_((-g[s:e].float() / t).unsqueeze(-1))
            where.write(grad, s, e, z)
        return grad, None, None, None, None


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    start: int = 0,
    group=None,
    block_bytes: Optional[int] = None,
) -> torch.Tensor:
    """``log_softmax(logits[rows] / temperature)[i, labels[i]]``: float32 ``[N]``.

    Args:
        logits: ``[T, V_local]`` in any float dtype (kept, not copied, for backward).
        labels: ``[N]`` token ids (global vocabulary ids).
        rows: ``[N]`` distinct row indices into ``logits`` (None: all T rows, N = T).
        temperature: the logits are divided by it.
        start, group: this rank's first vocabulary row and the tensor-parallel group when
            ``logits`` is sharded by vocabulary (None: the whole vocabulary is here).
        block_bytes: float32 working memory per block of rows (None: :data:`BLOCK_BYTES`).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    block = BLOCK_BYTES if block_bytes is None else block_bytes
    return _TokenLogProbs.apply(logits, rows, labels, float(temperature), start, group, block)


def token_entropy(
    logits: torch.Tensor,
    *,
    rows: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    group=None,
    block_bytes: Optional[int] = None,
) -> torch.Tensor:
    """Entropy of ``softmax(logits[rows] / temperature)`` per row: float32 ``[N]``
    (arguments as for :func:`token_log_probs`)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    block = BLOCK_BYTES if block_bytes is None else block_bytes
    return _TokenEntropy.apply(logits, rows, float(temperature), group, block)
