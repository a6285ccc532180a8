"""PPOHyperparameters validate themselves and document every field."""

import dataclasses

import pytest

from realhf.api.core.model_api import GenerationHyperparameters, RolloutContext
from realhf.impl.model.interface import PPOActorInterface, PPOCriticInterface, PPOHyperparameters


def test_defaults_follow_the_original_system():
    hp = PPOHyperparameters()
    assert (hp.ppo_n_minibatches, hp.eps_clip, hp.c_clip, hp.value_eps_clip) == (4, 0.2, None, 0.2)
    assert (hp.early_stop_imp_ratio, hp.max_reward_clip, hp.kl_ctl) == (5.0, 20.0, 0.1)
    assert (hp.discount, hp.gae_lambda, hp.adv_norm, hp.value_norm) == (1.0, 1.0, True, True)
    assert not (
        hp.recompute_logprob or hp.use_decoupled_loss or hp.group_adv_norm or hp.disable_value
    )
    assert (hp.success_rate_lb, hp.success_rate_ub, hp.group_size) == (0.0, 1.0, 1)


def test_every_field_has_help():
    for f in dataclasses.fields(PPOHyperparameters):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"eps_clip": 0}, "eps_clip"),
        ({"c_clip": 1.0}, "c_clip"),
        ({"ppo_n_minibatches": 0}, "ppo_n_minibatches"),
        ({"discount": 1.5}, "discount"),
        ({"kl_ctl": -0.1}, "kl_ctl"),
        ({"success_rate_lb": 0.8, "success_rate_ub": 0.2}, "success_rate_lb"),
        ({"behav_imp_weight_cap": 5.0}, "behav_imp_weight_cap"),
        ({"group_adv_norm": True, "adv_norm": False}, "group_adv_norm"),
        ({"gen": {"n": 3}, "group_size": 4}, "gen"),
        ({"temperature": 0.0}, "temperature"),
        ({"early_stop_imp_ratio": float("inf")}, "early_stop_imp_ratio"),
    ],
)
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"PPOHyperparameters.{field}="):
        PPOHyperparameters(**kw)


def test_unknown_keys_suggest_the_closest_field():
    with pytest.raises(ValueError, match="did you mean 'eps_clip'"):
        PPOHyperparameters.from_dict({"eps_clp": 0.1})
    with pytest.raises(ValueError, match="not both"):
        PPOHyperparameters.coerce(PPOHyperparameters(), {"eps_clip": 0.1})


def test_derived_values():
    hp = PPOHyperparameters(group_size=4, gen={"temperature": 0.7, "max_new_tokens": 8})
    assert isinstance(hp.gen, GenerationHyperparameters)
    assert hp.generation.n == 4 and hp.generation.max_new_tokens == 8
    assert hp.logprob_temperature == 0.7
    assert PPOHyperparameters(gen={"greedy": True}).logprob_temperature == 1.0
    assert PPOHyperparameters(temperature=0.5, gen={"temperature": 0.7}).logprob_temperature == 0.5
    assert hp.rollout == RolloutContext(group_size=4, temperature=0.7)
    assert not hp.filters_by_success_rate
    assert PPOHyperparameters(success_rate_ub=0.99).filters_by_success_rate


def test_builtin_interfaces_take_the_group_size_from_the_rollout_and_refuse_another():
    run = RolloutContext(group_size=4, temperature=0.7)
    actor = PPOActorInterface(rollout=run, gen={"temperature": 0.7}, group_adv_norm=True)
    assert actor.hp.group_size == 4 and actor.hp.rollout == run
    with pytest.raises(
        ValueError, match=r"ppo_actor assumes group_size=2, but this run's group_size is 4; "
    ):
        PPOActorInterface(PPOHyperparameters(group_size=2, gen={"temperature": 0.7}), rollout=run)
    with pytest.raises(
        ValueError, match=r"ppo_critic assumes temperature=1.0, but this run's temperature is 0.7"
    ):
        PPOCriticInterface({"group_size": 4}, rollout=run)
