"""Token-level helpers over packed sequences: shifted indexing, log-probs, normalisation, SFT loss.

Conventions (shared with :mod:`realhf.impl.algorithms.ppo`):

- A packed batch holds B sequences of lengths L_i back to back: T = sum L_i tokens, described
  by ``cu_seqlens`` [B+1] (int, cu_seqlens[0] = 0).
- A *shifted* tensor has L_i - 1 entries per sequence (T - B in all): entry t of sequence i
  belongs to the prediction of token t+1 from tokens <= t.  Its offsets are
  ``short1cu_seqlens = cu_seqlens - arange(B+1)``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from realhf.impl.model.nn.parallel_hooks import LOCAL, LocalHooks

__all__ = [
    "check_cu_seqlens",
    "short1cu_seqlens",
    "shift_one_indices",
    "gather_packed_shifted_log_probs",
    "masked_mean",
    "masked_moments",
    "masked_normalization",
    "sft_loss",
]


def check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    total: Optional[int] = None,
    min_len: int = 1,
    name: str = "cu_seqlens",
):
    """Validate a cumulative-lengths vector: 1-D, starts at 0, every length >= ``min_len``,
    and ends at ``total`` when given."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0:
        raise ValueError(
            f"{name} must be a 1-D tensor [B+1] starting at 0, got {cu_seqlens.tolist()}"
        )
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    if lens.numel() and int(lens.min()) < min_len:
        raise ValueError(
            f"{name} has a sequence of length {int(lens.min())} (lengths {lens.tolist()}); every "
            f"sequence needs at least {min_len} token(s)"
        )
    if total is not None and int(cu_seqlens[-1]) != total:
        raise ValueError(
            f"{name} ends at {int(cu_seqlens[-1])} but the packed tensor has {total} entries"
        )


def short1cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Offsets [B+1] of the shifted tensors (each sequence one entry shorter)."""
    return cu_seqlens - torch.arange(
        cu_seqlens.numel(), device=cu_seqlens.device, dtype=cu_seqlens.dtype
    )


def shift_one_indices(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Indices [T - B] of every token that is not the last of its sequence.

    ``x[shift_one_indices(cu)]`` turns a full-length tensor into its shifted form (the position
    that predicts the next token); ``x[shift_one_indices(cu) + 1]`` gives the predicted tokens.
    """
    check_cu_seqlens(cu_seqlens)
    total = int(cu_seqlens[-1])
    # The last token of a sequence predicts nothing inside it (the next position belongs
    # to the next sequence of the pack), so it has no shifted entry.
    keep = torch.ones(total, dtype=torch.bool, device=cu_seqlens.device)
    keep[cu_seqlens[1:].long() - 1] = False
    return keep.nonzero().squeeze(-1)


def gather_packed_shifted_log_probs(
    logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    tp: Optional[LocalHooks] = None,
) -> torch.Tensor:
    """Log-probability of each next token, per sequence.

    Args:
        logits: [T, V] model outputs for the packed tokens ([T, V/m], this rank's
            vocabulary rows, under tensor parallelism).
        cu_seqlens: [B+1] sequence offsets.
        input_ids: [T] packed tokens.
        temperature: logits are divided by it (use the generation temperature so that the
            result matches the sampler's log-probs).
        tp: the model's hooks (``model.tp``) when its logits are vocabulary-sharded; the
            log-softmax then runs across ranks without gathering the logits.

    Returns:
        [T - B] float32: entry t of sequence i is
        ``log softmax(logits[t] / temperature)[input_ids[t+1]]``.
    """
    if logits.dim() != 2 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"logits must be [T, V] with T = len(input_ids) = {input_ids.shape[0]}, got "
            f"{tuple(logits.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_cu_seqlens(cu_seqlens, total=input_ids.shape[0])
    idx = shift_one_indices(cu_seqlens)
    labels = input_ids[idx + 1].long()
    # The logits stay in the model's dtype: rows are read a block at a time in float32.
    return (tp or LOCAL).token_log_probs(logits, labels, rows=idx, temperature=temperature)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    mask = mask.bool()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1)


def _valid_mask(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    mask = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match x shape {tuple(x.shape)}")
    return mask


def masked_moments(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[sum, sum of squares, count]`` (float64, [3]) of the valid entries of ``x`` [N].

    Local to this process. Unlike means, these combine across data-parallel ranks by plain
    addition: all-reduce them and hand the totals to :func:`masked_normalization`.
    """
    mask = _valid_mask(x, mask)
    xd = torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    return torch.stack([xd.sum(), (xd * xd).sum(), mask.sum().double()])


def masked_normalization(
    x: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    moments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and (population) std over the valid entries.

    Args:
        x: [N] values (e.g. advantages).
        mask: [N] bool, valid entries (all when None); invalid entries come out as 0.
        eps: added to the std.
        moments: [3] :func:`masked_moments` to take mean and std from, e.g. those of ``x``
            summed over data-parallel ranks; None: the moments of ``x`` itself.

    Statistics are accumulated in float64 so that large batches of small numbers keep their
    precision; the result has ``x``'s dtype.
    """
    mask = _valid_mask(x, mask)
    stats = masked_moments(x, mask) if moments is None else moments.double()
    n = stats[2].clamp(min=1.0)
    mean = stats[0] / n
    # E[x^2] - E[x]^2 can round to a tiny negative number when the entries are (nearly) equal.
    var = (stats[1] / n - mean * mean).clamp(min=0.0)
    out = (x.double() - mean) / (var.sqrt() + eps)
    return torch.where(mask, out, torch.zeros_like(out)).to(x.dtype)


def sft_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prompt_mask: torch.Tensor,
    tp: Optional[LocalHooks] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cross entropy on answer tokens only (packed); ``tp`` as for
    :func:`gather_packed_shifted_log_probs`.

    Args:
        logits: [T, V] model outputs.
        input_ids: [T] prompt + answer (+ EOS) tokens of each sequence.
        cu_seqlens: [B+1] sequence offsets.
        prompt_mask: [T] bool, True on prompt tokens.

    Returns:
        ``(loss, n_tokens)``: the mean negative log-likelihood of the predicted answer tokens
        (0 when there are none) and their count (an int64 scalar), so that callers can weight
        micro-batches by tokens.  ``exp(loss)`` is the answer perplexity.
    """
    if prompt_mask.shape != input_ids.shape:
        raise ValueError(
            f"prompt_mask shape {tuple(prompt_mask.shape)} must equal input_ids shape "
            f"{tuple(input_ids.shape)}"
        )
    logp = gather_packed_shifted_log_probs(logits, cu_seqlens, input_ids, tp=tp)
    # Position t predicts token t+1: it is trained when token t+1 is part of the answer.
    answer = prompt_mask[shift_one_indices(cu_seqlens) + 1].logical_not()
    n_tokens = answer.sum()
    loss = -torch.where(answer, logp, torch.zeros_like(logp)).sum() / n_tokens.clamp(min=1)
    return loss, n_tokens
