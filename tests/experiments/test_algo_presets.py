"""``algo=NAME`` presets: each sets exactly the options it names, the user still wins, and a
KL loss term brings the reference model into the graph."""

import pytest
from omegaconf import OmegaConf

from realhf.api.cli_parser import ConfigError, parse_config
from realhf.api.core.data_api import MicroBatchSpec
from realhf.experiments.algo_presets import ALGO_PRESETS, AlgoPreset
from realhf.experiments.async_ppo_math import AsyncPPOMathConfig
from realhf.experiments.ppo_math import PPOMathConfig, model_specs, ppo_mfcs
from realhf.impl.algorithms.advantages import AdvEstimator


def _flat(cfg) -> dict:
    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    return dict(walk(OmegaConf.to_container(OmegaConf.structured(cfg)), ""))


@pytest.mark.parametrize("cls", [PPOMathConfig, AsyncPPOMathConfig])
@pytest.mark.parametrize("algo", sorted(a for a in ALGO_PRESETS if a))
def test_each_preset_sets_exactly_what_it_names(cls, algo):
    base = _flat(parse_config(cls, []))
    got = _flat(parse_config(cls, [f"algo={algo}"]))
    declared = _flat_dotlist(ALGO_PRESETS[algo].overrides())
    changed = {k for k in got if got[k] != base[k]} - {"algo"}
    assert changed <= set(declared), sorted(changed - set(declared))
    for key, value in declared.items():
        assert got[key] == value, key
    # the tiny task's tuned settings stay
    for key in (
        "ppo.group_size",
        "actor.optimizer.lr",
        "train_batch_size",
        "ppo.gen.max_new_tokens",
    ):
        assert got[key] == base[key], key


_NO_CRITIC = {"ppo.disable_value": True, "ppo.kl_ctl": 0.0}
# What each preset changed from the no-preset config before presets became typed objects
# (captured from the "key=value" presets; both front doors, with and without task=tiny_long).
# The tiny task already has no critic and kl_ctl=0, so _NO_CRITIC changes nothing there.
RESOLVED_BEFORE = {
    "grpo": {"ppo.adv_estimator": "grpo", "ppo.loss_agg_mode": "seq-mean-token-mean"},
    "drgrpo": {"ppo.adv_estimator": "drgrpo", "ppo.loss_agg_mode": "constant"},
    "dapo": {
        "dynamic_sampling": True,
        "ppo.adv_estimator": "grpo",
        "ppo.eps_clip_high": 0.28,
        "ppo.overlong_penalty_factor": 5.0,
        "ppo.overlong_penalty_len": 4,
        "ppo.success_rate_lb": 0.001,
        "ppo.success_rate_ub": 0.999,
    },
    "gspo": {
        "ppo.adv_estimator": "grpo",
        "ppo.eps_clip": 0.0003,
        "ppo.eps_clip_high": 0.0004,
        "ppo.importance_level": "sequence",
        "ppo.loss_agg_mode": "seq-mean-token-mean",
    },
    "rloo": {"ppo.adv_estimator": "rloo"},
    "reinforce++": {"ppo.adv_estimator": "reinforce++"},
    "reinforce++-baseline": {"ppo.adv_estimator": "reinforce++-baseline"},
}


@pytest.mark.parametrize("task", [[], ["task=tiny_long"]])
@pytest.mark.parametrize("cls", [PPOMathConfig, AsyncPPOMathConfig])
def test_every_preset_resolves_to_the_config_it_had_before(cls, task):
    assert set(RESOLVED_BEFORE) == {a for a in ALGO_PRESETS if a}
    base = _flat(parse_config(cls, task))
    assert ALGO_PRESETS[""].overrides() == []
    for algo, want in RESOLVED_BEFORE.items():
        got = _flat(parse_config(cls, [f"algo={algo}"] + task))
        changed = {k: v for k, v in got.items() if v != base[k] and k != "algo"}
        assert changed == want, algo
        # every preset also turns the critic and the KL reward off, whatever the task's
        assert {k: got[k] for k in _NO_CRITIC} == _NO_CRITIC, algo


