"""realhf's command line: run an experiment on the embedded tiny model, or your own.

    python -m realhf.apps.quickstart ppo-math                  # embedded model + data, CPU
    python -m realhf.apps.quickstart sft --config my.yaml actor.optimizer.lr=1e-4
    python -m realhf.apps.quickstart ppo-math --help           # every option with its default
    python -m realhf.apps.quickstart ppo-math --dry-run        # what would run; runs nothing
    python -m realhf.apps.quickstart ppo-math --dry-run --format mermaid
    python -m realhf.apps.quickstart ppo-math --import my_algo actor.train_interface=my_algo

Options come from the experiment's config dataclass: a YAML file (``--config``) and
``key=value`` overrides (nested keys with dots). Unknown or invalid keys are errors that
name the key. The resolved config is saved as ``config.yaml`` in the run directory.

``--import MODULE`` (repeatable; also ``$REALHF_PLUGINS`` and the ``realhf.plugins``
entry-point group, see :mod:`realhf.apps.plugins`) imports a module of your own first,
here and in every launched process: an algorithm interface, dataset, agent or experiment
that it registers can then be named in the options (README, "Writing an algorithm").

``--dry-run [--format text|mermaid]`` prints the compiled dataflow graph of model function
calls (MFCs), each MFC's model, interface, type and layout, the worker processes with their
GPUs, and the resolved config as YAML, then exits: nothing is launched or written.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # First of all, before realhf's other modules: import torch & co. here and fork the
    # run's fork server from this process, so that a local run imports them once, not
    # twice (realhf.scheduler.forkserver.start_early).  Not for what launches nothing.
    _args = sys.argv[1:]
    if _args and not {"-h", "--help", "--dry-run"} & set(_args):
        if not any(a.startswith("mode=") and a != "mode=local" for a in _args):
            from realhf.scheduler import forkserver as _forkserver

            _forkserver.start_early()

import importlib
from typing import List, Optional, Tuple

from realhf.api.cli_parser import ConfigError, format_help, parse_config
from realhf.api.core.registry import INTERFACES, RegistryError
from realhf.apps import dry_run, memory_plan, plugins
from realhf.experiments.registry import get_quickstart_exp, quickstart_experiments

#: modules that register quickstart experiments
EXPERIMENT_MODULES = (
    "realhf.experiments.sft",
    "realhf.experiments.ppo_math",
    "realhf.experiments.async_ppo_math",
    "realhf.experiments.null",
    "realhf.experiments.rw",
    "realhf.experiments.dpo",
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


DRY_RUN_HELP = """
dry run (nothing is launched or written):
  --dry-run
      print the dataflow graph of MFCs, each MFC's model, interface, type and layout,
      the worker processes and their GPUs, and the resolved config as YAML
  --format {text,mermaid} (default: text)
      the graph as text, or the whole report as a Mermaid flowchart"""


IMPORT_HELP = f"""
plugins (modules of your own, imported here and in every launched process):
  --import MODULE (repeatable)
      import MODULE first: the interfaces, datasets, agents or experiments it registers
      can be named in the options, e.g. actor.train_interface=NAME; also
      ${plugins.ENV_VAR}=MODULE[,MODULE] and the '{plugins.ENTRY_POINT_GROUP}' entry-point group.
      MODULE must be importable from the launch directory or PYTHONPATH"""


def _take_imports(args: List[str]) -> Tuple[List[str], List[str]]:
    """``args`` without ``--import MODULE`` / ``--import=MODULE``, and the modules."""
    rest, modules = [], []
    it = iter(args)
    for a in it:
        if a == "--import":
            m = next(it, None)
            if m is None or m.startswith("-") or "=" in m:
                raise ConfigError("--import needs a module name, e.g. --import my_algo")
            modules.append(m)
        elif a.startswith("--import="):
            modules.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return rest, modules


def _take_dry_run(args: List[str]) -> Tuple[List[str], Optional[str]]:
    """``args`` without ``--dry-run`` and ``--format F``, and the format (None: no dry run)."""
    rest, dry, fmt = [], False, None
    it = iter(args)
    for a in it:
        if a == "--dry-run":
            dry = True
        elif a == "--format":
            fmt = next(it, None)
            if fmt is None:
                raise ConfigError(f"--format needs one of {', '.join(dry_run.FORMATS)}")
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
        else:
            rest.append(a)
    if fmt is not None and fmt not in dry_run.FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(dry_run.FORMATS)}")
    if fmt is not None and not dry:
        raise ConfigError("--format only applies to --dry-run")
    return rest, (fmt or "text") if dry else None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _load_experiments()
    try:
        argv, imports = _take_imports(argv)
        imports = plugins.load(imports)  # before parsing: options may name what they register
    except (ConfigError, plugins.PluginError) as e:
        print(f"quickstart: {e}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2  # no arguments at all is a usage error
    name, rest = argv[0], argv[1:]
    try:
        qs = get_quickstart_exp(name)
    except RegistryError as e:
        print(f"quickstart: {e}", file=sys.stderr)
        return 2
    if "-h" in rest or "--help" in rest:
        print(format_help(qs.config_cls, prog=f"python -m realhf.apps.quickstart {name}"))
        print(DRY_RUN_HELP)
        print(IMPORT_HELP)
        print(f"      registered interfaces: {', '.join(INTERFACES.names())}")
        return 0
    try:
        rest, fmt = _take_dry_run(rest)
        cfg = parse_config(qs.config_cls, rest)
    except (ConfigError, ValueError) as e:
        print(f"quickstart {name}: {e}", file=sys.stderr)
        return 2
    if fmt is not None:
        try:
            # reads the model and data files; writes nothing
            experiment, chosen = memory_plan.choose_unset(cfg, qs.build)
        except (ValueError, FileNotFoundError) as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 2
        print(dry_run.describe(name, cfg, experiment, fmt, chosen))
        return 0
    from realhf.apps import main as app_main

    return app_main.run(name, cfg, imports=imports)


if __name__ == "__main__":
    # sys.exit(main()) without the ~1 s of CPU that tearing down torch & co. takes
    from realhf.base import shutdown

    shutdown.run_and_exit(main)
