"""PPO / GRPO maths as small pure functions over packed, shifted tensors.

Shapes follow :mod:`realhf.impl.model.utils.functional`: B sequences of lengths L_i; shifted
tensors (log-probs, rewards, advantages, loss masks) have L_i - 1 entries per sequence,
T' = sum (L_i - 1) in all, offsets ``short1cu_seqlens`` [B+1]; values have L_i entries per
sequence (T' + B in all; sequence i starts at ``short1cu_seqlens[i] + i``).

Pieces, in the order a PPO step uses them:

1. :func:`get_packed_rewards` — per-token KL penalty plus the clipped task score at the last step.
2. :func:`compute_gae` — generalised advantage estimation (the packed C++ kernel).
3. :func:`normalize_advantages` / :func:`group_normalize_advantages` — global or per-group (GRPO).
   Outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++) and reward shaping live in
   :mod:`realhf.impl.algorithms.advantages`.
4. :func:`actor_loss_terms` → :func:`actor_loss_from_terms` (or both at once,
   :func:`actor_loss_fn`) — clipped / dual-clipped / decoupled PPO policy loss and its
   variants (clip-higher, GSPO, truncated importance sampling, KL and entropy terms, loss
   aggregation), built from :func:`clipped_surrogate` and :func:`behaviour_weight`; defined
   in :mod:`realhf.impl.algorithms.policy_loss` and re-exported here.
5. :func:`critic_loss_fn` and :class:`ExponentialRunningMeanStd` — value loss and value scaling.
6. :class:`FixedKLController` / :class:`AdaptiveKLController` — the KL coefficient beta.

Nothing here runs a collective. Where a statistic must be global over data-parallel ranks
(advantage mean/std, the value normaliser's moments, the early-stop importance ratio), the
function takes or returns plain sums and the interface all-reduces them in between
(:mod:`realhf.impl.model.interface.ppo.ppo_interface`, ``ppo_data``, ``critic_interface``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from realhf.impl.algorithms.policy_loss import (
    PolicyLossTerms,
    actor_loss_fn,
    actor_loss_from_terms,
    actor_loss_terms,
    behaviour_weight,
    clipped_surrogate,
)
from realhf.impl.model.utils.functional import (
    check_cu_seqlens,
    masked_mean,
    masked_moments,
    masked_normalization,
)

__all__ = [
    "get_packed_rewards",
    "compute_gae",
    "normalize_advantages",
    "group_normalize_advantages",
    "PolicyLossTerms",
    "clipped_surrogate",
    "behaviour_weight",
    "actor_loss_terms",
    "actor_loss_from_terms",
    "actor_loss_fn",
    "critic_loss_fn",
    "ExponentialRunningMeanStd",
    "FixedKLController",
    "AdaptiveKLController",
]


def get_packed_rewards(
    kl_ctl: float,
    clip_reward_value: float,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    reward_score: torch.Tensor,
    short1cu_seqlens: torch.Tensor,
    seq_no_eos_mask: torch.Tensor,
    mask_no_eos_with_zero: bool = False,
    loss_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``r_t = -kl_ctl * (logp_t - ref_logp_t)``, plus the sequence score at
    its last step.

    Args:
        kl_ctl: the KL coefficient beta (>= 0).
        clip_reward_value: the score is clipped to ``[-clip, clip]``.
        log_probs: [T'] behaviour log-probs (of the sampled tokens).
        ref_log_probs: [T'] reference-model log-probs (zeros when beta = 0).
        reward_score: [B] one score per sequence.
        short1cu_seqlens: [B+1] offsets of the shifted tensors; every sequence needs >= 1 entry.
        seq_no_eos_mask: [B] bool, True for sequences cut before EOS (truncated).
        mask_no_eos_with_zero: truncated sequences get score 0 instead of their score.
        loss_mask: [T'] bool, tokens that carry the KL term (generated tokens); None = all.

    Returns:
        ``(kl_rewards, total_rewards)``, both [T'] float32.
    """
    n = log_probs.shape[0]
    check_cu_seqlens(short1cu_seqlens, total=n, min_len=1, name="short1cu_seqlens")
    bsz = short1cu_seqlens.numel() - 1
    if ref_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"ref_log_probs {tuple(ref_log_probs.shape)} must match log_probs "
            f"{tuple(log_probs.shape)}"
        )
    if reward_score.shape != (bsz,) or seq_no_eos_mask.shape != (bsz,):
        raise ValueError(
            f"reward_score {tuple(reward_score.shape)} and seq_no_eos_mask "
            f"{tuple(seq_no_eos_mask.shape)} must both be [B] = [{bsz}]"
        )
    kl = -kl_ctl * (log_probs.float() - ref_log_probs.float())
    if loss_mask is not None:
        kl = torch.where(loss_mask.bool(), kl, torch.zeros_like(kl))
    score = reward_score.float().clamp(-clip_reward_value, clip_reward_value)
    if mask_no_eos_with_zero:
        score = torch.where(seq_no_eos_mask.bool(), torch.zeros_like(score), score)
    # The score is the reward of the last step: the shifted entry that predicts the final
    # token (EOS, or the last token of a truncated answer).
    total = kl.clone()
    total.index_add_(0, short1cu_seqlens[1:].long() - 1, score)
    return kl, total


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    short1cu_seqlens: torch.Tensor,
    seq_no_eos_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a packed batch.

    Args:
        rewards: [T'] per-step rewards.
        values: [T' + B] value of every token (L_i per sequence).
        short1cu_seqlens: [B+1] offsets of ``rewards``.
        seq_no_eos_mask: [B] bool; truncated sequences bootstrap from the value of their last
            token, sequences that ended with EOS use 0 after their last step.
        gamma, lam: discount and GAE lambda.

    Returns:
        ``(advantages, returns)``, both [T']: ``delta_t = r_t + gamma * V_{t+1} - V_t``,
        ``A_t = delta_t + gamma * lam * A_{t+1}``, ``R_t = A_t + V_t``.
    """
    from realhf.impl.kernels import gae_packed

    bsz = short1cu_seqlens.numel() - 1
    check_cu_seqlens(short1cu_seqlens, total=rewards.shape[0], min_len=1, name="short1cu_seqlens")
    if values.shape != (rewards.shape[0] + bsz,):
        raise ValueError(
            f"values must be [T' + B] = [{rewards.shape[0] + bsz}], got {tuple(values.shape)}"
        )
    # The kernel computes float16/bfloat16 in float32 and returns rewards' dtype.
    return gae_packed(
        rewards, values, short1cu_seqlens, seq_no_eos_mask.bool(), float(gamma), float(lam)
    )


def normalize_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps: float = 1e-5,
    moments: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(A - mean) / (std + eps)`` over valid tokens, in float64.

    Args:
        advantages: [T'].
        loss_mask: [T'] bool; invalid tokens come out as 0.
        moments: [3] statistics to normalise with: the
            :func:`~realhf.impl.model.utils.functional.masked_moments` of ``advantages``
            summed over the data-parallel ranks, so that every rank uses the global mean and
            std. None: this batch's own.
    """
    return masked_normalization(advantages, loss_mask, eps=eps, moments=moments)


def group_normalize_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    short1cu_seqlens: torch.Tensor,
    group_size: int,
    eps: float = 1e-5,
) -> torch.Tensor:
    """GRPO normalisation: like :func:`normalize_advantages` but separately for each block of
    ``group_size`` consecutive sequences (the answers to one prompt).  Local, no all-reduce.

    Args:
        advantages: [T'].
        loss_mask: [T'] bool; invalid tokens come out as 0.
        short1cu_seqlens: [B+1] offsets; B must be a multiple of ``group_size``.

    A group whose answers all got the same reward has std 0 and gets advantages ~0.
    """
    n = advantages.shape[0]
    check_cu_seqlens(short1cu_seqlens, total=n, min_len=0, name="short1cu_seqlens")
    bsz = short1cu_seqlens.numel() - 1
    if group_size < 1 or bsz % group_size != 0:
        raise ValueError(f"{bsz} sequences cannot be cut into groups of group_size={group_size}")
    lens = (short1cu_seqlens[1:] - short1cu_seqlens[:-1]).long()
    gid = torch.repeat_interleave(torch.arange(bsz, device=advantages.device) // group_size, lens)
    mask = loss_mask.bool()
    x = torch.where(
        mask, advantages.double(), torch.zeros((), dtype=torch.float64, device=advantages.device)
    )
    n_groups = bsz // group_size
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=advantages.device)
    s = zeros.index_add(0, gid, x)
    sq = zeros.index_add(0, gid, x * x)
    cnt = zeros.index_add(0, gid, mask.double()).clamp(min=1.0)
    mean = s / cnt
    # Population std from the moments; clamp: equal rewards can round to a tiny negative.
    std = (sq / cnt - mean * mean).clamp(min=0.0).sqrt()
    out = (advantages.double() - mean[gid]) / (std[gid] + eps)
    return torch.where(mask, out, torch.zeros_like(out)).to(advantages.dtype)


def critic_loss_fn(
    value: torch.Tensor,
    old_value: torch.Tensor,
    target_value: torch.Tensor,
    value_eps_clip: float,
    loss_mask: torch.Tensor,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss: masked mean of ``max(½(V - R)², ½(V_old + clip(V - V_old, ±eps) - R)²)``.

    Args:
        value: [T'] current values V (with grad).
        old_value: [T'] values when the batch was collected.
        target_value: [T'] returns R.
        value_eps_clip: how far V may move from V_old before the clipped term dominates.
        loss_mask: [T'] bool.

    Returns:
        ``(loss, {"clip_ratio": fraction of valid tokens where the clipped term was larger})``.
    """
    if not value_eps_clip > 0:
        raise ValueError(f"value_eps_clip must be > 0, got {value_eps_clip}")
    mask = loss_mask.bool()
    v = value.float()
    old = old_value.detach().float()
    ret = target_value.detach().float()
    # The clipped term keeps the value from moving more than eps from the one the batch was
    # collected with (the value-side analogue of the ratio clip).
    clipped_v = old + (v - old).clamp(-value_eps_clip, value_eps_clip)
    l_plain = 0.5 * (v - ret) ** 2
    l_clip = 0.5 * (clipped_v - ret) ** 2
    loss = masked_mean(torch.maximum(l_plain, l_clip), mask)
    return loss, {"clip_ratio": masked_mean((l_clip > l_plain).float().detach(), mask)}


class ExponentialRunningMeanStd(torch.nn.Module):
    """Running statistics of returns for value normalisation (EMA, debiased).

    The critic predicts normalised values; returns are normalised before the loss and
    predictions denormalised before GAE.  State lives in float64 buffers, so it is saved and
    restored with the model's ``state_dict``.

    Args:
        beta: EMA decay (0.99995: statistics change slowly over thousands of batches).
        eps: floor of the debiasing term.
        var_min: variance floor (keeps early, tiny-variance batches from exploding values).
        clip: normalised values are clipped to ``[-clip, clip]``.
    """

    def __init__(
        self, beta: float = 0.99995, eps: float = 1e-5, var_min: float = 1e-2, clip: float = 5.0
    ):
        super().__init__()
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must be in (0, 1), got {beta}")
        self.beta, self.eps, self.var_min, self.clip = beta, eps, var_min, clip
        for name in ("running_mean", "running_mean_sq", "debiasing_term"):
            self.register_buffer(name, torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None):
        """Fold the valid entries of ``x`` [N] (this process's only) into the EMAs."""
        self.update_from_moments(masked_moments(x, mask))

    @torch.no_grad()
    def update_from_moments(self, moments: torch.Tensor):
        """Fold a batch given by its :func:`~realhf.impl.model.utils.functional.masked_moments`
        ``[sum, sum of squares, count]`` into the EMAs; data-parallel callers pass the moments
        summed over ranks, so every replica keeps the same statistics. An empty batch is a
        no-op."""
        stats = moments.double()
        if stats[2] == 0:
            return
        # The EMAs start at 0; debiasing_term (1 - beta^t after t updates) undoes the pull
        # towards 0, as Adam's bias correction does.
        b = self.beta
        self.running_mean.mul_(b).add_((1 - b) * stats[0] / stats[2])
        self.running_mean_sq.mul_(b).add_((1 - b) * stats[1] / stats[2])
        self.debiasing_term.mul_(b).add_(1 - b)

    def mean_std(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Debiased mean and std (float64 scalars); std >= sqrt(var_min)."""
        d = self.debiasing_term.clamp(min=self.eps)
        mean = self.running_mean / d
        var = (self.running_mean_sq / d - mean * mean).clamp(min=self.var_min)
        return mean, var.sqrt()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``clip((x - mean) / std, ±clip)`` in ``x``'s dtype."""
        mean, std = self.mean_std()
        return ((x.double() - mean) / std).clamp(-self.clip, self.clip).to(x.dtype)

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x * std + mean`` in ``x``'s dtype."""
        mean, std = self.mean_std()
        return (x.double() * std + mean).to(x.dtype)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the interface is shared with :class:`AdaptiveKLController`)."""


class AdaptiveKLController:
    """Moves beta towards a target KL (Ziegler et al., 2019).

    ``beta <- beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``: above the
    target beta grows, below it shrinks, by at most 20 % per ``horizon`` steps.
    """

    def __init__(self, init_kl_coef: float, target: float = 6.0, horizon: float = 10000.0):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_kl_coef >= 0, target > 0, horizon > 0; got {init_kl_coef}, {target}, "
                f"{horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust beta after ``n_steps`` samples/steps that showed mean KL ``current_kl``."""
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
