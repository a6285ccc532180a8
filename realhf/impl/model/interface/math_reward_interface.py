"""Math reward (``math_reward``, alias ``rw-math``): grade answers with the verifier.

``inference(model, data, mb_spec)`` reads ``packed_input_ids`` and ``prompt_mask`` (the
answer is every non-prompt token, special tokens such as EOS dropped when decoding) and
the item metadata ``solutions`` (per item, the list of reference solutions of its prompt,
as in the math jsonl format; every answer of the item is graded against them). The
verifier's verdict becomes +1 / -1, then ``(r - output_bias) * output_scaling`` (default
scaling 5: +5 for a correct answer, -5 otherwise). Output key ``rewards``: one float32
per sequence. The accuracy is recorded in the process stats tracker
(``math_reward/accuracy``, exported with the next ``train_step`` statistics).

A row whose reference solutions cannot be graded (none, not strings, no readable answer:
:func:`~realhf.impl.reward.math_reward.reference_answers`) is skipped: its answers get the
reward NaN, which PPO reads as "no verdict" and masks out of the loss, the row is named in
a warning and counted (``math_reward/bad_rows``), and the run fails once more than
``max_bad_row_fraction`` of the rows were bad (:mod:`realhf.impl.dataset.bad_rows`).

Dynamic sampling (``keep_success_rate=[lb, ub]``, on an MFC with ``drops_items``): the
call returns only the items whose share of correct answers lies in ``[lb, ub]`` (e.g.
``[0.001, 0.999]``: drop the groups whose answers all agree, which carry no group-relative
signal); the master fetches new prompts to replace the others. The statistics count every
answer graded, dropped or not (``math_reward/dropped_groups`` counts the dropped items).

The "model" has no weights: only ``model.tokenizer`` is used (``module`` may be None).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.base import logging, stats_tracker
from realhf.impl.algorithms.advantages import group_success_rates
from realhf.impl.dataset.bad_rows import DEFAULT_MAX_FRACTION, BadRowBudget
from realhf.impl.model.interface.helpers import require_keys
from realhf.impl.reward.math_reward import UngradableRow, reference_answers, verify_batch

logger = logging.getLogger("math_reward")

__all__ = ["MathRewardInterface", "decode_answers"]


def decode_answers(data: SequenceSample, tokenizer) -> List[str]:
    """The text of each sequence's non-prompt tokens (special tokens skipped)."""
    ids = data.data["packed_input_ids"]
    mask = data.data["prompt_mask"].bool()
    texts, start = [], 0
    for length in data.flat_seqlens("packed_input_ids"):
        seq, pm = ids[start : start + length], mask[start : start + length]
        texts.append(tokenizer.decode(seq[~pm].tolist(), skip_special_tokens=True))
        start += length
    return texts


