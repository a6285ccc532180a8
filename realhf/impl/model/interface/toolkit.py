"""What an algorithm (a :class:`~realhf.api.core.model_api.ModelInterface`) needs, in one place.

    from realhf.impl.model.interface import toolkit as tk

The README's "Writing an algorithm" section shows the contract these helpers serve and
``examples/custom_algorithm/reinforce_baseline.py`` uses them.  Conventions over a packed
batch of B sequences with lengths L_i (T = sum L_i tokens, ``cu_seqlens`` [B+1]):

- *full* tensors have one entry per token [T] (``packed_input_ids``, ``prompt_mask``);
- *shifted* tensors have one entry per predicted token [T - B]: entry t of sequence i
  belongs to the prediction of token t+1 (log-probs, answer masks, per-token advantages);
- *per-sequence* tensors have one entry per sequence [B] (``rewards``).

========================================  ==============================================
reach the model                           :func:`engine_of`, :func:`dp_group_of`,
                                          :func:`require_keys`
log-probs and answer masks                :func:`gather_packed_shifted_log_probs`,
                                          :func:`answer_mask`, :func:`answer_token_count`,
                                          :func:`sample_logprobs`
packed layout                             :func:`short1cu_seqlens`, :func:`shift_one_indices`,
                                          :func:`per_token`
group statistics (G answers per prompt)   :func:`group_mean_std`,
                                          :func:`group_outcome_advantages`
reductions (over data-parallel ranks)     :func:`masked_mean`, :func:`global_mean`,
                                          :func:`all_reduce_sum`, :func:`export_stats`
========================================  ==============================================

Everything that reduces over ranks (``global_mean``, ``all_reduce_sum``, ``export_stats``)
is a collective: every data-parallel rank must call it the same number of times, in the
same order.  Without ``torch.distributed`` (one process) they reduce over nothing.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, keys_with_images
from realhf.api.core.model_api import Model
from realhf.impl.algorithms.advantages import group_outcome_advantages, per_token
from realhf.impl.model.interface.helpers import (
    all_reduce_sum,
    dp_group_of,
    engine_of,
    export_stats,
    require_keys,
)
from realhf.impl.model.utils.functional import (
    gather_packed_shifted_log_probs,
    masked_mean,
    shift_one_indices,
    short1cu_seqlens,
)

__all__ = [
    "engine_of",
    "dp_group_of",
    "require_keys",
    "gather_packed_shifted_log_probs",
    "answer_mask",
    "answer_token_count",
    "sample_logprobs",
    "short1cu_seqlens",
    "shift_one_indices",
    "per_token",
    "group_mean_std",
    "group_outcome_advantages",
    "masked_mean",
    "global_mean",
    "all_reduce_sum",
    "export_stats",
]


def answer_mask(prompt_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T - B] bool (shifted): True where the predicted token belongs to the answer.

    Args:
        prompt_mask: [T] True on prompt tokens.
        cu_seqlens: [B+1] sequence offsets.
    """
    if prompt_mask.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(
            f"prompt_mask has {prompt_mask.shape[0]} entries but cu_seqlens covers "
            f"{int(cu_seqlens[-1])} tokens"
        )
    idx = shift_one_indices(cu_seqlens.to(prompt_mask.device))
    return prompt_mask.bool()[idx + 1].logical_not()


def answer_token_count(mb: SequenceSample) -> int:
    """The answer tokens of ``mb`` (keys ``packed_input_ids``, ``prompt_mask``): the
    ``loss_weight_fn`` of ``TrainEngine.train_batch`` for a loss that is a mean over answer
    tokens, so that the step's loss is the mean over every answer token of the global batch."""
    cu = mb.cu_seqlens("packed_input_ids")
    return int(answer_mask(mb.data["prompt_mask"], cu).sum())


def sample_logprobs(
    model: Model,
    data: SequenceSample,
    mb_spec: MicroBatchSpec,
    temperature: float = 1.0,
    key: str = "logprobs",
) -> SequenceSample:
    """A sample holding ``key``: the next-token log-probs of ``data``'s sequences
    (L - 1 float32 entries per sequence, no gradient), computed micro-batch by micro-batch
    by ``model``'s engine -- what an ``inference`` interface returns for log-probs."""
    engine = engine_of(model)

    def hook(logits: torch.Tensor, mb: SequenceSample) -> torch.Tensor:
        ids = mb.data["packed_input_ids"].to(logits.device)
        cu = mb.cu_seqlens("packed_input_ids").to(logits.device)
        return gather_packed_shifted_log_probs(logits, cu, ids, temperature, tp=engine.tp)

    lens = [[n - 1 for n in item] for item in data.seqlens["packed_input_ids"]]
    logp = (
        engine.forward(
            data.select(keys_with_images(data, ["packed_input_ids"])), mb_spec, hook, lens
        )
        .float()
        .cpu()
    )
    return SequenceSample(
        keys={key},
        trailing_shapes={key: ()},
        dtypes={key: torch.float32},
        ids=list(data.ids),
        seqlens={key: lens},
        data={key: logp},
    )


def group_mean_std(values: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mean and (population) std of each block of ``group_size`` consecutive values (the
    answers to one prompt), broadcast back: two [B] tensors, float32 (computed in float64).

    Group statistics are local to the rank: the answers of one prompt never span ranks.
    """
    n = values.numel()
    if group_size < 1 or n % group_size != 0:
        raise ValueError(f"{n} values cannot be cut into groups of group_size={group_size}")
    g = values.double().view(-1, group_size)
    mean = g.mean(dim=1, keepdim=True).expand_as(g)
    std = g.std(dim=1, unbiased=False, keepdim=True).expand_as(g)
    return mean.reshape(-1).float(), std.reshape(-1).float()


def global_mean(x: torch.Tensor, group, mask: Optional[torch.Tensor] = None) -> float:
    """Mean of ``x`` (over ``mask`` when given) over every data-parallel rank of ``group``
    (None: this process only).  A collective; 0.0 when nothing is selected anywhere."""
    sel = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    picked = torch.where(sel, x.double(), torch.zeros((), dtype=torch.float64, device=x.device))
    totals = all_reduce_sum(torch.stack([picked.sum(), sel.sum().double()]), group)
    return float(totals[0] / totals[1]) if float(totals[1]) > 0 else 0.0
