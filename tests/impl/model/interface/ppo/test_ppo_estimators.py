"""Advantage estimators and reward shaping of prepare_ppo_batch against per-answer python
references (no model: synthetic packed batches)."""

import math
import statistics

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GroupSizeError
from realhf.impl.algorithms import advantages as A
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.ppo.ppo_data import prepare_ppo_batch, required_keys

G = 3
# (prompt length, answer length) of each answer; two prompts of three answers
SHAPES = [(2, 4), (2, 2), (2, 5), (3, 3), (3, 6), (3, 1)]
REWARDS = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
NO_EOS = [False, False, True, False, True, False]


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [p + a for p, a in SHAPES]
    n_shift = sum(lens) - len(lens)
    pmask = [m for p, a in SHAPES for m in [True] * p + [False] * a]
    logp = -torch.rand(n_shift, generator=g, dtype=torch.float64)
    ref = logp + (torch.rand(n_shift, generator=g, dtype=torch.float64) - 0.5) * 0.4
    return SequenceSample.from_default(
        ids=["q0", "q1"],
        seqlens=[lens[:G], lens[G:]],
        data={
            "packed_input_ids": torch.randint(0, 50, (sum(lens),), generator=g),
            "prompt_mask": torch.tensor(pmask),
            "packed_logprobs": logp.float(),
            "packed_ref_logprobs": ref.float(),
            "rewards": torch.tensor(REWARDS),
            "seq_no_eos_mask": torch.tensor(NO_EOS),
        },
    )


def _hp(**kw):
    base = dict(group_size=G, disable_value=True, kl_ctl=0.0)
    base.update(kw)
    return PPOHyperparameters(**base)


def _per_answer(x, data):
    """Split a shifted [T'] tensor into python lists, one per answer (answer tokens only)."""
    out, start = [], 0
    for p, a in SHAPES:
        seg = x[start : start + p + a - 1].tolist()
        out.append(seg[p - 1 :])  # shifted entry t predicts token t+1: answer entries
        start += p + a - 1
    return out


def _scores(hp):
    s = list(REWARDS)  # the reward interface scaled them already
    if hp.overlong_penalty_len:
        lmax, lc = hp.gen.max_new_tokens, hp.overlong_penalty_len
        s = [
            x + min(0.0, -(a - (lmax - lc)) / lc) * hp.overlong_penalty_factor
            for x, (_, a) in zip(s, SHAPES)
        ]
    return [max(-hp.max_reward_clip, min(hp.max_reward_clip, x)) for x in s]


def _group_ref(scores, est):
    out = []
    for k in range(0, len(scores), G):
        grp = scores[k : k + G]
        mean = sum(grp) / G
        for r in grp:
            if est == "grpo":
                out.append((r - mean) / (statistics.stdev(grp) + 1e-6))
            elif est == "drgrpo":
                out.append(r - mean)
            else:
                out.append(r - (sum(grp) - r) / (G - 1))
    return out


@pytest.mark.parametrize("est", [n for n, e in A.ESTIMATORS.items() if e.group_fn])
def test_group_estimators_broadcast_one_advantage_per_answer(est):
    hp = _hp(adv_estimator=est)
    data = _batch()
    batch = prepare_ppo_batch(hp, data, 0.0, record_stats=False)
    expect = _group_ref(_scores(hp), est)
    for got, want in zip(_per_answer(batch.advantages, data), expect):
        assert got == pytest.approx([want] * len(got), rel=1e-6, abs=1e-6)
    # prompt positions carry nothing
    assert batch.advantages[~batch.loss_mask].abs().max().item() == 0.0


def test_rewards_are_scaled_once_by_the_reward_interface_not_again_here():
    # reward_output_scaling is handed to the math_reward interface (sync) and the rollout
    # agent (async), which write scaled rewards; the batch must take them as they are.
    data = _batch()
    plain = prepare_ppo_batch(_hp(adv_estimator="drgrpo"), data, 0.0, record_stats=False)
    scaled = prepare_ppo_batch(
        _hp(adv_estimator="drgrpo", reward_output_scaling=5.0, reward_output_bias=0.5),
        data,
        0.0,
        record_stats=False,
    )
    assert torch.equal(plain.advantages, scaled.advantages)
    assert plain.advantages.abs().max().item() == pytest.approx(1.0 + 1.0 / 3, rel=1e-6)


