"""The hydra configs of training/ load through hydra and validate as their experiment configs."""

import os

import pytest
from hydra import compose, initialize_config_dir

from realhf.apps.hydra_entry import config_from_hydra
from realhf.experiments.async_ppo_math import AsyncPPOMathConfig
from realhf.experiments.ppo_math import PPOMathConfig
from realhf.experiments.sft import SFTConfig

CONFIGS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "training",
    "configs",
)


@pytest.mark.parametrize(
    "name, cls",
    [("sft", SFTConfig), ("sync-ppo", PPOMathConfig), ("async-ppo", AsyncPPOMathConfig)],
)
def test_config_validates(name, cls):
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name=name, overrides=["+seed=3"])
    parsed = config_from_hydra(cls, cfg)
    assert isinstance(parsed, cls) and parsed.seed == 3


def test_async_yaml_matches_the_quickstart_defaults():
    # the yaml documents the defaults; it must not silently differ from them
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="async-ppo")
    assert config_from_hydra(AsyncPPOMathConfig, cfg) == AsyncPPOMathConfig(
        experiment_name="async-ppo-math"
    )


def test_unknown_key_is_an_error():
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose(config_name="async-ppo", overrides=["+max_head_offpolicy=3"])
    with pytest.raises(Exception, match="max_head_offpolicy"):
        config_from_hydra(AsyncPPOMathConfig, cfg)
