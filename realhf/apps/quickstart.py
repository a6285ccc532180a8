"""realhf's command line: run an experiment on the embedded tiny model, or your own.

    python -m realhf.apps.quickstart ppo-math                  # embedded model + data, CPU
    python -m realhf.apps.quickstart sft --config my.yaml actor.optimizer.lr=1e-4
    python -m realhf.apps.quickstart ppo-math --help           # every option with its default

Options come from the experiment's config dataclass: a YAML file (``--config``) and
``key=value`` overrides (nested keys with dots). Unknown or invalid keys are errors that
name the key. The resolved config is saved as ``config.yaml`` in the run directory.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

from realhf.api.cli_parser import ConfigError, format_help, parse_config
from realhf.experiments.registry import get_quickstart_exp, quickstart_experiments

#: modules that register quickstart experiments
EXPERIMENT_MODULES = (
    "realhf.experiments.sft",
    "realhf.experiments.ppo_math",
    "realhf.experiments.async_ppo_math",
    "realhf.experiments.null",
)


def _load_experiments() -> None:
    for m in EXPERIMENT_MODULES:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name != m:  # a real missing dependency inside the module
                raise


def _usage() -> str:
    lines = [__doc__.strip(), "", "experiments:"]
    for name in quickstart_experiments():
        lines.append(f"  {name:<16} {get_quickstart_exp(name).description}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _load_experiments()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2  # no arguments at all is a usage error
    name, rest = argv[0], argv[1:]
    try:
        qs = get_quickstart_exp(name)
    except KeyError as e:
        print(f"quickstart: {e.args[0]}", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        print(format_help(qs.config_cls, prog=f"python -m realhf.apps.quickstart {name}"))
        return 0
    try:
        cfg = parse_config(qs.config_cls, rest)
    except (ConfigError, ValueError) as e:
        print(f"quickstart {name}: {e}", file=sys.stderr)
        return 2
    from realhf.apps import main as app_main

    return app_main.run(name, cfg)


if __name__ == "__main__":
    sys.exit(main())
