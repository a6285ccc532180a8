"""Shared body of the hydra entry points: a hydra config → our validated dataclass → run.

Hydra owns the command line, so plugins (modules of your own that register interfaces,
datasets or agents) come from ``$REALHF_PLUGINS`` or the ``realhf.plugins`` entry points
(:mod:`realhf.apps.plugins`), e.g.
``REALHF_PLUGINS=my_algo python training/main_sync_ppo.py actor.train_interface=my_algo``.
"""

from omegaconf import OmegaConf

from realhf.api.cli_parser import ConfigError, config_from_dict
from realhf.apps import plugins


def config_from_hydra(config_cls, cfg):
    """`cfg` (a hydra DictConfig) validated as a `config_cls` instance (ConfigError/ValueError).

    Hydra has already parsed the command line, so its values are merged as objects. (Turning
    them back into ``key=value`` strings and parsing again re-interpreted them as YAML:
    ``"010"`` became 8, ``"yes"`` True, ``"run #2"`` lost its comment-like tail.)
    """
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return config_from_dict(config_cls, plain, "the hydra config")


def run_from_hydra(name: str, config_cls, cfg) -> int:
    """Validate `cfg` (a hydra DictConfig) against `config_cls` and launch quickstart `name`
    with the plugins of the environment."""
    from realhf.apps import main as app_main

    try:
        imports = plugins.load()  # before validation: options may name what they register
        parsed = config_from_hydra(config_cls, cfg)
    except (ConfigError, ValueError) as e:  # PluginError is a ValueError
        raise SystemExit(f"{name}: {e}") from None
    return app_main.run(name, parsed, imports=imports)
