"""Batched token sampling: greedy, temperature, top-k, top-p, from given uniforms.

One call samples the next token of every running sequence at once; each row
carries its own parameters. Randomness enters only through ``uniforms`` (one
number in ``[0, 1)`` per row, drawn by the engine from the request's own
``torch.Generator``), and a row's token depends only on its logits and its
uniform — so a seeded request samples the same tokens whatever else shares the
batch (inverse-CDF sampling over the vocabulary sorted by probability).

Logprobs are those of the chosen tokens under ``log_softmax(logits / T)``
(``T = 1`` for greedy rows), after the stop-token mask and before top-k/top-p
truncation, which is what SGLang reports.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters of one decode step, as tensors on the logits' device.

    Attributes:
        temperature: ``[B]`` float, ignored on greedy rows.
        greedy: ``[B]`` bool.
        top_p: ``[B]`` float in ``(0, 1]``.
        top_k: ``[B]`` long, ``<= 0`` for the whole vocabulary.
        uniforms: ``[B]`` float in ``[0, 1)``.
        stop_mask: optional ``[B, V]`` bool, ``True`` where a token is banned
            (stop tokens before ``min_new_tokens``).
        truncate: ``[B]`` bool, rows with ``top_k > 0`` or ``top_p < 1``.
        all_greedy / any_truncation / any_greedy / unit_temperature (every sampled row
            at temperature 1): host-side summaries that pick fast paths.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    uniforms: torch.Tensor
    stop_mask: Optional[torch.Tensor] = None
    all_greedy: bool = False
    any_truncation: bool = False
    any_greedy: bool = True
    unit_temperature: bool = False

    @property
    def truncate(self) -> torch.Tensor:
        """Rows that restrict the vocabulary (top-k or top-p)."""
        return (self.top_k > 0) | (self.top_p < 1.0)


#: entries per block of the two-level inverse CDF: one pass of block sums, then a cumulative
#: sum over the blocks and over the one block the target falls in (a cumulative sum over a
#: whole 152k vocabulary runs at a fraction of a sum's speed)
_BLOCK = 1024
#: candidates looked at first for top-k / top-p: a row whose nucleus lies within its most
#: likely ``_CANDIDATES`` tokens (or whose ``top_k`` is at most that) sorts those only
_CANDIDATES = 256


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative mass exceeds ``u * total``.

    ``probs`` is ``[B, V]`` non-negative, not necessarily normalised (zeros are never
    chosen unless every entry is zero, which the callers exclude).
    """
    B, V = probs.shape
    if V <= 4 * _BLOCK:
        cdf = probs.cumsum(dim=-1)
        target = (uniforms * cdf[:, -1]).unsqueeze(-1)
        idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        return _last_positive_if_past(probs, idx)
    nb = -(-V // _BLOCK)
    full = (V // _BLOCK) * _BLOCK
    sums = probs.new_zeros(B, nb)
    sums[:, : V // _BLOCK] = probs[:, :full].view(B, -1, _BLOCK).sum(-1)
    if full < V:
        sums[:, -1] = probs[:, full:].sum(-1)
    bcdf = sums.cumsum(-1)
    target = uniforms * bcdf[:, -1]
    blk = torch.searchsorted(bcdf, target.unsqueeze(-1), right=True).squeeze(-1)
    # u * total can round up to total itself: stay on the last block with mass.
    blk = _last_positive_if_past(sums, blk)
    base = torch.where(blk > 0, bcdf.gather(-1, (blk - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    cols = blk[:, None] * _BLOCK + torch.arange(_BLOCK, device=probs.device)
    inside = cols < V
    block = torch.where(inside, probs.gather(-1, cols.clamp(max=V - 1)), 0.0)
    pos = torch.searchsorted(block.cumsum(-1), (target - base)[:, None], right=True)[:, 0]
    # The block's own sum and the blocks' cumulative sum round differently: past the
    # block's end means its last entry with mass.
    return blk * _BLOCK + _last_positive_if_past(block, pos)


def _last_positive_if_past(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``idx``, with entries past the end (``== V``) replaced by their row's last
    positive entry (computed for those rows only)."""
    V = probs.shape[-1]
    past = (idx >= V).nonzero().squeeze(-1)
    if past.numel():
        rows = probs[past]
        rank = torch.arange(V, device=probs.device)
        idx = idx.clone()
        idx[past] = torch.where(rows > 0, rank, -1).amax(-1).clamp(min=0)
    return idx


def sample(logits: torch.Tensor, batch: SamplingBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: ``[B, V]`` next-token logits (any float dtype).
        batch: per-row parameters.

    Returns:
        ``(tokens [B] long, logprobs [B] float32)``.
    """
    logits = logits.float()
    if batch.stop_mask is not None:
        logits = logits.masked_fill(batch.stop_mask, float("-inf"))
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
        logz = torch.logsumexp(logits, dim=-1)
        return tokens, logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz

    if batch.unit_temperature:
        scaled = logits
    else:
        temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temp.unsqueeze(-1)
    # One pass each: the max, exp(x - max) (unnormalised probabilities), their sum; a
    # token's logprob is then x - max - log(sum), with no [B, V] log-softmax.
    top = scaled.amax(dim=-1, keepdim=True)
    probs = torch.sub(scaled, top).exp_()
    logz = top.squeeze(-1) + probs.sum(-1).log()
    # Rows without top-k/top-p sample by inverse CDF in vocabulary order (no
    # sort); rows with truncation look at their own most likely tokens.  Which path a
    # row takes depends only on its own parameters, so a seeded row gets the same token
    # whatever else shares the batch.
    tokens = _inverse_cdf(probs, batch.uniforms)
    if batch.any_truncation:
        rows = batch.truncate.nonzero().squeeze(-1)
        tokens[rows] = _sample_truncated(
            probs[rows], batch.top_k[rows], batch.top_p[rows], batch.uniforms[rows]
        )
    if batch.any_greedy:
        tokens = torch.where(batch.greedy, scaled.argmax(dim=-1), tokens)
    return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logz


def _sample_truncated(probs, top_k, top_p, uniforms) -> torch.Tensor:
    """Inverse-CDF sampling over the top-k / top-p set of each row (``[R, V]``
    unnormalised probabilities), in order of decreasing probability.

    The most likely ``_CANDIDATES`` tokens of each row come first (a partial sort).  A row
    whose set is not within them (a flat distribution) finds a wide nucleus by its
    probability bins (:func:`_nucleus_mask`, no sort of the row, sampled in vocabulary
    order: the same distribution), and sorts its whole row only for a wide top-k set."""
    V = probs.shape[-1]
    probs = probs / probs.sum(-1, keepdim=True)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    c = min(_CANDIDATES, V)
    vals, order = probs.topk(c, dim=-1, sorted=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    covered = (vals.sum(-1) >= top_p) | (k <= c)
    if covered.any():
        r = covered.nonzero().squeeze(-1)
        pos = _nucleus(vals[r], k[r], top_p[r], uniforms[r])
        out[r] = order[r].gather(-1, pos.unsqueeze(-1)).squeeze(-1)
    wide = ~covered & (top_k <= 0)  # a wide nucleus alone: found by its probability bins
    if wide.any():
        r = wide.nonzero().squeeze(-1)
        out[r] = _inverse_cdf(probs[r] * _nucleus_mask(probs[r], top_p[r]), uniforms[r])
    rest = ~covered & ~wide  # a wide top-k set (and maybe a nucleus in it): sorted
    if rest.any():
        r = rest.nonzero().squeeze(-1)
        vals, order = probs[r].sort(dim=-1, descending=True, stable=True)
        pos = _nucleus(vals, k[r], top_p[r], uniforms[r])
        out[r] = order.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
    return out


#: :func:`_nucleus_mask` bins a row's tokens by log-probability, 1/64 nat wide over the 40
#: nats below its most likely token (everything less likely shares the last bin)
_BINS_PER_NAT = 64
_BIN_NATS = 40


def _in_nucleus(sorted_vals: torch.Tensor, top_p, mass_before=0.0) -> torch.Tensor:
    """The nucleus rule over probabilities in decreasing order along the last dim (after
    ``mass_before`` of more likely ones): a token is in while the mass before it is below
    ``top_p``, so the most likely token always is."""
    return (mass_before + sorted_vals.cumsum(-1) - sorted_vals) < top_p


def _nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus of each row of ``probs`` (``[R, V]``, normalised) as a mask, without
    sorting the row: the same tokens as keeping them in decreasing order while the mass
    before each is below ``top_p`` (ties in vocabulary order).

    One pass puts every token in a bin of log-probability (bins are ordered like the
    tokens in them) and sums each bin's mass; the cumulative mass over the bins finds the
    bin where the nucleus ends.  Tokens of the bins before it are in, of those after it
    out, and the few of that bin are sorted and decided one by one."""
    R, V = probs.shape
    nbins = _BINS_PER_NAT * _BIN_NATS + 1
    logp = probs.log()
    top = logp.amax(-1, keepdim=True)
    bins = ((top - logp) * _BINS_PER_NAT).clamp_(max=nbins - 1).long()  # 0: the most likely
    mass = probs.new_zeros(R, nbins).scatter_add_(-1, bins, probs)
    # The bin of the token where the mass before reaches top_p: the last bin whose mass
    # before it is below top_p (bins are in decreasing order of probability).
    last = (_in_nucleus(mass, top_p[:, None]).sum(-1) - 1).clamp(min=0)
    keep = bins < last[:, None]
    before = (mass.cumsum(-1) - mass).gather(-1, last[:, None])[:, 0]
    for i in range(R):
        idx = (bins[i] == last[i]).nonzero().squeeze(-1)  # in vocabulary order
        if idx.numel() == 0:  # (a row summing to just under top_p: every bin is in)
            continue
        vals = probs[i, idx]
        order = None
        if not bool((vals == vals[0]).all()):  # one value (bf16 ties): already sorted
            vals, order = vals.sort(descending=True, stable=True)
        inside = _in_nucleus(vals, top_p[i], before[i])
        keep[i, idx[inside] if order is None else idx[order[inside]]] = True
    return keep


def _nucleus(sorted_probs, k, top_p, uniforms) -> torch.Tensor:
    """Position, in each row of ``sorted_probs`` (decreasing), of the token sampled from
    its first ``k`` entries and its nucleus ``top_p``."""
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    keep = rank.unsqueeze(0) < k.unsqueeze(-1)
    keep &= _in_nucleus(sorted_probs, top_p.unsqueeze(-1))
    return _inverse_cdf(sorted_probs * keep, uniforms)
