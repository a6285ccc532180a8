"""Losses on preference pairs: Bradley–Terry reward modelling, DPO and IPO.

Pure functions over per-pair tensors; the interfaces (``rw_interface``, ``dpo_interface``
in :mod:`realhf.impl.model.interface`) only gather the inputs. A batch of P pairs is laid
out as 2P sequences, chosen first: sequence 2i is pair i's chosen answer and 2i + 1 its
rejected one (``paired_dataset``).

- Bradley–Terry: ``L = mean_i −log σ(r_c,i − r_r,i)``; pair accuracy is the share of pairs
  with ``r_c > r_r`` (ties count as wrong).
- DPO: with ``h_i = (log π − log π_ref)(chosen_i) − (log π − log π_ref)(rejected_i)``, where
  ``log π(y|x)`` sums the answer tokens' log-probs, ``L = mean_i −log σ(β h_i)``.
- IPO: ``L = mean_i (h_i − 1/(2β))²``.
"""

from __future__ import annotations

import enum
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "PreferenceLoss",
    "split_pairs",
    "bradley_terry_loss",
    "pair_accuracy",
    "answer_logprob_sums",
    "sequence_last_values",
    "dpo_loss",
]


class PreferenceLoss(str, enum.Enum):
    """Which loss ``dpo`` optimises (``dpo.loss=dpo|ipo``)."""

    DPO = "dpo"
    IPO = "ipo"


def split_pairs(per_seq: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[2P]`` per-sequence values → ``([P] chosen, [P] rejected)``."""
    if per_seq.dim() != 1 or per_seq.numel() % 2:
        raise ValueError(
            f"expected one value per sequence of whole pairs (an even length), got shape "
            f"{tuple(per_seq.shape)}; each item must hold 2 sequences, chosen first"
        )
    return per_seq[0::2], per_seq[1::2]


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Bradley–Terry loss of scalar rewards.

    Args:
        chosen, rejected: [P] rewards of the chosen and rejected answer of each pair.

    Returns:
        ``(loss, stats)``: the mean of ``−log σ(chosen − rejected)`` and detached
        ``pair_acc``, ``margin`` (mean ``chosen − rejected``), ``chosen``, ``rejected`` means.
    """
    diff = chosen - rejected
    loss = -F.logsigmoid(diff).mean()
    return loss, {
        "pair_acc": pair_accuracy(chosen.detach(), rejected.detach()),
        "margin": diff.detach().mean(),
        "chosen": chosen.detach().mean(),
        "rejected": rejected.detach().mean(),
    }


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Share of pairs with ``chosen > rejected`` (a 0-d float tensor; ties are wrong)."""
    return (chosen > rejected).to(torch.float64).mean()


def answer_logprob_sums(
    logprobs: torch.Tensor, cu_seqlens: torch.Tensor, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """``log π(answer | prompt)`` of every sequence: the sum of its answer tokens' log-probs.

    Args:
        logprobs: [T - B] next-token log-probs (L - 1 per sequence: entry t of a sequence is
            the log-prob of its token t + 1).
        cu_seqlens: [B + 1] offsets of the full-length sequences.
        prompt_mask: [T] bool, True on prompt tokens.

    Returns:
        [B] sums over the predicted tokens that are not prompt tokens (the answer and EOS).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if logprobs.numel() != int(lens.sum()) - len(lens):
        raise ValueError(
            f"logprobs has {logprobs.numel()} entries; sequences of lengths {lens.tolist()} "
            "need L - 1 each"
        )
    seq = torch.repeat_interleave(torch.arange(len(lens), device=logprobs.device), lens - 1)
    keep = torch.ones(int(cu_seqlens[-1]), dtype=torch.bool, device=prompt_mask.device)
    keep[cu_seqlens[:-1].long()] = False  # the first token is predicted by nothing
    is_answer = ~prompt_mask.bool()[keep].to(logprobs.device)
    out = torch.zeros(len(lens), dtype=logprobs.dtype, device=logprobs.device)
    return out.index_add(0, seq, torch.where(is_answer, logprobs, torch.zeros_like(logprobs)))


def sequence_last_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] per-token values of a scalar-head model → [B] value at each sequence's last token
    (its EOS: the reward a reward model gives the whole answer)."""
    return values[cu_seqlens[1:].long().to(values.device) - 1]


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    kind: PreferenceLoss = PreferenceLoss.DPO,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """DPO or IPO loss of a batch of pairs.

    Args:
        pi_chosen, pi_rejected: [P] policy ``log π(y|x)`` (answer-token sums) of each pair.
        ref_chosen, ref_rejected: [P] the same under the frozen reference model.
        beta: > 0; DPO's inverse temperature, IPO's target margin is ``1/(2β)``.
        kind: ``dpo`` or ``ipo``.

    Returns:
        ``(loss, stats)``: the mean loss and detached ``reward_acc`` (share with h > 0),
        ``margin`` (mean β·h), ``chosen_reward`` / ``rejected_reward`` (means of
        β·(log π − log π_ref)).
    """
    if not beta > 0:
        raise ValueError(f"beta={beta!r}: use a positive number (e.g. 0.1)")
    chosen_ratio = pi_chosen - ref_chosen
    rejected_ratio = pi_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    kind = PreferenceLoss(kind)
    if kind is PreferenceLoss.DPO:
        loss = -F.logsigmoid(beta * h).mean()
    else:
        loss = ((h - 1.0 / (2.0 * beta)) ** 2).mean()
    h = h.detach()
    return loss, {
        "reward_acc": (h > 0).to(torch.float64).mean(),
        "margin": beta * h.mean(),
        "chosen_reward": beta * chosen_ratio.detach().mean(),
        "rejected_reward": beta * rejected_ratio.detach().mean(),
    }
