import dataclasses

import pytest

from realhf.api.cli_parser import ConfigError, format_help, parse_config, to_yaml


@dataclasses.dataclass
class Optim:
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "peak learning rate"})
    warmup_steps: int = 0

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")


@dataclasses.dataclass
class Exp:
    """A toy experiment."""

    name: str = dataclasses.field(default="toy", metadata={"help": "experiment name"})
    steps: int = 3
    optimizer: Optim = dataclasses.field(default_factory=Optim)


def test_defaults_and_overrides():
    cfg = parse_config(Exp, ["steps=5", "optimizer.lr=0.01"])
    assert isinstance(cfg, Exp) and isinstance(cfg.optimizer, Optim)
    assert cfg.steps == 5 and cfg.optimizer.lr == 0.01 and cfg.name == "toy"


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 7\noptimizer:\n  lr: 0.5\n")
    cfg = parse_config(Exp, ["--config", str(p), "optimizer.lr=0.25"])
    assert cfg.steps == 7 and cfg.optimizer.lr == 0.25


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'optimizer.lrr'.*did you mean 'optimizer.lr'"
    ):
        parse_config(Exp, ["optimizer.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean 'optimizer.lr'"):
        parse_config(Exp, ["lr=1"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("stepz: 7\n")
    with pytest.raises(ConfigError, match=r"'stepz'.*c.yaml.*did you mean 'steps'"):
        parse_config(Exp, ["--config", str(p)])


def test_type_errors_name_the_key():
    with pytest.raises(ConfigError, match="optimizer.lr"):
        parse_config(Exp, ["optimizer.lr=abc"])


def test_post_init_validation_runs():
    with pytest.raises((ConfigError, ValueError), match="lr must be > 0"):
        parse_config(Exp, ["optimizer.lr=-1"])


def test_bad_arguments():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(Exp, ["--config", "/nonexistent.yaml"])
    with pytest.raises(ConfigError, match="cannot parse argument"):
        parse_config(Exp, ["--bogus"])


def test_help_lists_every_option():
    text = format_help(Exp, prog="quickstart toy")
    for key in ("name", "steps", "optimizer.lr", "optimizer.warmup_steps"):
        assert f"  {key} (" in text
    assert "peak learning rate" in text and "default: 0.001" in text


def test_yaml_round_trip():
    cfg = parse_config(Exp, ["steps=9"])
    assert "steps: 9" in to_yaml(cfg)
