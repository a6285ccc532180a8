"""Supervised fine-tuning (``sft``): cross entropy on answer tokens only.

Input keys: ``packed_input_ids`` (prompt + answer (+ EOS) per sequence) and
``prompt_mask`` (True on prompt tokens). A position is trained when the token it predicts
belongs to the answer. The loss is the mean over every answer token of the global batch
(micro-batches and data-parallel ranks weighted by their answer-token counts).

- ``train_step``: one optimizer step; stats ``sft/loss``, ``sft/ppl`` (exp of the
  step's loss), ``sft/n_tokens``, ``sft/grad_norm``, ``sft/lr``, ``sft/skipped_steps``.
  Advances ``model.version``.
- ``evaluate``: the same loss without gradients over a held-out sample; stats
  ``sft_eval/loss``, ``sft_eval/ppl``, ``sft_eval/n_tokens``.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, keys_with_images
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.base import stats_tracker
from realhf.impl.model.interface.helpers import (
    all_reduce_sum,
    dp_group_of,
    engine_of,
    export_stats,
    require_keys,
)
from realhf.impl.model.interface.toolkit import answer_token_count
from realhf.impl.model.utils.functional import sft_loss

__all__ = ["SFTInterface"]

_KEYS = ("packed_input_ids", "prompt_mask")


# The tokens the loss averages over (the engine's micro-batch weight): positions whose
# next token is an answer token, as in sft_loss.
_answer_tokens = answer_token_count


def _loss_fn(tp):
    """The engine's loss function for a model with tensor-parallel hooks ``tp``."""

    def loss(logits: torch.Tensor, mb: SequenceSample):
        dev = logits.device
        value, n = sft_loss(
            logits,
            mb.data["packed_input_ids"].to(dev),
            mb.cu_seqlens("packed_input_ids").to(dev),
            mb.data["prompt_mask"].to(dev).bool(),
            tp=tp,
        )
        return value, {}

    return loss


class SFTInterface(ModelInterface):
    """Answer-only cross entropy (see the module docstring). No options."""

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """One optimizer step on ``data``; returns the process stats tracker's export
        (reduced over data-parallel ranks), which includes the ``sft/*`` statistics."""
        require_keys(data, _KEYS, "sft train_step")
        engine = engine_of(model, train=True)
        st = engine.train_batch(
            data.select(keys_with_images(data, _KEYS)),
            mb_spec,
            _loss_fn(engine.tp),
            _answer_tokens,
            version_steps=model.version.global_step,
        )
        model.inc_version()
        with stats_tracker.scope("sft"):
            stats_tracker.scalar(
                loss=st["loss"],
                # Capped: math.exp overflows above ~709, and a diverged loss must still log.
                ppl=math.exp(min(st["loss"], 50.0)),
                n_tokens=st["n_tokens"],
                grad_norm=st["grad_norm"],
                lr=st["lr"],
            )
            stats_tracker.scalar(reduce_type="sum", skipped_steps=st["skipped"])
        return export_stats(engine.dp_group)

    def evaluate(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """Answer-token loss and perplexity of ``data`` (token mean over data-parallel ranks)."""
        require_keys(data, _KEYS, "sft evaluate")
        engine = engine_of(model)
        sample = data.select(keys_with_images(data, _KEYS))
        _loss = _loss_fn(engine.tp)

        def nll_sum(logits: torch.Tensor, mb: SequenceSample) -> torch.Tensor:
            loss, n = _loss(logits, mb)[0], _answer_tokens(mb)
            # One row per item keeps forward()'s reordering happy; only the sums matter.
            out = torch.zeros(len(mb), 2, dtype=torch.float64)
            out[0, 0], out[0, 1] = float(loss) * n, n  # mean * count: sums add over ranks
            return out

        rows = engine.forward(sample, mb_spec, nll_sum, [[1] for _ in sample.ids])
        totals = all_reduce_sum(rows.sum(0), dp_group_of(model))
        n = float(totals[1])
        loss = float(totals[0]) / n if n > 0 else float("nan")
        return {
            "sft_eval/loss": loss,
            "sft_eval/ppl": math.exp(min(loss, 50.0)),
            "sft_eval/n_tokens": n,
        }


register_interface("sft", SFTInterface)
