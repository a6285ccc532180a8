"""sft: answer-only cross entropy; the loss falls on a fixed batch."""

import math

import pytest
import torch

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.registry import make_interface
from realhf.base import stats_tracker
from realhf.impl.model.utils.functional import sft_loss

PAIRS = [
    ("Compute 12+30.", "\\boxed{42}"),
    ("Compute 9*9.", "\\boxed{81}"),
    ("Compute 50-8.", "\\boxed{42}"),
]


def test_loss_decreases_over_steps_on_a_fixed_batch(make_model, pa_sample):
    stats_tracker.reset()
    model = make_model(lr=1e-2)
    data = pa_sample(PAIRS)
    sft = make_interface("sft")
    losses = []
    for _ in range(4):
        st = sft.train_step(model, data, MicroBatchSpec(max_tokens_per_mb=24))
        losses.append(st["sft/loss"])
        assert st["sft/ppl"] == pytest.approx(math.exp(st["sft/loss"]))
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.version.global_step == 4
    n_answer = sum(len(model.tokenizer(a).input_ids) + 1 for _, a in PAIRS)
    assert st["sft/n_tokens"] == n_answer
    assert st["sft/skipped_steps"] == 0.0


def test_evaluate_matches_the_answer_only_loss(make_model, pa_sample):
    model = make_model(train=False)
    data = pa_sample(PAIRS)
    ev = make_interface("sft").evaluate(model, data, MicroBatchSpec(max_tokens_per_mb=24))
    net = model.module.model
    ids, cu = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        ref, n = sft_loss(net(ids, cu), ids, cu, data.data["prompt_mask"])
    assert ev["sft_eval/loss"] == pytest.approx(float(ref), rel=1e-5)
    assert ev["sft_eval/n_tokens"] == int(n)
    assert ev["sft_eval/ppl"] == pytest.approx(math.exp(float(ref)), rel=1e-5)


def test_train_step_loss_is_the_pre_update_evaluate_loss(make_model, pa_sample):
    stats_tracker.reset()
    model = make_model()
    data = pa_sample(PAIRS)
    sft = make_interface("sft")
    before = sft.evaluate(model, data, MicroBatchSpec())
    st = sft.train_step(model, data, MicroBatchSpec(max_tokens_per_mb=20))
    assert st["sft/loss"] == pytest.approx(before["sft_eval/loss"], rel=1e-5)


def test_needs_prompt_mask(make_model, pa_sample):
    with pytest.raises(KeyError, match="prompt_mask"):
        make_interface("sft").train_step(
            make_model(), pa_sample(PAIRS).select(["packed_input_ids"]), MicroBatchSpec()
        )
