"""Outcome advantage estimators and answer-length reward shaping.

The GAE path (:func:`realhf.impl.algorithms.ppo.compute_gae` with a critic, or with V = 0) is
one estimator; this module holds the others, which need no critic. Each starts from one
score per answer ``r_i`` (the verifier's reward after scaling, length shaping and clipping)
and from groups of ``group_size`` consecutive answers to one prompt:

===========================  ===============================================================
estimator                    advantage of every token of answer i
===========================  ===============================================================
``grpo``                     ``(r_i - mean_G r) / (std_G r + eps)``  (sample std, per answer)
``drgrpo``                   ``r_i - mean_G r``
``rloo``                     ``r_i - mean_{j != i} r_j``  (leave-one-out baseline)
``reinforce++``              token returns (reward-to-go of the per-token rewards: KL
                             penalty + score at the last step), normalised over the whole
                             batch (all data-parallel ranks)
``reinforce++-baseline``     as ``reinforce++`` with ``r_i - mean_G r`` as the score
===========================  ===============================================================

The group statistics are over answers, not tokens: a long answer weighs as much as a short
one. The batch normalisation of the REINFORCE++ family is over valid tokens and global: the
caller all-reduces :func:`~realhf.impl.model.utils.functional.masked_moments` and hands them
to :func:`~realhf.impl.algorithms.ppo.normalize_advantages` (nothing here runs a collective).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "ADV_ESTIMATORS",
    "OUTCOME_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "overlong_penalty",
    "group_outcome_advantages",
    "per_token",
    "group_success_rates",
]

#: every value of ``PPOHyperparameters.adv_estimator``
ADV_ESTIMATORS = ("gae", "grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline")
#: estimators that need no critic (they start from the answers' scores)
OUTCOME_ESTIMATORS = ADV_ESTIMATORS[1:]
#: estimators whose advantage is the score against its group's, with nothing per token
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo")


def overlong_penalty(
    answer_lens: torch.Tensor, max_new_tokens: int, penalty_len: int, factor: float
) -> torch.Tensor:
    """DAPO's soft length penalty, to be added to the score of each answer.

    Args:
        answer_lens: [B] generated tokens |o| of each answer.
        max_new_tokens: L_max, the generation budget.
        penalty_len: L_c, the length of the zone before L_max where the penalty grows
            (0 disables the penalty).
        factor: the penalty at |o| = L_max.

    Returns:
        [B] float32 ``min(0, -(|o| - (L_max - L_c)) / L_c) * factor``: 0 up to L_max - L_c
        tokens, then falling linearly to ``-factor`` at L_max.
    """
    lens = answer_lens.float()
    if penalty_len == 0:
        return torch.zeros_like(lens)
    if not 0 < penalty_len <= max_new_tokens:
        raise ValueError(
            f"penalty_len={penalty_len} must lie in [0, max_new_tokens={max_new_tokens}]"
        )
    over = -(lens - (max_new_tokens - penalty_len)) / penalty_len
    return over.clamp(max=0.0) * factor


def group_outcome_advantages(
    scores: torch.Tensor, group_size: int, estimator: str, eps: float = 1e-6
) -> torch.Tensor:
    """One advantage per answer from the answers' scores, group by group.

    Args:
        scores: [B] one score per answer; B a multiple of ``group_size``, each block of
            ``group_size`` consecutive answers answering one prompt.
        group_size: G >= 2.
        estimator: ``grpo``, ``drgrpo`` or ``rloo`` (see the module docstring).
        eps: added to the std (``grpo``): a group whose answers scored the same gets 0.

    Returns:
        [B] float32, computed in float64.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}: use one of {GROUP_ESTIMATORS}")
    n = scores.numel()
    if group_size < 2 or n % group_size != 0:
        raise ValueError(
            f"{estimator} compares each answer with the others of its group: need group_size "
            f">= 2 dividing the {n} answers, got group_size={group_size}"
        )
    r = scores.double().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True) + eps)
    elif estimator == "drgrpo":
        adv = r - mean
    else:
        # mean of the others: (sum - r_i) / (G - 1)
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return adv.reshape(-1).float()


def per_token(per_seq: torch.Tensor, short1cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Broadcast one value per sequence [B] to its shifted entries [T']."""
    lens = (short1cu_seqlens[1:] - short1cu_seqlens[:-1]).long()
    if per_seq.shape != lens.shape:
        raise ValueError(
            f"need one value per sequence ({lens.numel()}), got shape {tuple(per_seq.shape)}"
        )
    return torch.repeat_interleave(per_seq, lens)


def group_success_rates(scores: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """[G] float32: the share of each group's answers with a positive score (NaN counts as
    not positive); group g is the next ``counts[g]`` consecutive answers.  The success rate
    that dynamic sampling and the ``success_rate_lb/ub`` filter compare with their range."""
    if sum(counts) != scores.numel():
        raise ValueError(f"groups of {list(counts)} answers, but {scores.numel()} scores")
    ok = (scores > 0).float()
    return torch.stack([g.mean() for g in ok.split(list(counts))]) if counts else ok[:0]
