"""ppo_actor.train_step with every algorithm preset and the new loss options, on the tiny
model of the interface fixtures (one process, no launch)."""

import dataclasses
import math

import pytest
import torch
from interface_testlib import MB, on_policy

from realhf.api.cli_parser import parse_config
from realhf.api.core.data_api import MicroBatchSpec
from realhf.base import stats_tracker
from realhf.experiments.algo_presets import ALGO_PRESETS
from realhf.experiments.ppo_math import PPOMathConfig
from realhf.impl.model.interface import PPOActorInterface

PAIRS = [
    ("Compute 2+3.", "\\boxed{5}"),
    ("Compute 2+3.", "\\boxed{7}"),
    ("Compute 9-1.", "\\boxed{8}"),
    ("Compute 9-1.", "\\boxed{80}"),
]
REWARDS = [5.0, -5.0, -5.0, 5.0]


@pytest.fixture(autouse=True)
def _clean_tracker():
    stats_tracker.reset()
    yield
    stats_tracker.reset()


def _preset_hp(algo: str):
    """The preset's PPO options, with the two-answer groups of these tests."""
    cfg = parse_config(PPOMathConfig, [f"algo={algo}"] if algo else [])
    return dataclasses.replace(cfg.ppo, group_size=2)


def _add_ref(actor, ref_model, data):
    ref = actor.inference(ref_model, data, MB)
    ref.remap_keys_({"logprobs": "packed_ref_logprobs"})
    data.update_(ref)
    return data


@pytest.mark.parametrize("algo", sorted(ALGO_PRESETS))
def test_every_preset_trains_one_step(make_model, pa_sample, algo):
    model = make_model(lr=1e-3)
    actor = PPOActorInterface(_preset_hp(algo))
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=REWARDS)
    before = model.module.model.flat_params.clone()
    stats = actor.train_step(model, data, MB)
    assert math.isfinite(stats["ppo_actor/loss"]) and stats["ppo_actor/skipped_steps"] == 0.0
    assert not torch.equal(before, model.module.model.flat_params)
    if algo == "gspo":
        assert "ppo_actor/seq_clip_ratio" in stats


def test_kl_loss_entropy_and_truncated_importance_sampling_together(make_model, pa_sample):
    model, ref_m = make_model(lr=1e-3), make_model("ref", train=False)
    with torch.no_grad():
        ref_m.module.model.flat_params.add_(torch.randn_like(ref_m.module.model.flat_params) * 0.1)
    actor = PPOActorInterface(
        group_size=2,
        disable_value=True,
        kl_ctl=0.0,
        adv_estimator="grpo",
        ppo_n_minibatches=1,
        kl_loss_coef=0.1,
        kl_estimator="k3",
        entropy_coef=0.01,
        use_decoupled_loss=True,
        behav_imp_weight_cap=1.05,
        behav_imp_weight_mode="truncate",
    )
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=REWARDS)
    data.data["packed_logprobs"] = data.data["packed_logprobs"] - 0.1  # behaviour weight e^0.1
    data = _add_ref(actor, ref_m, data)
    before = model.module.model.flat_params.clone()
    stats = actor.train_step(model, data, MB)
    assert not torch.equal(before, model.module.model.flat_params)
    assert stats["ppo_actor/kl_loss"] > 0.0 and stats["ppo_actor/entropy"] > 0.0
    # every behaviour weight is e^0.1 > 1.05: all truncated, none dropped
    assert stats["ppo_actor/behave_truncated_ratio"] == pytest.approx(1.0)
    assert stats["ppo_actor/behave_imp_weight"] == pytest.approx(1.05, rel=1e-5)
    assert stats["ppo_actor/behave_mask_dropped"] == 0.0


def test_entropy_is_the_softmax_entropy_at_the_logit_temperature(make_model, pa_sample):
    from realhf.impl.model.interface.ppo.ppo_interface import shifted_entropy

    model = make_model(train=False)
    data = pa_sample(PAIRS)
    ids, cu = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        logits = model.module.model(ids, cu).double()
    got = shifted_entropy(logits, cu, temperature=0.7)
    rows = [t for i in range(len(cu) - 1) for t in range(int(cu[i]), int(cu[i + 1]) - 1)]
    for k, t in enumerate(rows):
        p = torch.softmax(logits[t] / 0.7, dim=-1)
        want = -sum(float(x) * math.log(float(x)) for x in p if x > 0)
        assert got[k].item() == pytest.approx(want, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "constant"])
def test_sequence_aggregation_is_exact_over_micro_batches(make_model, pa_sample, mode):
    """The engine weighs micro-batches by answers for these modes: one micro-batch or many
    must report the same loss and take the same gradient."""
    results = []
    for mb in (MicroBatchSpec(max_tokens_per_mb=1000), MicroBatchSpec(max_tokens_per_mb=16)):
        stats_tracker.reset()
        model = make_model(lr=1e-3)
        actor = PPOActorInterface(
            group_size=2,
            disable_value=True,
            kl_ctl=0.0,
            adv_estimator="drgrpo",
            ppo_n_minibatches=1,
            loss_agg_mode=mode,
            gen={"max_new_tokens": 6},
        )
        data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=REWARDS)
        stats = actor.train_step(model, data, mb)
        results.append((stats, model.module.flat_grad.clone()))
    (s1, g1), (s2, g2) = results
    assert s2["ppo_actor/n_mbs"] > s1["ppo_actor/n_mbs"] == 1.0
    assert s2["ppo_actor/loss"] == pytest.approx(s1["ppo_actor/loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-7)
