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
        all_greedy / any_truncation: host-side summaries that pick fast paths.
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    uniforms: torch.Tensor
    stop_mask: Optional[torch.Tensor] = None
    all_greedy: bool = False
    any_truncation: bool = False

    @property
    def truncate(self) -> torch.Tensor:
        """Rows that restrict the vocabulary (top-k or top-p)."""
        return (self.top_k > 0) | (self.top_p < 1.0)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative mass exceeds ``u * total``.

    ``probs`` is ``[B, V]`` non-negative (zeros are never chosen unless every
    entry is zero, which the callers exclude).
    """
    cdf = probs.cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total itself; stay on the last positive entry.
    last = (probs > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(idx, last)


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
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
    logp = torch.log_softmax(logits / temp.unsqueeze(-1), dim=-1)
    # Rows without top-k/top-p sample by inverse CDF in vocabulary order (no
    # sort); rows with truncation sort their own row. Which path a row takes
    # depends only on its own parameters, so a seeded row gets the same token
    # whatever else shares the batch.
    sampled = _inverse_cdf(logp.exp(), batch.uniforms)
    if batch.any_truncation:
        rows = batch.truncate.nonzero().squeeze(-1)
        sampled[rows] = _sample_truncated(
            logp[rows], batch.top_k[rows], batch.top_p[rows], batch.uniforms[rows]
        )
    tokens = torch.where(batch.greedy, logp.argmax(dim=-1), sampled)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _sample_truncated(logp, top_k, top_p, uniforms) -> torch.Tensor:
    """Inverse-CDF sampling over the top-k / top-p set of each row (``[R, V]``)."""
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logp.exp()
    V = probs.shape[-1]
    rank = torch.arange(V, device=probs.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
    keep = rank.unsqueeze(0) < k.unsqueeze(-1)
    # Nucleus: keep a token while the mass before it is below top_p, so the
    # most likely token always survives.
    keep &= (probs.cumsum(-1) - probs) < top_p.unsqueeze(-1)
    pos = _inverse_cdf(probs * keep, uniforms)
    return order.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
