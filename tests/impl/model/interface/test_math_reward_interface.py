"""math_reward: verifier verdicts become ±scaling rewards, one per sequence."""

import pytest

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.model_api import Model
from realhf.api.core.registry import make_interface
from realhf.base import stats_tracker
from realhf.impl.model.interface import MathRewardInterface

PAIRS = [
    ("Compute 2+3.", "The sum is \\boxed{5}"),
    ("Compute 2+3.", "\\boxed{6}"),
    ("Compute 7*6.", "\\boxed{42}"),
    ("Compute 7*6.", "no idea"),
]
SOLUTIONS = [["\\boxed{5}"], ["\\boxed{42}"]]


def _reward_model(tokenizer):
    return Model("reward", None, tokenizer, device="cpu")


def test_rewards_are_plus_minus_scaling_per_sequence(tokenizer, pa_sample):
    data = pa_sample(PAIRS, group=2, solutions=SOLUTIONS)
    stats_tracker.reset()
    out = make_interface("rw-math").inference(_reward_model(tokenizer), data, MicroBatchSpec())
    assert out.keys == {"rewards"} and out.ids == data.ids
    assert out.seqlens["rewards"] == [[1, 1], [1, 1]]
    assert out.data["rewards"].tolist() == [5.0, -5.0, 5.0, -5.0]
    stats = stats_tracker.export()
    assert stats["math_reward/accuracy"] == 0.5
    assert stats["math_reward/n_seqs"] == 4


def test_bias_and_scaling(tokenizer, pa_sample):
    data = pa_sample(PAIRS, group=2, solutions=SOLUTIONS)
    out = MathRewardInterface(output_scaling=2.0, output_bias=0.5).inference(
        _reward_model(tokenizer), data, MicroBatchSpec()
    )
    assert out.data["rewards"].tolist() == [1.0, -3.0, 1.0, -3.0]
    stats_tracker.reset()


def test_prompt_tokens_are_not_graded(tokenizer, pa_sample):
    # The prompt contains the right answer; the answer does not.
    data = pa_sample([("\\boxed{5}", "\\boxed{4}")], solutions=[["5"]])
    out = MathRewardInterface().inference(_reward_model(tokenizer), data, MicroBatchSpec())
    assert out.data["rewards"].tolist() == [-5.0]
    stats_tracker.reset()


def test_errors_name_what_is_missing(tokenizer, pa_sample):
    data = pa_sample(PAIRS[:1])
    with pytest.raises(KeyError, match="solutions"):
        MathRewardInterface().inference(_reward_model(tokenizer), data, MicroBatchSpec())
    with pytest.raises(KeyError, match="prompt_mask"):
        MathRewardInterface().inference(
            _reward_model(tokenizer), data.select(["packed_input_ids"]), MicroBatchSpec()
        )
    with pytest.raises(ValueError, match="timeout_s"):
        MathRewardInterface(timeout_s=0)
    with pytest.raises(ValueError, match="tokenizer"):
        MathRewardInterface().inference(
            Model("reward", None, None, device="cpu"),
            pa_sample(PAIRS[:1], solutions=[["5"]]),
            MicroBatchSpec(),
        )


def test_an_ungradable_row_is_skipped_named_and_counted(tokenizer, pa_sample, caplog):
    # Row q1's reference answer cannot be read: its answers get NaN ("no verdict", masked
    # by PPO) instead of failing the run or being graded wrong forever.
    data = pa_sample(PAIRS, group=2, solutions=[["\\boxed{5}"], ["\\boxed{}"]])
    stats_tracker.reset()
    with caplog.at_level("WARNING"):
        out = MathRewardInterface().inference(_reward_model(tokenizer), data, MicroBatchSpec())
    r = out.data["rewards"].tolist()
    assert r[:2] == [5.0, -5.0] and all(x != x for x in r[2:])
    assert "skipping dataset row 'q1'" in caplog.text and "no answer can be read" in caplog.text
    stats = stats_tracker.export()
    assert stats["math_reward/bad_rows"] == 1 and stats["math_reward/n_seqs"] == 2
    assert stats["math_reward/accuracy"] == 0.5


def test_too_many_bad_rows_fail_naming_them(tokenizer, pa_sample):
    from realhf.impl.dataset.bad_rows import BadRowsError

    data = pa_sample(PAIRS, group=2, solutions=[[42], []])
    iface = MathRewardInterface(max_bad_row_fraction=0.0)  # 0: the first bad row fails
    with pytest.raises(BadRowsError, match=r"row 'q0': solution 42 \(int\) is not a string"):
        iface.inference(_reward_model(tokenizer), data, MicroBatchSpec())
    stats_tracker.reset()


def test_dynamic_sampling_returns_only_the_groups_in_range(tokenizer, pa_sample):
    pairs = PAIRS + [("Compute 1+1.", "\\boxed{2}"), ("Compute 1+1.", "\\boxed{2}")]
    pairs += [("Compute 3+3.", "\\boxed{5}"), ("Compute 3+3.", "\\boxed{7}")]
    sols = SOLUTIONS + [["2"], ["6"]]  # success rates 0.5, 0.5, 1, 0
    data = pa_sample(pairs, group=2, solutions=sols)
    stats_tracker.reset()
    rw = MathRewardInterface(keep_success_rate=[0.001, 0.999])
    out = rw.inference(_reward_model(tokenizer), data, MicroBatchSpec())
    assert out.ids == data.ids[:2] and out.data["rewards"].tolist() == [5.0, -5.0, 5.0, -5.0]
    stats = stats_tracker.export()
    assert stats["math_reward/dropped_groups"] == 2 and stats["math_reward/n_seqs"] == 8
    keep_all_solved = MathRewardInterface(keep_success_rate=[1.0, 1.0])
    assert keep_all_solved.inference(_reward_model(tokenizer), data, MicroBatchSpec()).ids == [
        data.ids[2]
    ]
    nothing = MathRewardInterface(keep_success_rate=[0.6, 0.9])
    assert nothing.inference(_reward_model(tokenizer), data, MicroBatchSpec()) is None
    stats_tracker.reset()
    with pytest.raises(ValueError, match=r"keep_success_rate=\[0.5, 0.1\]: use \[lb, ub\]"):
        MathRewardInterface(keep_success_rate=[0.5, 0.1])
