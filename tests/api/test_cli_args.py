import pytest

from realhf.api.cli_args import BaseExperimentConfig, ExperimentControlConfig, OptimizerConfig
from realhf.api.cli_parser import ConfigError, format_help, parse_config


def test_defaults_construct():
    cfg = parse_config(BaseExperimentConfig, [])
    assert cfg.mode == "local" and cfg.exp_ctrl.total_train_epochs == 1


@pytest.mark.parametrize(
    "override, needle",
    [
        ("recover_mode=sometimes", "recover_mode='sometimes'"),
        ("mode=k8s", "mode='k8s'"),
        ("exp_ctrl.save_freq_steps=0", "save_freq_steps"),
        ("trial_name=a/b", "trial_name"),
        ("torch_threads=0", "torch_threads=0"),
    ],
)
def test_invalid_values_are_named(override, needle):
    with pytest.raises((ConfigError, ValueError), match=needle.replace("(", r"\(")):
        parse_config(BaseExperimentConfig, [override])


def test_optimizer_validation():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        OptimizerConfig(lr_scheduler_type="step")
    with pytest.raises(ValueError, match="lr must be > 0"):
        OptimizerConfig(lr=0)


def test_help_mentions_nested_options():
    text = format_help(BaseExperimentConfig)
    assert "exp_ctrl.ckpt_freq_secs" in text and "recover_mode" in text
    assert ExperimentControlConfig().total_train_epochs == 1


def test_ray_worker_resources_parse_and_are_checked():
    from realhf.api.ray_args import RayConfig

    cfg = RayConfig(worker_resources={"generation_server": "inference_node:1, fast:0.5"})
    assert cfg.resources_of("generation_server") == {"inference_node": 1.0, "fast": 0.5}
    assert cfg.resources_of("model_worker") == {}
    for bad in ("inference_node", "x:0", "x:-1", "GPU:1", ":1", "x:abc"):
        with pytest.raises(ValueError, match="ray.worker_resources.generation_server"):
            RayConfig(worker_resources={"generation_server": bad})
