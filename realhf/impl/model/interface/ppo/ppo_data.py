"""From a batch of scored generations to per-token PPO targets (shared by actor and critic).

Input: a `SequenceSample` whose items are prompts, each carrying its answers (``group_size``
sequences, prompt + answer tokens each) with keys

=====================  ==============  ==================================================
key                    per sequence    meaning
=====================  ==============  ==================================================
packed_input_ids       L               prompt + answer tokens
prompt_mask            L               True on prompt tokens
packed_logprobs        L - 1           behaviour log-probs (0 over the prompt)
rewards                1               task reward (from the reward interface)
rm_rewards             1               optional: a reward model's score, added to rewards
seq_no_eos_mask        1               True when the answer was cut before EOS
packed_ref_logprobs    L - 1           reference log-probs (kl_ctl > 0 or kl_loss_coef > 0)
values                 L               critic values, denormalised (unless disable_value)
proximal_logprobs      L - 1           trainer recompute (recompute_logprob / decoupled loss)
=====================  ==============  ==================================================

:func:`prepare_ppo_batch` computes the loss mask (answer tokens, minus truncated
sequences with ``mask_too_long``, minus prompts filtered by success rate), the score of
each answer (``rewards`` [+ ``rm_rewards``], plus the overlong penalty, clipped; 0 for
truncated answers with ``mask_no_eos_with_zero``), the rewards (KL penalty per token + the
score at the last step), GAE advantages and returns, and the advantages of the
registered estimator ``adv_estimator`` names (:mod:`realhf.impl.algorithms.advantages`;
this module gives it the global normalisation and the group check, :class:`_BatchOps`).
Success-rate filtering lives here (the step that has every group's rewards): a group
whose share of answers with reward > 0 lies outside ``[success_rate_lb, success_rate_ub]``
is masked out of the loss rather than dropped, so every data-parallel rank keeps its batch
shape and collectives stay in step.
A reward of NaN means "no verdict" (the reward interface could not grade the row: a bad dataset row,
skipped with a warning there): its sequences are masked out the same way, their reward
read as 0, and counted (``ppo/n_unscored_seqs``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from realhf.api.core.data_api import SequenceSample, images_per_sequence
from realhf.base import stats_tracker
from realhf.impl.algorithms import advantages as A
from realhf.impl.algorithms import ppo as F
from realhf.impl.model.interface.helpers import seqs_per_item, sequence_ids
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.toolkit import (
    all_reduce_sum,
    answer_mask,
    require_keys,
    short1cu_seqlens,
)
from realhf.impl.model.utils.functional import masked_moments

__all__ = ["PPOBatch", "prepare_ppo_batch", "anchor_logprobs_key", "required_keys"]


def anchor_logprobs_key(hp: PPOHyperparameters) -> str:
    """The key holding the log-probs PPO's ratio is taken against (pi_old)."""
    if hp.recompute_logprob and not hp.use_decoupled_loss:
        return "proximal_logprobs"
    return "packed_logprobs"


