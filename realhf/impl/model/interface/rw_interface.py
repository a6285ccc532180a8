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

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.base import stats_tracker
from realhf.impl.algorithms.preference import (
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
    """

    def __init__(self, output_scaling: float = 1.0, output_bias: float = 0.0):
        for name, v in (("output_scaling", output_scaling), ("output_bias", output_bias)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"rw {name}={v!r}: use a finite number")
        self.output_scaling = float(output_scaling)
        self.output_bias = float(output_bias)

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """One optimizer step on the pairs of ``data``; returns reduced statistics."""
        require_keys(data, _KEYS, "rw train_step")
        check_pairs(data, "rw train_step")
        engine = engine_of(model, train=True)

        def loss_fn(out: torch.Tensor, mb: SequenceSample):
            return bradley_terry_loss(*split_pairs(_rewards(out, mb)))

        st = engine.train_batch(
            data.select(_KEYS),
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
            data.select(_KEYS), mb_spec, _rewards, [[1, 1] for _ in data.ids]
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
        scores = engine.forward(data.select(keys), mb_spec, _rewards, lens).float().cpu()
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
