"""Registry of quickstart experiments: name → (config dataclass, builder).

An experiment module registers itself with

    register_quickstart_exp("ppo-math", PPOMathConfig, build_ppo_math)

where ``build_ppo_math(cfg) -> ExperimentConfig`` compiles the user-facing config into
the workers of the run. `python -m realhf.apps.quickstart <name>` parses the config
class from the command line and launches the result.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List

from realhf.api.core import system_api
from realhf.api.core.registry import Registry, RegistryError


@dataclasses.dataclass(frozen=True)
class QuickstartExperiment:
    name: str
    config_cls: type
    build: Callable  # (cfg) -> realhf.api.core.system_api.ExperimentConfig
    description: str = ""

    def __call__(self, cfg):
        return self.build(cfg)

    def registry_identity(self) -> str:
        # Re-importing a module re-creates both: the same names are the same experiment.
        return f"{self.config_cls.__module__}.{self.config_cls.__qualname__} + " + (
            f"{self.build.__module__}.{self.build.__qualname__}"
        )


#: quickstart name -> its experiment (one of the project's registries: realhf.api.core.registry)
QUICKSTART: Registry[QuickstartExperiment] = Registry("quickstart experiment")


def register_quickstart_exp(
    name: str, config_cls: type, build: Callable, description: str = ""
) -> None:
    """Register a quickstart experiment (re-registering the same objects is a no-op)."""
    first_line = (config_cls.__doc__ or "").strip().split("\n")[0]
    try:
        QUICKSTART.register(
            name, QuickstartExperiment(name, config_cls, build, description or first_line)
        )
        # The controller and workers rebuild the run from the system registry with the
        # pickled config as the only argument.
        system_api.register_experiment(name, build)
    except RegistryError as e:
        raise ValueError(f"quickstart experiment '{name}': {e}") from None


def get_quickstart_exp(name: str) -> QuickstartExperiment:
    """The registered experiment ``name``; a RegistryError lists the known ones otherwise."""
    return QUICKSTART.get(name)


def quickstart_experiments() -> List[str]:
    return QUICKSTART.names()