@dataclasses.dataclass
class PPOBatch:
    """Per-token PPO targets of B sequences (T tokens, T' = T - B shifted entries).

    Attributes:
        seq_ids: ``"{item}@{j}"`` per sequence.
        seqlens: L per sequence.
        input_ids: [T]; cu_seqlens: [B+1] int32.
        prompt_mask: [T] bool, True on prompt tokens (lets the engines compute a prompt
            shared by a group of answers once).
        loss_mask: [T'] bool, tokens that train.
        old_logp: [T'] the PPO anchor (behaviour, or recomputed without the decoupled loss).
        proximal_logp: [T'] or None (decoupled loss only).
        values: [T] float32 (zeros with disable_value).
        ref_logp: [T'] reference log-probs, or None (only kept for the KL loss term).
        kl_rewards, rewards, advantages, returns: [T'] float32 (advantages normalised).
        mean_kl: global mean of ``old_logp - ref_logp`` over valid tokens.
        n_seqs_global: sequences over all data-parallel ranks.
    """

    seq_ids: List[str]
    seqlens: List[int]
    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    prompt_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logp: torch.Tensor
    proximal_logp: Optional[torch.Tensor]
    values: torch.Tensor
    ref_logp: Optional[torch.Tensor]
    kl_rewards: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    mean_kl: float
    n_seqs_global: int
    #: the sequences' images (one item per sequence), or None
    images: Optional[SequenceSample] = None

    def to_sample(self, **extra: torch.Tensor) -> SequenceSample:
        """One item per sequence with the keys the actor loss needs (``packed_input_ids``,
        ``prompt_mask``, ``ppo_loss_mask``, ``old_logp``, ``advantages``, ``proximal_logprobs`` when
        decoupled, ``ref_logp`` for the KL loss term) plus ``extra`` keys (standard names, e.g.
        ``values``, ``returns``)."""
        data: Dict[str, torch.Tensor] = {
            "packed_input_ids": self.input_ids,
            "prompt_mask": self.prompt_mask,
            "ppo_loss_mask": self.loss_mask,
            "old_logp": self.old_logp,
            "advantages": self.advantages,
        }
        if self.proximal_logp is not None:
            data["proximal_logprobs"] = self.proximal_logp
        if self.ref_logp is not None:
            data["ref_logp"] = self.ref_logp
        data.update(extra)
        out = SequenceSample.from_default(ids=self.seq_ids, seqlens=self.seqlens, data=data)
        if self.images is not None:
            out.update_(self.images)
        return out