class MathRewardInterface(ModelInterface):
    """Verifier reward for math answers (see the module docstring).

    Args:
        output_scaling: multiplies ``r - output_bias``.
        output_bias: subtracted from the ±1 verdict.
        timeout_s: seconds each answer may spend in the symbolic checks (then it is wrong).
        max_bad_row_fraction: share of rows that may be ungradable before the run fails.
        keep_success_rate: ``[lb, ub]``: return only the items whose success rate (share
            of answers with a positive reward) lies in the range; None: every item.
    """

    uses_weights = False  # the verdict comes from the decoded tokens alone

    def __init__(
        self,
        output_scaling: float = 5.0,
        output_bias: float = 0.0,
        timeout_s: float = 15.0,
        max_bad_row_fraction: float = DEFAULT_MAX_FRACTION,
        keep_success_rate: Optional[Sequence[float]] = None,
    ):
        for name, v in (
            ("output_scaling", output_scaling),
            ("output_bias", output_bias),
            ("timeout_s", timeout_s),
        ):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"math_reward {name}={v!r}: use a finite number")
        if timeout_s <= 0:
            raise ValueError(
                f"math_reward timeout_s={timeout_s!r}: use a positive number of seconds"
            )
        self.output_scaling = float(output_scaling)
        self.output_bias = float(output_bias)
        self.timeout_s = float(timeout_s)
        self.bad_rows = BadRowBudget("math_reward", max_bad_row_fraction)
        if keep_success_rate is not None:
            lb, ub = _success_range(keep_success_rate)
            keep_success_rate = (lb, ub)
        self.keep_success_rate = keep_success_rate

    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """Key ``rewards`` (one per sequence)."""
        require_keys(data, ["packed_input_ids", "prompt_mask"], "math_reward")
        if "solutions" not in data.metadata:
            raise KeyError(
                "math_reward needs the dataset's reference answers as item metadata 'solutions' "
                f"(metadata keys present: {sorted(data.metadata)})"
            )
        if model.tokenizer is None:
            raise ValueError(
                f"math_reward needs a tokenizer on model {model.name} to decode the answers"
            )
        texts = decode_answers(data, model.tokenizer)
        graded, solutions, bad = [], [], 0
        for item_id, sols, lens in zip(
            data.ids, data.metadata["solutions"], data.seqlens["packed_input_ids"]
        ):
            # Every answer of the item (its group) is graded against the prompt's solutions.
            sols = [sols] if isinstance(sols, str) else list(sols)
            try:
                reference_answers(sols)
            except UngradableRow as e:
                graded.extend([False] * len(lens))
                bad += 1
                self.bad_rows.bad_row(str(item_id), str(e))
                continue
            self.bad_rows.good()
            graded.extend([True] * len(lens))
            solutions.extend([sols] * len(lens))
        graded = torch.tensor(graded, dtype=torch.bool)
        texts = [t for t, g in zip(texts, graded.tolist()) if g]
        correct = torch.tensor(
            verify_batch(texts, solutions, timeout=self.timeout_s), dtype=torch.bool
        )
        verdict = torch.where(correct, 1.0, -1.0)
        rewards = torch.full(graded.shape, float("nan"))  # NaN: no verdict, masked by PPO
        rewards[graded] = ((verdict - self.output_bias) * self.output_scaling).float()
        with stats_tracker.scope("math_reward"):
            stats_tracker.denominator(n_seqs=torch.ones_like(correct))
            stats_tracker.stat(
                denominator="n_seqs", accuracy=correct.float(), reward=rewards[graded]
            )
            stats_tracker.scalar(reduce_type="sum", bad_rows=bad)
        kept = list(range(len(data)))
        if self.keep_success_rate is not None:
            lb, ub = self.keep_success_rate
            rates = group_success_rates(rewards, [len(x) for x in data.seqlens["packed_input_ids"]])
            kept = [i for i, r in enumerate(rates.tolist()) if lb <= r <= ub]
            with stats_tracker.scope("math_reward"):
                stats_tracker.scalar(reduce_type="sum", dropped_groups=len(data) - len(kept))
        logger.info(
            f"math_reward: {int(correct.sum())}/{len(correct)} answers correct"
            + (f", {bad} ungradable rows skipped" if bad else "")
        )
        lens = [[1] * len(item) for item in data.seqlens["packed_input_ids"]]
        out = SequenceSample(
            keys={"rewards"},
            trailing_shapes={"rewards": ()},
            dtypes={"rewards": torch.float32},
            ids=list(data.ids),
            seqlens={"rewards": lens},
            data={"rewards": rewards},
        )
        if len(kept) == len(data):
            return out
        return out.select_items(kept) if kept else None


def _success_range(value) -> tuple:
    try:
        lb, ub = (float(v) for v in value)
    except (TypeError, ValueError):
        lb = ub = float("nan")
    if not 0.0 <= lb <= ub <= 1.0:
        raise ValueError(
            f"math_reward keep_success_rate={value!r}: use [lb, ub] with 0 <= lb <= ub <= 1"
        )
    return lb, ub


register_interface("math_reward", MathRewardInterface)
register_interface("rw-math", MathRewardInterface)