@pytest.mark.parametrize("est", ["reinforce++", "reinforce++-baseline"])
@pytest.mark.parametrize("kl", [0.0, 0.2])
def test_reinforce_pp_reward_to_go_then_batch_normalisation(est, kl):
    hp = _hp(adv_estimator=est, kl_ctl=kl, discount=0.9)
    data = _batch(seed=1)
    batch = prepare_ppo_batch(hp, data, kl, record_stats=False)
    scores = _scores(hp)
    if est == "reinforce++-baseline":
        scores = [r - sum(scores[k // G * G : k // G * G + G]) / G for k, r in enumerate(scores)]
    logp = _per_answer(data.data["packed_logprobs"].double(), data)
    ref = _per_answer(data.data["packed_ref_logprobs"].double(), data)
    returns = []
    for i in range(len(SHAPES)):
        rew = [-kl * (a - b) for a, b in zip(logp[i], ref[i])]
        rew[-1] += scores[i]
        ret, acc = [], 0.0
        for r in reversed(rew):
            acc = r + 0.9 * acc
            ret.append(acc)
        returns.append(ret[::-1])
    flat = [x for r in returns for x in r]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    for got, ret in zip(_per_answer(batch.advantages, data), returns):
        want = [(x - mean) / (std + 1e-5) for x in ret]
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_overlong_penalty_shapes_the_score():
    # max_new_tokens 6, zone 3: answers of 4, 5, 6 tokens lose 1/3, 2/3, 1 times the factor
    pen = A.overlong_penalty(torch.tensor([1, 3, 4, 5, 6]), 6, 3, 1.5)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.5])
    assert A.overlong_penalty(torch.tensor([6]), 6, 0, 1.0).tolist() == [0.0]
    hp = _hp(
        adv_estimator="drgrpo",
        overlong_penalty_len=3,
        overlong_penalty_factor=1.5,
        gen={"max_new_tokens": 6},
    )
    data = _batch()
    batch = prepare_ppo_batch(hp, data, 0.0, record_stats=False)
    expect = _group_ref(_scores(hp), "drgrpo")
    got = [seg[0] for seg in _per_answer(batch.advantages, data)]
    assert got == pytest.approx(expect, rel=1e-6, abs=1e-6)


def test_mask_too_long_drops_truncated_answers_but_keeps_their_scores_in_the_group():
    hp = _hp(adv_estimator="drgrpo", mask_too_long=True)
    data = _batch()
    batch = prepare_ppo_batch(hp, data, 0.0, record_stats=False)
    masks = _per_answer(batch.loss_mask, data)
    assert [any(m) for m in masks] == [not x for x in NO_EOS]
    expect = _group_ref(_scores(hp), "drgrpo")
    for got, want, trunc in zip(_per_answer(batch.advantages, data), expect, NO_EOS):
        assert got == pytest.approx([0.0 if trunc else want] * len(got), abs=1e-6)


def test_kl_loss_needs_the_reference_and_keeps_it():
    hp = _hp(kl_loss_coef=0.1)
    assert hp.needs_ref and "packed_ref_logprobs" in required_keys(hp, 0.0)
    assert "packed_ref_logprobs" not in required_keys(_hp(), 0.0)
    batch = prepare_ppo_batch(hp, _batch(), 0.0, record_stats=False)
    assert "ref_logp" in batch.to_sample().keys
    assert "ref_logp" not in prepare_ppo_batch(_hp(), _batch(), 0.0).to_sample().keys


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(adv_estimator="grpo", disable_value=False), "disable_value=true"),
        (dict(adv_estimator="rloo", group_size=1), "group_size >= 2"),
        (dict(adv_estimator="grpo", kl_ctl=0.1), "kl_loss_coef"),
        (dict(adv_estimator="ppo"), "use one of"),
        (dict(loss_agg_mode="sum"), "use one of"),
        (dict(loss_agg_constant=100.0), "loss_agg_mode='constant'"),
        (dict(behav_imp_weight_mode="truncate", use_decoupled_loss=True), "needs"),
        (dict(behav_imp_weight_floor=0.5), "use_decoupled_loss"),
        (dict(overlong_penalty_len=20, gen={"max_new_tokens": 16}), "overlong_penalty_len"),
        (dict(entropy_coef=-1.0), "entropy_coef"),
    ],
)
def test_bad_combinations_name_the_field_and_the_fix(kw, needle):
    base = dict(group_size=G, disable_value=True, kl_ctl=0.0)
    base.update(kw)
    with pytest.raises(ValueError, match=needle):
        PPOHyperparameters(**base)


def test_a_reward_models_scores_add_to_the_verifiers_rewards():
    rm = torch.tensor([0.5, -2.0, 0.25, 1.5, 0.0, -0.75])
    with_rm = _batch()
    with_rm.update_(
        SequenceSample.from_default(
            ids=["q0", "q1"], seqlens=[[1] * G, [1] * G], data={"rm_rewards": rm}
        )
    )
    summed = _batch()
    summed.data["rewards"] = torch.tensor(REWARDS) + rm
    hp = _hp(adv_estimator="drgrpo")
    got = prepare_ppo_batch(hp, with_rm, 0.0, record_stats=False).advantages
    want = prepare_ppo_batch(hp, summed, 0.0, record_stats=False).advantages
    assert torch.equal(got, want)
    expect = _group_ref([r + float(x) for r, x in zip(REWARDS, rm)], "drgrpo")
    for adv, e in zip(_per_answer(got, with_rm), expect):
        assert adv == pytest.approx([e] * len(adv), rel=1e-6, abs=1e-6)


def test_items_with_another_answer_count_than_group_size_are_refused():
    # _batch() holds two prompts of G=3 answers; an estimator told group_size=2 would
    # otherwise compare answers of different prompts.
    with pytest.raises(
        GroupSizeError,
        match=r"adv_estimator=grpo expects group_size=2 answers per prompt, but item 'q0' "
        r"holds 3 sequences \(2 of 2 items differ\)",
    ):
        prepare_ppo_batch(_hp(adv_estimator="grpo", group_size=2), _batch(), 0.0)
