"""actor.{train,gen,inf}_interface: the actor's MFCs run a registered interface chosen by one
option, checked against the registry when the config is parsed."""

import pytest

from realhf.api.cli_parser import parse_config
from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.model_api import ModelInterface, RolloutContext
from realhf.api.core.registry import register_interface
from realhf.experiments.actor_interfaces import ActorConfig
from realhf.experiments.async_ppo_math import AsyncPPOMathConfig
from realhf.experiments.ppo_math import PPOMathConfig, ppo_mfcs


class Trainer(ModelInterface):
    def __init__(self, decay: float = 0.5):
        self.decay = decay

    def train_step(self, model, data, mb_spec):
        return {}


class LogProbs(ModelInterface):
    def inference(self, model, data, mb_spec):
        return None


class Generator(ModelInterface):
    def generate(self, model, data, mb_spec):
        return None


register_interface("tai_trainer", Trainer)
register_interface("tai_logprobs", LogProbs)
register_interface("tai_generator", Generator)


def _impls(cfg, include_gen=True):
    return {m.name: m.interface_impl for m in ppo_mfcs(cfg, MicroBatchSpec(), include_gen)}


def test_default_is_the_builtin_actor_with_the_ppo_options():
    cfg = parse_config(PPOMathConfig, [])
    impls = _impls(cfg)
    for name in ("actor_gen", "actor_train"):
        assert impls[name].type_ == "ppo_actor"
        assert impls[name].args["hparams"].group_size == cfg.ppo.group_size


def test_one_option_per_kind_of_mfc():
    cfg = parse_config(
        PPOMathConfig,
        [
            "actor.train_interface=tai_trainer",
            "actor.train_interface_args.decay=0.8",
            "actor.inf_interface=tai_logprobs",
            "ppo.kl_loss_coef=0.1",  # adds ref_inf, which computes log-probs like actor_inf
        ],
    )
    impls = _impls(cfg)
    assert (impls["actor_train"].type_, impls["actor_train"].args) == (
        "tai_trainer",
        {"decay": 0.8},
    )
    assert impls["actor_gen"].type_ == "ppo_actor"
    if cfg.ppo.needs_ref:
        assert (impls["ref_inf"].type_, impls["ref_inf"].args) == ("tai_logprobs", {})


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["actor.train_interface=tai_trainr"],
            "actor.train_interface='tai_trainr': unknown interface 'tai_trainr'; "
            "did you mean 'tai_trainer'?",
        ),
        (["actor.train_interface=zzzz_qqqq"], "--import MODULE"),
        (
            ["actor.train_interface=tai_trainer", "actor.train_interface_args.lr=1"],
            "accepts ['decay']",
        ),
        (["actor.train_interface_args.decay=0.8"], "'ppo_actor' takes its options from ppo.*"),
        (["actor.gen_interface=tai_trainer"], "Trainer does not implement generate()"),
        (["actor.inf_interface=tai_trainer"], "Trainer does not implement inference()"),
        (["actor.train_interface=''"], "give a registered interface name"),
    ],
)
def test_bad_choices_fail_when_parsed(args, needle):
    with pytest.raises(ValueError) as e:
        parse_config(PPOMathConfig, args)
    assert needle in str(e.value)


def test_a_class_defined_in_the_running_script_is_refused():
    class InScript(Trainer):
        pass

    InScript.__module__ = "__main__"
    register_interface("tai_in_script", InScript)
    with pytest.raises(ValueError, match=r"script being run \(__main__\).*--import my_algo"):
        ActorConfig(train_interface="tai_in_script")


def test_async_trains_with_a_custom_interface_but_generates_in_its_servers():
    cfg = parse_config(AsyncPPOMathConfig, ["actor.train_interface=tai_trainer"])
    impls = _impls(cfg, include_gen=False)
    assert impls["actor_train"].type_ == "tai_trainer" and "actor_gen" not in impls
    with pytest.raises(ValueError, match="generates in its generation servers"):
        parse_config(AsyncPPOMathConfig, ["actor.gen_interface=tai_generator"])
    sync = parse_config(PPOMathConfig, ["actor.gen_interface=tai_generator"])
    assert _impls(sync)["actor_gen"].type_ == "tai_generator"


def test_async_passes_the_group_size_shortcut_to_the_interfaces():
    cfg = parse_config(AsyncPPOMathConfig, ["group_size=3", "ppo.gen.temperature=0.5"])
    impls = _impls(cfg, include_gen=False)
    assert impls["actor_train"].args["rollout"] == RolloutContext(group_size=3, temperature=0.5)