# Long on purpose: one pipeline (mask -> rewards -> KL -> GAE -> normalisation) whose steps
# share the packed layout and run in this order on every rank; the maths of each step is
# a pure function in realhf.impl.algorithms.ppo.
def prepare_ppo_batch(
    hp: PPOHyperparameters,
    data: SequenceSample,
    kl_coef: float,
    dp_group=None,
    record_stats: bool = True,
    device: Optional[torch.device] = None,
) -> PPOBatch:
    """Loss mask, rewards, GAE and normalised advantages (see the module docstring).

    Every data-parallel rank must call it (global advantage normalisation and the KL
    mean are all-reduced over ``dp_group``). The maths runs on ``device`` (the model's:
    nccl reduces device tensors only) and the returned tensors stay there. With
    ``record_stats`` it records reward, KL, advantage and length statistics into the
    process stats tracker (scope ``ppo``).
    """
    require_keys(data, required_keys(hp, kl_coef), "PPO training")
    # One straight pipeline (mask -> rewards -> GAE -> normalisation -> global KL): its
    # stages share many intermediate tensors, so it reads best top to bottom in one place.

    device = torch.device("cpu") if device is None else torch.device(device)
    tensors = {k: v.to(device) for k, v in data.data.items() if v is not None}
    ids = tensors["packed_input_ids"]
    cu = data.cu_seqlens("packed_input_ids").to(device)
    seqlens = data.flat_seqlens("packed_input_ids")
    if min(seqlens) < 2:
        raise ValueError(
            f"PPO needs sequences of at least 2 tokens (prompt + answer), got lengths {seqlens}"
        )
    short1 = short1cu_seqlens(cu)
    n_seq = len(seqlens)
    shifted_lens = torch.tensor([l - 1 for l in seqlens], device=device)

    no_eos = tensors["seq_no_eos_mask"].bool().view(-1)
    raw_reward = tensors["rewards"].float().view(-1)
    if "rm_rewards" in tensors:  # a reward model scored the answers beside the verifier
        raw_reward = raw_reward + tensors["rm_rewards"].float().view(-1)
    if no_eos.numel() != n_seq or raw_reward.numel() != n_seq:
        raise ValueError(
            f"rewards ({raw_reward.numel()}) and seq_no_eos_mask ({no_eos.numel()}) need one entry "
            f"per sequence ({n_seq})"
        )

    unscored = torch.isnan(raw_reward)
    raw_reward = torch.where(unscored, torch.zeros_like(raw_reward), raw_reward)
    # Shifted entry t predicts token t+1: it trains when that token is part of the answer.
    loss_mask = answer_mask(tensors["prompt_mask"], cu)
    keep_seq = ~unscored
    if hp.mask_too_long:
        keep_seq &= ~no_eos
    n_filtered = 0
    if hp.filters_by_success_rate:
        keep_seq, n_filtered = _filter_groups(hp, data, raw_reward, keep_seq)
    loss_mask &= torch.repeat_interleave(keep_seq, shifted_lens)

    old_logp = tensors[anchor_logprobs_key(hp)].float()
    prox = None
    if hp.use_decoupled_loss and not hp.proximal_from_train_forward:
        prox = tensors["proximal_logprobs"].float()
    ref = tensors.get("packed_ref_logprobs")
    # Without a KL term the reference model is not run; zeros make the KL reward 0.
    use_ref = (kl_coef > 0 or hp.kl_loss_coef > 0) and ref is not None
    ref = ref.float() if use_ref else torch.zeros_like(old_logp)
    score = _answer_scores(hp, raw_reward, tensors["prompt_mask"], cu, no_eos)
    kl_rewards, rewards = F.get_packed_rewards(
        kl_coef,
        hp.max_reward_clip,
        old_logp,
        ref,
        score,
        short1,
        no_eos,
        mask_no_eos_with_zero=hp.mask_no_eos_with_zero,
        loss_mask=loss_mask,
    )
    # Without a critic, V = 0 makes GAE's advantages the discounted reward-to-go.
    if hp.disable_value:
        values = torch.zeros(ids.shape[0], dtype=torch.float32, device=device)
    else:
        values = tensors["values"].float()
    gae_adv, returns = F.compute_gae(rewards, values, short1, no_eos, hp.discount, hp.gae_lambda)
    inputs = A.AdvantageInputs(
        score=score,
        kl_rewards=kl_rewards,
        gae_advantages=gae_adv,
        loss_mask=loss_mask,
        short1cu_seqlens=short1,
        no_eos=no_eos,
        group_size=hp.group_size,
        discount=hp.discount,
        adv_norm=hp.adv_norm,
        group_adv_norm=hp.group_adv_norm,
    )
    raw_adv, advantages = hp.estimator.advantages(inputs, _BatchOps(hp, data, dp_group))

    kl = torch.where(loss_mask, old_logp - ref, torch.zeros_like(old_logp))
    # Sums, not means, are reduced: ranks hold different token and sequence counts.
    totals = torch.stack(
        [
            kl.double().sum(),
            loss_mask.sum().double(),
            torch.tensor(float(n_seq), dtype=torch.float64, device=device),
        ]
    )
    totals = all_reduce_sum(totals, dp_group).cpu()
    mean_kl = float(totals[0] / totals[1].clamp(min=1))

    if record_stats:
        _record_stats(
            seqlens, raw_reward, no_eos, keep_seq, loss_mask, raw_adv, kl_rewards, kl, returns
        )
        stats_tracker.scalar(reduce_type="sum", **{"ppo/n_filtered_groups": n_filtered})
        stats_tracker.scalar(reduce_type="sum", **{"ppo/n_unscored_seqs": int(unscored.sum())})
        stats_tracker.scalar(**{"ppo/kl_coef": kl_coef})
    seq_ids = sequence_ids(data)
    return PPOBatch(
        seq_ids=seq_ids,
        seqlens=seqlens,
        input_ids=ids,
        cu_seqlens=cu,
        prompt_mask=tensors["prompt_mask"].bool(),
        loss_mask=loss_mask,
        old_logp=old_logp,
        proximal_logp=prox,
        values=values,
        ref_logp=ref if hp.kl_loss_coef > 0 else None,
        kl_rewards=kl_rewards,
        rewards=rewards,
        advantages=advantages.float(),
        returns=returns.float(),
        mean_kl=mean_kl,
        n_seqs_global=int(totals[2]),
        images=images_per_sequence(data, seq_ids),
    )


