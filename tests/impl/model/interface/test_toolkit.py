"""The public algorithm toolkit: answer masks, log-probs, group statistics, reductions."""

import pytest
import torch
from interface_testlib import MB

from realhf.api.core.registry import make_interface
from realhf.impl.algorithms import advantages
from realhf.impl.model.interface import helpers, toolkit
from realhf.impl.model.utils import functional

PAIRS = [("Compute 12+30.", "\\boxed{42}"), ("Compute 9*9.", "\\boxed{81}")]


def test_answer_mask_marks_predictions_of_answer_tokens():
    # Two sequences: prompt 2 + answer 2, prompt 1 + answer 1.
    prompt_mask = torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    # shifted: seq 0 predicts tokens 1..3 (prompt, answer, answer), seq 1 predicts token 1
    assert toolkit.answer_mask(prompt_mask, cu).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="prompt_mask has 5 entries"):
        toolkit.answer_mask(prompt_mask[:5], cu)


def test_answer_token_count_is_the_answer_tokens_of_the_micro_batch(pa_sample, tokenizer):
    data = pa_sample(PAIRS)
    n_answer = sum(len(tokenizer(a).input_ids) + 1 for _, a in PAIRS)  # + EOS
    assert toolkit.answer_token_count(data) == n_answer


def test_sample_logprobs_is_the_builtin_actors_inference(make_model, pa_sample):
    model = make_model(train=False)
    data = pa_sample(PAIRS, group=2)
    ours = toolkit.sample_logprobs(model, data, MB, key="lp")
    builtin = make_interface("ppo_actor").inference(model, data, MB)
    assert ours.seqlens["lp"] == builtin.seqlens["logprobs"]
    torch.testing.assert_close(ours.data["lp"], builtin.data["logprobs"])


def test_group_mean_std_by_hand():
    mean, std = toolkit.group_mean_std(torch.tensor([1.0, 3.0, 5.0, 5.0]), group_size=2)
    assert mean.tolist() == [2.0, 2.0, 5.0, 5.0] and std.tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="groups of group_size=3"):
        toolkit.group_mean_std(torch.zeros(4), 3)


def test_global_mean_without_distributed_is_the_local_masked_mean():
    x = torch.tensor([1.0, 2.0, float("nan"), 5.0])
    assert toolkit.global_mean(x, None, mask=~x.isnan()) == pytest.approx(8 / 3)
    assert toolkit.global_mean(x, None, mask=torch.zeros(4, dtype=torch.bool)) == 0.0


def test_reexports_keep_their_original_objects():
    assert toolkit.engine_of is helpers.engine_of
    assert toolkit.all_reduce_sum is helpers.all_reduce_sum
    assert toolkit.gather_packed_shifted_log_probs is functional.gather_packed_shifted_log_probs
    assert toolkit.per_token is advantages.per_token
    assert set(toolkit.__all__) <= set(dir(toolkit))