def test_a_preset_is_typed_and_refuses_options_that_do_not_exist():
    gspo = ALGO_PRESETS["gspo"]
    assert gspo.ppo["adv_estimator"] is AdvEstimator.GRPO
    assert "ppo.eps_clip=0.0003" in gspo.overrides()
    assert ALGO_PRESETS["dapo"].overrides()[-1] == "dynamic_sampling=true"
    with pytest.raises(ValueError, match=r"unknown ppo options \['eps_clipp'\]"):
        AlgoPreset("x", "typo", ppo={"eps_clipp": 0.1})
    with pytest.raises(ValueError, match=r"unknown experiment options \['lr'\]"):
        AlgoPreset("x", "not allowed", experiment={"lr": 0.1})
    with pytest.raises(TypeError):
        ALGO_PRESETS["rloo"].ppo["kl_ctl"] = 0.1


def _flat_dotlist(overrides) -> dict:
    conf = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(conf, "")
    return out


def test_yaml_and_command_line_win_over_a_preset_and_a_preset_over_the_task(tmp_path):
    cfg = parse_config(PPOMathConfig, ["algo=dapo", "ppo.eps_clip_high=0.3"])
    assert cfg.ppo.eps_clip_high == 0.3 and cfg.ppo.adv_estimator == "grpo"
    y = tmp_path / "c.yaml"
    y.write_text("algo: gspo\nppo:\n  eps_clip: 0.001\n")
    cfg = parse_config(PPOMathConfig, ["--config", str(y)])
    assert cfg.ppo.importance_level == "sequence" and cfg.ppo.eps_clip == 0.001
    assert cfg.ppo.eps_clip_high == 4e-4
    cfg = parse_config(PPOMathConfig, ["algo=dapo", "task=tiny_long"])
    assert cfg.ppo.gen.max_new_tokens == 256 and cfg.ppo.eps_clip_high == 0.28


def test_unknown_algo_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"algo='ppo2': use one of \['dapo', 'drgrpo'"):
        parse_config(PPOMathConfig, ["algo=ppo2"])
    with pytest.raises(ValueError, match="disable_value=true"):
        parse_config(PPOMathConfig, ["algo=rloo", "ppo.disable_value=false"])


def test_kl_loss_coef_runs_the_reference_model():
    mb = MicroBatchSpec()
    for args, has_ref in (
        ([], False),
        (["ppo.kl_loss_coef=0.01"], True),
        (["ppo.kl_ctl=0.1"], True),
        (["algo=grpo", "ppo.kl_loss_coef=0.04"], True),
    ):
        cfg = parse_config(PPOMathConfig, args)
        mfcs = {m.name: m for m in ppo_mfcs(cfg, mb)}
        assert ("ref_inf" in mfcs) is has_ref, args
        assert ("packed_ref_logprobs" in mfcs["actor_train"].input_keys) is has_ref
        roles = [s.role for s in model_specs(cfg, "/nonexistent")]
        assert ("ref" in roles) is has_ref


def test_dapo_samples_dynamically_in_both_front_doors():
    from realhf.experiments.async_ppo_math import build_async_ppo_math
    from realhf.experiments.ppo_math import build_ppo_math

    cfg = parse_config(PPOMathConfig, ["algo=dapo"])
    exp = build_ppo_math(cfg)
    master = exp.workers["master_worker"][0]
    rew = {m.name: m for m in master.mfcs}["rew_inf"]
    assert rew.drops_items and master.max_fill_rounds == cfg.dynamic_sampling_max_rounds == 4
    assert rew.interface_impl.args["keep_success_rate"] == [0.001, 0.999]
    plain = build_ppo_math(parse_config(PPOMathConfig, []))
    plain_rew = {m.name: m for m in plain.workers["master_worker"][0].mfcs}["rew_inf"]
    assert not plain_rew.drops_items and "keep_success_rate" not in plain_rew.interface_impl.args
    assert plain.workers["master_worker"][0].max_fill_rounds == 1
    # async: the rollout workers drop the groups and roll out other prompts in their place
    acfg = parse_config(AsyncPPOMathConfig, ["algo=dapo"])
    agent = build_async_ppo_math(acfg).workers["rollout_worker"][0].agent
    assert (agent.args["success_rate_lb"], agent.args["success_rate_ub"]) == (0.001, 0.999)
    with pytest.raises(ValueError, match="set one of the two"):
        parse_config(AsyncPPOMathConfig, ["algo=dapo", "success_rate_ub=0.5"])


