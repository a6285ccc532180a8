"""Advantage estimators, one registered object each, and answer-length reward shaping.

``ppo.adv_estimator`` names one entry of :data:`ESTIMATORS`. Each :class:`Estimator` says
what it asks of the run (a critic or none, groups of >= 2 answers, whether a KL penalty in
the reward reaches it) — :class:`~realhf.impl.model.interface.ppo.ppo_config.PPOHyperparameters`
checks those once — and computes the batch's advantages from :class:`AdvantageInputs`.
The outcome estimators start from one score per answer ``r_i`` (the verifier's reward after
scaling, length shaping and clipping) and from groups of ``group_size`` consecutive answers
to one prompt:

===========================  ===============================================================
estimator                    advantage of every token of answer i
===========================  ===============================================================
``gae``                      GAE over the per-token rewards (critic values, or V = 0), then
                             ``adv_norm`` / ``group_adv_norm``
``grpo``                     ``(r_i - mean_G r) / (std_G r + eps)``  (sample std, per answer)
``drgrpo``                   ``r_i - mean_G r``
``rloo``                     ``r_i - mean_{j != i} r_j``  (leave-one-out baseline)
``reinforce++``              token returns (reward-to-go of the per-token rewards: KL
                             penalty + score at the last step), normalised over the whole
                             batch (all data-parallel ranks)
``reinforce++-baseline``     as ``reinforce++`` with ``r_i - mean_G r`` as the score
===========================  ===============================================================

The group statistics are over answers, not tokens: a long answer weighs as much as a short
one. Nothing here runs a collective: the global normalisation and the check that every
item holds ``group_size`` answers come in through :class:`BatchOps`, which the caller
implements (all-reducing :func:`~realhf.impl.model.utils.functional.masked_moments`).

To add an estimator: a member of :class:`AdvEstimator`, its function (or group baseline)
and an :class:`Estimator` entry in :data:`ESTIMATORS`, here; then a test against hand
values in ``tests/impl/algorithms/test_advantages.py``. The config, its ``--help`` and the
PPO batch pick it up from the registry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple

import torch

from realhf.impl.algorithms import ppo as F
from realhf.impl.algorithms.choices import Choice

__all__ = [
    "AdvEstimator",
    "AdvantageInputs",
    "BatchOps",
    "Estimator",
    "ESTIMATORS",
    "estimator",
    "overlong_penalty",
    "group_outcome_advantages",
    "per_token",
    "group_success_rates",
]


class AdvEstimator(Choice):
    """The values of ``PPOHyperparameters.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"
    DRGRPO = "drgrpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce++"
    REINFORCE_PP_BASELINE = "reinforce++-baseline"


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read; B answers, T' shifted entries (see
    :mod:`realhf.impl.algorithms.ppo`).

    Attributes:
        score: [B] the score r_i of each answer.
        kl_rewards: [T'] the KL penalty per token (0 with ``kl_ctl=0``).
        gae_advantages: [T'] GAE's advantages over ``kl_rewards`` + the score at the last
            step, with the critic's values (or V = 0).
        loss_mask: [T'] bool, tokens that train (the others get 0 where noted).
        short1cu_seqlens: [B+1] offsets; no_eos: [B] bool, answers cut before EOS.
        group_size, discount, adv_norm, group_adv_norm: the ``ppo.*`` options.
    """

    score: torch.Tensor
    kl_rewards: torch.Tensor
    gae_advantages: torch.Tensor
    loss_mask: torch.Tensor
    short1cu_seqlens: torch.Tensor
    no_eos: torch.Tensor
    group_size: int
    discount: float = 1.0
    adv_norm: bool = True
    group_adv_norm: bool = False


class BatchOps(Protocol):
    """The two steps an estimator needs beyond its batch; the caller owns both."""

    def normalize(self, x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / (std + eps)`` with the moments over every rank's valid tokens."""

    def check_groups(self, user: str) -> None:
        """Raise, naming ``user``, unless every item holds ``group_size`` answers."""


#: ``(inputs, ops) -> (advantages before normalisation, advantages)``, both [T']
Compute = Callable[[AdvantageInputs, BatchOps], Tuple[torch.Tensor, torch.Tensor]]
#: ``(scores [n_groups, G] float64, eps) -> advantages [n_groups, G]``
GroupFn = Callable[[torch.Tensor, float], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator: what it asks of the run and how it computes.

    Attributes:
        name: its ``adv_estimator`` value.
        summary: its formula, one line (``--help``).
        outcome: starts from the answers' scores and uses no critic (``disable_value=true``).
        min_group_size: the fewest answers per prompt it works with; above 1 it compares
            the answers of a group, so every item must hold ``group_size`` of them.
        kl_in_reward: the per-token rewards reach its advantages, so ``kl_ctl > 0`` acts
            (otherwise the config refuses ``kl_ctl > 0``).
        group_fn: an estimator that is a function of its group's scores only gives it
            here (one advantage per answer, on every valid token) ...
        compute: ... any other gives its whole computation.
    """

    name: AdvEstimator
    summary: str
    outcome: bool
    min_group_size: int
    kl_in_reward: bool
    group_fn: Optional[GroupFn] = None
    compute: Optional[Compute] = None

    def __post_init__(self):
        if (self.group_fn is None) == (self.compute is None):
            raise TypeError(f"estimator {self.name!r}: give exactly one of group_fn, compute")

    def advantages(self, inp: AdvantageInputs, ops: BatchOps) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(before normalisation, advantages)``, both [T'] (see :class:`AdvantageInputs`)."""
        if self.min_group_size > 1:
            ops.check_groups(f"adv_estimator={self.name}")
        if self.compute is not None:
            return self.compute(inp, ops)
        adv = per_token(
            group_outcome_advantages(inp.score, inp.group_size, self.name), inp.short1cu_seqlens
        )
        adv = torch.where(inp.loss_mask, adv, torch.zeros_like(adv))
        return adv, adv


# ---- the estimators' maths


def _gae(inp: AdvantageInputs, ops: BatchOps) -> Tuple[torch.Tensor, torch.Tensor]:
    adv = inp.gae_advantages
    if inp.adv_norm and inp.group_adv_norm:
        ops.check_groups("group_adv_norm")
        return adv, F.group_normalize_advantages(
            adv, inp.loss_mask, inp.short1cu_seqlens, inp.group_size
        )
    if inp.adv_norm:
        return adv, ops.normalize(adv, inp.loss_mask)
    return adv, adv


def _grpo(r: torch.Tensor, eps: float) -> torch.Tensor:
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


def _drgrpo(r: torch.Tensor, eps: float) -> torch.Tensor:
    return r - r.mean(dim=1, keepdim=True)


def _rloo(r: torch.Tensor, eps: float) -> torch.Tensor:
    # mean of the others: (sum - r_i) / (G - 1)
    return r - (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


def _reinforce_pp(
    inp: AdvantageInputs, ops: BatchOps, baseline: bool
) -> Tuple[torch.Tensor, torch.Tensor]:
    # The critic-free return of every token, the discounted reward-to-go of the KL penalty
    # and the score (GAE with V = 0 and lambda = 1), normalised over the whole batch.
    score, g = inp.score, inp.group_size
    if baseline:
        score = score - score.view(-1, g).mean(dim=1).repeat_interleave(g)
    rewards = inp.kl_rewards.clone()
    rewards.index_add_(0, inp.short1cu_seqlens[1:].long() - 1, score.float())
    zeros = torch.zeros(rewards.shape[0] + score.numel(), device=rewards.device)
    returns, _ = F.compute_gae(rewards, zeros, inp.short1cu_seqlens, inp.no_eos, inp.discount, 1.0)
    return returns, ops.normalize(returns, inp.loss_mask)


#: every estimator, by name
ESTIMATORS: Dict[AdvEstimator, Estimator] = {
    e.name: e
    for e in (
        Estimator(
            AdvEstimator.GAE,
            "GAE over the per-token rewards with the critic's values (0 with "
            "disable_value), then adv_norm / group_adv_norm",
            outcome=False,
            min_group_size=1,
            kl_in_reward=True,
            compute=_gae,
        ),
        Estimator(
            AdvEstimator.GRPO,
            "(r_i - mean_G r) / (std_G r + 1e-6), sample std over the group's answers",
            outcome=True,
            min_group_size=2,
            kl_in_reward=False,
            group_fn=_grpo,
        ),
        Estimator(
            AdvEstimator.DRGRPO,
            "r_i - mean_G r",
            outcome=True,
            min_group_size=2,
            kl_in_reward=False,
            group_fn=_drgrpo,
        ),
        Estimator(
            AdvEstimator.RLOO,
            "r_i - mean of the other answers' r",
            outcome=True,
            min_group_size=2,
            kl_in_reward=False,
            group_fn=_rloo,
        ),
        Estimator(
            AdvEstimator.REINFORCE_PP,
            "reward-to-go (discount) of the per-token rewards (kl_ctl penalty + score at the "
            "end), normalised over the whole batch",
            outcome=True,
            min_group_size=1,
            kl_in_reward=True,
            compute=functools.partial(_reinforce_pp, baseline=False),
        ),
        Estimator(
            AdvEstimator.REINFORCE_PP_BASELINE,
            "as reinforce++ with r_i - mean_G r as the score",
            outcome=True,
            min_group_size=2,
            kl_in_reward=True,
            compute=functools.partial(_reinforce_pp, baseline=True),
        ),
    )
}


def estimator(name: object, field: str = "adv_estimator") -> Estimator:
    """The registered estimator called ``name``; a ValueError naming ``field`` and the
    registered names otherwise."""
    return ESTIMATORS[AdvEstimator.parse(name, field)]


# ---- pieces the estimators and the PPO batch share


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
        estimator: an estimator with a ``group_fn`` (``grpo``, ``drgrpo``, ``rloo``; see
            the module docstring).
        eps: added to the std (``grpo``): a group whose answers scored the same gets 0.

    Returns:
        [B] float32, computed in float64.
    """
    group_fns = {name: e.group_fn for name, e in ESTIMATORS.items() if e.group_fn is not None}
    if estimator not in group_fns:
        raise ValueError(f"estimator={estimator!r}: use one of {[str(n) for n in group_fns]}")
    n = scores.numel()
    if group_size < 2 or n % group_size != 0:
        raise ValueError(
            f"{estimator} compares each answer with the others of its group: need group_size "
            f">= 2 dividing the {n} answers, got group_size={group_size}"
        )
    adv = group_fns[estimator](scores.double().view(-1, group_size), eps)
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
