"""Registry of quickstart experiments: name → (config dataclass, builder).

An experiment module registers itself with

    register_quickstart_exp("ppo-math", PPOMathConfig, build_ppo_math)

where ``build_ppo_math(cfg) -> ExperimentConfig`` compiles the user-facing config into
the workers of the run. `python -m realhf.apps.quickstart <name>` parses the config
class from the command line and launches the result.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Dict, List

from realhf.api.core import system_api


@dataclasses.dataclass(frozen=True)
class QuickstartExperiment:
    name: str
    config_cls: type
    build: Callable  # (cfg) -> realhf.api.core.system_api.ExperimentConfig
    description: str = ""


_REGISTRY: Dict[str, QuickstartExperiment] = {}


def register_quickstart_exp(
    name: str, config_cls: type, build: Callable, description: str = ""
) -> None:
    """Register a quickstart experiment (re-registering the same objects is a no-op)."""
    old = _REGISTRY.get(name)
    new = QuickstartExperiment(
        name, config_cls, build, description or (config_cls.__doc__ or "").strip().split("\n")[0]
    )
    if old is not None and (old.config_cls is not config_cls or old.build is not build):
        raise ValueError(
            f"quickstart experiment '{name}' is already registered by {old.build.__module__}"
        )
    _REGISTRY[name] = new
    # The controller and workers rebuild the run from the system registry with the
    # pickled config as the only argument.
    if name not in system_api.registered_experiments():
        system_api.register_experiment(name, build)


def get_quickstart_exp(name: str) -> QuickstartExperiment:
    """The registered experiment `name`, or an error listing the known ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(
            f"unknown quickstart experiment '{name}'{hint} (known: {', '.join(sorted(_REGISTRY))})"
        )
    return _REGISTRY[name]


def quickstart_experiments() -> List[str]:
    return sorted(_REGISTRY)
