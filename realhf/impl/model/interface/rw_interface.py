"""Bradley–Terry reward model (``rw``): a scalar head scores whole answers.

The model is a ReaLModel built with ``is_critic=True`` (one value per token, the critic's
architecture); a sequence's reward is the value at its last token (the EOS that ends the
answer), so a saved checkpoint serves later as a critic-style reward model.

Input: items of two sequences each, chosen first (``paired_dataset``), keys
``packed_input_ids`` and ``prompt_mask`` (the shared prompt is computed once per item).

- ``train_step``: one optimizer step on the Bradley–Terry loss
  (:func:`~realhf.impl.algorithms.preference.bradley_terry_loss`), micro-batches weighted
  by pairs; stats
  ``rw/loss``, ``rw/pair_acc``, ``rw/margin``, ``rw/chosen``, ``rw/rejected``,
  ``rw/grad_norm``, ``rw/lr``, ``rw/n_pairs``. Advances ``model.version``.
  With ``lm_coef > 0`` the loss adds ``lm_coef`` × the language-model loss of the chosen
  answers (mean negative log-likelihood of their tokens and EOS): the body keeps learning
  to produce correct answers while the head learns to rank them, which is what lets a
  reward model tell a right answer from its policy's own likely mistakes (the regulariser
  of Yang et al. 2024, "Regularizing hidden states enables learning generalizable reward
  model for LLMs").  The model must then return logits too
  (``ModelSpec.critic_lm_logits``: ``[T, 1 + vocab]``, column 0 the value); stats add
  ``rw/bt_loss`` and ``rw/lm_loss`` (``rw/loss`` is their weighted sum).
- ``evaluate``: the same loss and pair accuracy without gradients on held-out pairs:
  ``rw_eval/loss``, ``rw_eval/pair_acc``, ``rw_eval/margin`` (means over items).
- ``inference``: ``rewards`` (one per sequence) of any sample with ``packed_input_ids``:
  ``(score - output_bias) * output_scaling``; stats ``rw/score`` (the raw scores' mean).
  In ``ppo-math`` with ``reward_model.path`` this is the ``rm_inf`` MFC, which scores every
  generated answer beside the verifier.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, keys_with_images
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.base import stats_tracker
from realhf.impl.algorithms.preference import (
    answer_logprob_sums,
    bradley_terry_loss,
    sequence_last_values,
    split_pairs,
)
from realhf.impl.model.interface.helpers import (
    engine_of,
    export_stats,
    require_keys,
    seqs_per_item,
)
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

__all__ = ["RewardModelInterface", "check_pairs"]

_KEYS = ("packed_input_ids", "prompt_mask")


def check_pairs(data: SequenceSample, who: str) -> None:
    """Fail unless every item holds exactly two sequences (chosen, rejected)."""
    bad = [(i, n) for i, n in zip(data.ids, seqs_per_item(data)) if n != 2]
    if bad:
        raise ValueError(
            f"{who} needs items of 2 sequences (chosen, rejected); item {bad[0][0]!r} has "
            f"{bad[0][1]}. Load the data with the 'paired' dataset"
        )


def _scalar_values(out: torch.Tensor) -> torch.Tensor:
    """The per-token values of a critic's output: ``[T]``, or column 0 of the ``[T, 1 +
    vocab]`` output of a critic that also returns logits (``critic_lm_logits``)."""
    if out.dim() == 2 and out.shape[1] > 1:
        out = out[:, 0]
    if out.dim() != 1:
        raise ValueError(
            f"rw got outputs of shape {tuple(out.shape)}; the reward model must be a ReaLModel "
            "with is_critic=True (one value per token)"
        )
    return out.float()


def _rewards(out: torch.Tensor, mb: SequenceSample) -> torch.Tensor:
    return sequence_last_values(_scalar_values(out), mb.cu_seqlens("packed_input_ids"))


class RewardModelInterface(ModelInterface):
    """Bradley–Terry reward model (see the module docstring).

    Args:
        output_scaling, output_bias: ``inference`` returns ``(score - output_bias) *
            output_scaling`` (as ``math_reward`` does with its ±1 verdict).
        lm_coef: >= 0; weight of the chosen answers' language-model loss in
            ``train_step`` (0: the plain Bradley–Terry loss).
    """

    def __init__(self, output_scaling: float = 1.0, output_bias: float = 0.0, lm_coef: float = 0.0):
        for name, v in (
            ("output_scaling", output_scaling),
            ("output_bias", output_bias),
            ("lm_coef", lm_coef),
        ):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"rw {name}={v!r}: use a finite number")
        if lm_coef < 0:
            raise ValueError(f"rw lm_coef={lm_coef!r}: use a number >= 0 (0 turns it off)")
        self.output_scaling = float(output_scaling)
        self.output_bias = float(output_bias)
        self.lm_coef = float(lm_coef)

    def _loss(self, out: torch.Tensor, mb: SequenceSample, tp):
        """Bradley–Terry loss of ``mb``'s pairs, plus ``lm_coef`` × the chosen answers'
        mean token negative log-likelihood."""
        loss, st = bradley_terry_loss(*split_pairs(_rewards(out, mb)))
        if self.lm_coef == 0:
            return loss, st
        if out.dim() != 2:
            raise ValueError(
                f"rw lm_coef={self.lm_coef} needs the model's logits as well as its values; "
                "build the reward model with critic_lm_logits=True (the rw experiment does "
                "when lm_coef > 0)"
            )
        dev = out.device
        cu = mb.cu_seqlens("packed_input_ids").to(dev)
        ids = mb.data["packed_input_ids"].to(dev)
        mask = mb.data["prompt_mask"].to(dev)
        logp = gather_packed_shifted_log_probs(out[:, 1:], cu, ids, 1.0, tp=tp)
        chosen_sum = split_pairs(answer_logprob_sums(logp, cu, mask))[0].sum()
        n_tokens = split_pairs(answer_logprob_sums(torch.ones_like(logp), cu, mask))[0].sum()
        lm_loss = -chosen_sum / n_tokens.clamp(min=1)
        st = dict(st, bt_loss=loss.detach(), lm_loss=lm_loss.detach())
        return loss + self.lm_coef * lm_loss, st

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """One optimizer step on the pairs of ``data``; returns reduced statistics."""
        require_keys(data, _KEYS, "rw train_step")
        check_pairs(data, "rw train_step")
        engine = engine_of(model, train=True)

        def loss_fn(out: torch.Tensor, mb: SequenceSample):
            return self._loss(out, mb, engine.tp)

        st = engine.train_batch(
            data.select(keys_with_images(data, _KEYS)),
            mb_spec,
            loss_fn,
            len,  # one pair per item: pairs weigh equally in the global mean
            version_steps=model.version.global_step,
        )
        model.inc_version()
        with stats_tracker.scope("rw"):
            stats_tracker.scalar(
                **{k: st[k] for k in ("loss", "pair_acc", "margin", "chosen", "rejected")},
                grad_norm=st["grad_norm"],
                lr=st["lr"],
                n_pairs=st["n_tokens"],
            )
            if self.lm_coef > 0:
                stats_tracker.scalar(bt_loss=st["bt_loss"], lm_loss=st["lm_loss"])
            stats_tracker.scalar(reduce_type="sum", skipped_steps=st["skipped"])
        return export_stats(engine.dp_group)

    def evaluate(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """Loss, pair accuracy and margin on held-out pairs (means over this shard's items)."""
        require_keys(data, _KEYS, "rw evaluate")
        check_pairs(data, "rw evaluate")
        engine = engine_of(model)
        rewards = engine.forward(
            data.select(keys_with_images(data, _KEYS)),
            mb_spec,
            _rewards,
            [[1, 1] for _ in data.ids],
        ).double()
        loss, st = bradley_terry_loss(*split_pairs(rewards))
        return {
            "rw_eval/loss": float(loss),
            "rw_eval/pair_acc": float(st["pair_acc"]),
            "rw_eval/margin": float(st["margin"]),
        }

    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """The reward of every sequence (key ``rewards``, one per sequence, float32)."""
        require_keys(data, ["packed_input_ids"], "rw inference")
        engine = engine_of(model)
        keys = [k for k in _KEYS if k in data.keys]
        lens = [[1] * n for n in seqs_per_item(data)]
        scores = (
            engine.forward(data.select(keys_with_images(data, keys)), mb_spec, _rewards, lens)
            .float()
            .cpu()
        )
        with stats_tracker.scope("rw"):
            stats_tracker.denominator(n_scored=torch.ones_like(scores, dtype=torch.bool))
            stats_tracker.stat(denominator="n_scored", score=scores)
        rewards = (scores - self.output_bias) * self.output_scaling
        return SequenceSample(
            keys={"rewards"},
            trailing_shapes={"rewards": ()},
            dtypes={"rewards": torch.float32},
            ids=list(data.ids),
            seqlens={"rewards": lens},
            data={"rewards": rewards},
        )


register_interface("rw", RewardModelInterface)
