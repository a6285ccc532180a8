"""Direct preference optimisation (``dpo``): DPO or IPO on preference pairs.

Input: items of two sequences each, chosen first (``paired_dataset``). The dataflow is

    ref_inf (``dpo.inference`` on the frozen ``ref`` role, output remapped to
             ``packed_ref_logprobs``) ─→ actor_train (``dpo.train_step``)

- ``inference``: next-token log-probs of every sequence (key ``logprobs``, L - 1 per
  sequence), as ``ppo_actor``'s.
- ``train_step``: one optimizer step on
  :func:`~realhf.impl.algorithms.preference.dpo_loss` of the answer-token log-prob sums
  (``log π(y|x)``) of the policy and the reference, micro-batches weighted by pairs;
  stats ``dpo/loss``, ``dpo/reward_acc``, ``dpo/margin``, ``dpo/chosen_reward``,
  ``dpo/rejected_reward``, ``dpo/grad_norm``, ``dpo/lr``, ``dpo/n_pairs``. Advances
  ``model.version``.
"""

from __future__ import annotations

from typing import Dict

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, keys_with_images
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.base import stats_tracker
from realhf.impl.algorithms.preference import (
    PreferenceLoss,
    answer_logprob_sums,
    dpo_loss,
    split_pairs,
)
from realhf.impl.model.interface.helpers import engine_of, export_stats, require_keys
from realhf.impl.model.interface.rw_interface import check_pairs
from realhf.impl.model.interface.toolkit import sample_logprobs
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

__all__ = ["DPOInterface"]

_KEYS = ("packed_input_ids", "prompt_mask", "packed_ref_logprobs")
_STATS = ("loss", "reward_acc", "margin", "chosen_reward", "rejected_reward")


class DPOInterface(ModelInterface):
    """DPO / IPO (see the module docstring).

    Args:
        beta: > 0; DPO's inverse temperature (IPO: target margin ``1/(2β)``).
        loss: ``"dpo"`` or ``"ipo"``.
    """

    def __init__(self, beta: float = 0.1, loss: str = "dpo"):
        if not isinstance(beta, (int, float)) or not beta > 0:
            raise ValueError(f"dpo beta={beta!r}: use a positive number (e.g. 0.1)")
        try:
            self.kind = PreferenceLoss(loss)
        except ValueError:
            choices = [k.value for k in PreferenceLoss]
            raise ValueError(f"dpo loss={loss!r}: use one of {choices}") from None
        self.beta = float(beta)

    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """Next-token log-probs (key ``logprobs``) of every sequence of ``data``."""
        require_keys(data, ["packed_input_ids"], "dpo inference")
        return sample_logprobs(model, data, mb_spec, temperature=1.0)

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """One optimizer step on the pairs of ``data``; returns reduced statistics."""
        require_keys(data, _KEYS, "dpo train_step")
        check_pairs(data, "dpo train_step")
        engine = engine_of(model, train=True)

        def loss_fn(logits: torch.Tensor, mb: SequenceSample):
            dev = logits.device
            cu = mb.cu_seqlens("packed_input_ids").to(dev)
            mask = mb.data["prompt_mask"].to(dev)
            ids = mb.data["packed_input_ids"].to(dev)
            logp = gather_packed_shifted_log_probs(logits, cu, ids, 1.0, tp=engine.tp)
            pi = answer_logprob_sums(logp, cu, mask)
            ref = answer_logprob_sums(mb.data["packed_ref_logprobs"].to(dev), cu, mask)
            return dpo_loss(*split_pairs(pi), *split_pairs(ref), self.beta, self.kind)

        st = engine.train_batch(
            data.select(keys_with_images(data, _KEYS)),
            mb_spec,
            loss_fn,
            len,
            version_steps=model.version.global_step,
        )
        model.inc_version()
        with stats_tracker.scope("dpo"):
            stats_tracker.scalar(
                **{k: st[k] for k in _STATS},
                grad_norm=st["grad_norm"],
                lr=st["lr"],
                n_pairs=st["n_tokens"],
            )
            stats_tracker.scalar(reduce_type="sum", skipped_steps=st["skipped"])
        return export_stats(engine.dp_group)


register_interface("dpo", DPOInterface)
