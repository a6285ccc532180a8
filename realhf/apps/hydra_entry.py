"""Shared body of the hydra entry points: a hydra config → our validated dataclass → run."""

from omegaconf import OmegaConf

from realhf.api.quickstart.cli import ConfigError, parse_config


def config_from_hydra(config_cls, cfg):
    """`cfg` (a hydra DictConfig) validated as a `config_cls` instance (ConfigError/ValueError)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return parse_config(config_cls, [f"{k}={v}" for k, v in _flatten(plain)])


def run_from_hydra(name: str, config_cls, cfg) -> int:
    """Validate `cfg` (a hydra DictConfig) against `config_cls` and launch quickstart `name`."""
    from realhf.apps import main as app_main

    try:
        parsed = config_from_hydra(config_cls, cfg)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"{name}: {e}")
    return app_main.run(name, parsed)


def _flatten(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flatten(v, key + ".")
        elif isinstance(v, list):
            yield key, "[" + ",".join(map(str, v)) + "]"
        else:
            yield key, "''" if v == "" else ("null" if v is None else v)