def test_dynamic_sampling_needs_a_success_rate_range():
    with pytest.raises(ValueError, match=r"\[0, 1\], which is none: narrow it"):
        parse_config(PPOMathConfig, ["dynamic_sampling=true"])
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be >= 1"):
        parse_config(PPOMathConfig, ["algo=dapo", "dynamic_sampling_max_rounds=0"])


def test_a_trained_reward_model_scores_answers_beside_or_instead_of_the_verifier(tmp_path):
    from realhf.experiments.building_blocks import TINY_MODEL

    mb = MicroBatchSpec()
    cfg = parse_config(PPOMathConfig, [f"reward_model.path={TINY_MODEL}"])
    mfcs = {m.name: m for m in ppo_mfcs(cfg, mb)}
    assert mfcs["rm_inf"].role == "reward" and mfcs["rm_inf"].output_keys == ("rm_rewards",)
    assert mfcs["rm_inf"].interface_impl.type_ == "rw" and "rew_inf" in mfcs
    assert {"rewards", "rm_rewards"} <= set(mfcs["actor_train"].input_keys)
    (rm,) = [s for s in model_specs(cfg, TINY_MODEL) if s.role == "reward"]
    assert rm.is_critic and not rm.trainable
    only = parse_config(
        PPOMathConfig,
        [f"reward_model.path={TINY_MODEL}", "verifier=false", "reward_model_scaling=2.0"],
    )
    mfcs = {m.name: m for m in ppo_mfcs(only, mb)}
    assert "rew_inf" not in mfcs and mfcs["rm_inf"].output_keys == ("rewards",)
    assert mfcs["rm_inf"].interface_impl.args == {"output_scaling": 2.0}
    assert "rm_rewards" not in mfcs["actor_train"].input_keys
    with pytest.raises(ValueError, match="verifier=false leaves no reward"):
        parse_config(PPOMathConfig, ["verifier=false"])
    from realhf.experiments.async_ppo_math import build_async_ppo_math

    acfg = parse_config(AsyncPPOMathConfig, [f"reward_model.path={TINY_MODEL}"])
    master = build_async_ppo_math(acfg).workers["master_worker"][0]
    amfcs = {m.name: m for m in master.mfcs}
    assert amfcs["rm_inf"].input_keys == ("packed_input_ids", "prompt_mask")  # from the stream
    assert "rm_rewards" in amfcs["actor_train"].input_keys
    with pytest.raises(ValueError, match="rollout workers always grade with the verifier"):
        parse_config(AsyncPPOMathConfig, [f"reward_model.path={TINY_MODEL}", "verifier=false"])


def test_async_agents_follow_max_turns_and_python_tool():
    from realhf.experiments.async_ppo_math import build_async_ppo_math

    def rollout(args):
        return build_async_ppo_math(parse_config(AsyncPPOMathConfig, args)).workers[
            "rollout_worker"
        ][0]

    assert rollout([]).agent.type_ == "math-single-step"
    multi = rollout(["max_turns=3", "turn_discount=0.5"])
    assert multi.agent.type_ == "math-multi-turn" and multi.env.type_ == "math-code-single-step"
    assert (multi.agent.args["max_turns"], multi.agent.args["turn_discount"]) == (3, 0.5)
    tool = rollout(["max_turns=2", "python_tool=true"])
    assert tool.agent.type_ == "math-tool-use" and tool.env.type_ == "math-python-tool"
    with pytest.raises(ValueError, match="python_tool=true needs max_turns >= 2"):
        parse_config(AsyncPPOMathConfig, ["python_tool=true"])
