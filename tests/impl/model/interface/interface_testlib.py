"""Builders of PPO training batches for the interface tests."""

from __future__ import annotations

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample

MB = MicroBatchSpec(max_tokens_per_mb=64)


def with_keys(data: SequenceSample, **tensors) -> SequenceSample:
    """``data`` plus standard keys (default lengths from packed_input_ids)."""
    extra = SequenceSample.from_default(ids=data.ids, seqlens=data.seqlens["packed_input_ids"], data=tensors)
    out = data.select(data.keys)
    out.update_(extra)
    return out


def on_policy(actor, model, data: SequenceSample, rewards, no_eos=None) -> SequenceSample:
    """Behaviour log-probs recomputed by ``actor`` (so the PPO ratio starts at 1)."""
    lp = actor.inference(model, data, MB).data["logprobs"]
    n = len(data.flat_seqlens("packed_input_ids"))
    no_eos = torch.zeros(n, dtype=torch.bool) if no_eos is None else torch.tensor(no_eos)
    return with_keys(
        data,
        packed_logprobs=lp,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        seq_no_eos_mask=no_eos,
    )


def answer_logprob_sums(actor, model, data: SequenceSample) -> torch.Tensor:
    """Per sequence, the summed log-prob of its answer tokens under ``model``."""
    from realhf.impl.model.utils.functional import shift_one_indices

    lp = actor.inference(model, data, MB).data["logprobs"]
    cu = data.cu_seqlens("packed_input_ids")
    answer = ~data.data["prompt_mask"][shift_one_indices(cu) + 1]
    lens = [l - 1 for l in data.flat_seqlens("packed_input_ids")]
    return torch.stack([(x * m).sum() for x, m in zip(lp.split(lens), answer.split(lens))])