def required_keys(hp: PPOHyperparameters, kl_coef: float) -> List[str]:
    """The input keys :func:`prepare_ppo_batch` needs under ``hp``."""
    needed = [
        "packed_input_ids",
        "prompt_mask",
        "rewards",
        "seq_no_eos_mask",
        anchor_logprobs_key(hp),
    ]
    if hp.use_decoupled_loss and not hp.proximal_from_train_forward:
        needed.append("proximal_logprobs")
    if kl_coef > 0 or hp.kl_loss_coef > 0:
        needed.append("packed_ref_logprobs")
    if not hp.disable_value:
        needed.append("values")
    return needed


def _answer_scores(hp, raw_reward, prompt_mask, cu, no_eos) -> torch.Tensor:
    """[B] the score r_i of each answer as every estimator sees it: the ``rewards`` key
    (already ``(verdict - reward_output_bias) * reward_output_scaling``: the reward
    interface or rollout agent applies them), shaped by length, clipped, and 0 for
    truncated answers with ``mask_no_eos_with_zero``."""
    score = raw_reward
    if hp.overlong_penalty_len > 0:
        per_seq = torch.tensor(
            [int(m.logical_not().sum()) for m in prompt_mask.bool().split(_lens(cu))],
            device=score.device,
        )
        score = score + A.overlong_penalty(
            per_seq,
            hp.gen.max_new_tokens,
            hp.overlong_penalty_len,
            hp.overlong_penalty_factor,
        )
    score = score.clamp(-hp.max_reward_clip, hp.max_reward_clip)
    if hp.mask_no_eos_with_zero:
        score = torch.where(no_eos, torch.zeros_like(score), score)
    return score


def _lens(cu: torch.Tensor) -> List[int]:
    return (cu[1:] - cu[:-1]).tolist()


def _global_normalize(x: torch.Tensor, loss_mask: torch.Tensor, dp_group) -> torch.Tensor:
    # Mean and std over every rank's valid tokens: sum the moments, then normalise.
    moments = all_reduce_sum(masked_moments(x, loss_mask), dp_group)
    return F.normalize_advantages(x, loss_mask, moments=moments)


class _BatchOps:
    """:class:`~realhf.impl.algorithms.advantages.BatchOps` of one batch on this rank."""

    def __init__(self, hp: PPOHyperparameters, data: SequenceSample, dp_group):
        self.hp, self.data, self.dp_group = hp, data, dp_group

    def normalize(self, x: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        return _global_normalize(x, loss_mask, self.dp_group)

    def check_groups(self, user: str) -> None:
        self.hp.rollout.check_groups(self.data, user)


def _record_stats(
    seqlens, reward, no_eos, keep_seq, loss_mask, adv, kl_rewards, kl, returns
) -> None:
    """Per-sequence and per-valid-token statistics under ``ppo/`` (token means are global)."""
    with stats_tracker.scope("ppo"):
        stats_tracker.denominator(
            n_seqs=torch.ones(len(seqlens), dtype=torch.bool), n_valid_tokens=loss_mask
        )
        stats_tracker.stat(
            denominator="n_seqs",
            task_reward=reward,
            no_eos_ratio=no_eos.float(),
            seq_len=torch.tensor(seqlens, dtype=torch.float32),
            kept_seq_ratio=keep_seq.float(),
        )
        stats_tracker.stat(
            denominator="n_valid_tokens",
            advantages=adv,
            kl_rewards=kl_rewards,
            ref_kl=kl,
            returns=returns,
        )


def _filter_groups(
    hp: PPOHyperparameters, data: SequenceSample, reward: torch.Tensor, keep: torch.Tensor
):
    """Mask every sequence of the items whose success rate is outside [lb, ub]."""
    counts = seqs_per_item(data)
    rates = A.group_success_rates(reward, counts)
    out = (rates < hp.success_rate_lb) | (rates > hp.success_rate_ub)
    keep = keep & ~torch.repeat_interleave(out, torch.tensor(counts))
    return keep, int(out.sum())
