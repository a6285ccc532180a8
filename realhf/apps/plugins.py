"""Plugins: modules of your own (interfaces, datasets, agents, experiments) in every process.

A plugin is a module that registers things when imported (``register_interface("my_algo",
MyAlgo)``).  Three routes name one, all merged in this order without duplicates:

1. ``python -m realhf.apps.quickstart EXP --import MODULE`` (repeatable);
2. ``REALHF_PLUGINS=MODULE[,MODULE...]`` in the environment;
3. the ``realhf.plugins`` entry-point group of installed packages, e.g. in pyproject.toml::

       [project.entry-points."realhf.plugins"]
       my_algo = "my_package.my_algo"

:func:`load` imports them in the launcher before the config is parsed (so option values
naming a plugin's interface are checked at once) and returns the module names, which the
launcher hands to the controller and every worker (``realhf.apps.remote --import``).
Whatever a worker cannot import fails here first, naming the fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from typing import Iterable, List, Optional, Sequence

#: environment variable naming plugin modules (comma-separated)
ENV_VAR = "REALHF_PLUGINS"
#: entry-point group of installed plugins (each entry point's value names a module)
ENTRY_POINT_GROUP = "realhf.plugins"


class PluginError(ValueError):
    """A plugin module that the launched processes could not import; says how to fix it."""


def from_env(environ=None) -> List[str]:
    """The modules of ``$REALHF_PLUGINS`` (commas or whitespace between them)."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return [m for m in raw.replace(",", " ").split() if m]


def from_entry_points() -> List[str]:
    """The modules of the installed ``realhf.plugins`` entry points."""
    return [ep.module for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)]


def resolve(cli_imports: Sequence[str] = ()) -> List[str]:
    """``--import`` modules, then ``$REALHF_PLUGINS``, then entry points; no duplicates."""
    out: List[str] = []
    for m in [*cli_imports, *from_env(), *from_entry_points()]:
        if m not in out:
            out.append(m)
    return out


def load(cli_imports: Sequence[str] = ()) -> List[str]:
    """Import every plugin (:func:`resolve`); return their names for the launched processes.

    Raises:
        PluginError: a module is the script being run, cannot be found (with a PYTHONPATH
            hint), or fails while importing (with its traceback).
    """
    modules = resolve(cli_imports)
    for m in modules:
        import_plugin(m)
    return modules


def _main_file() -> Optional[str]:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.realpath(path) if path else None


def _script_hint(what: str) -> str:
    return (
        f"{what} is the script being run (__main__); the worker processes would import it "
        "again under another name, and what it registers would not match. Put the interface "
        "(or experiment) in its own module, e.g. my_algo.py, and run "
        "`python -m realhf.apps.quickstart EXPERIMENT --import my_algo ...` from the directory "
        "that holds it (or with that directory on PYTHONPATH)"
    )


def _not_found_hint(module: str, missing: str) -> str:
    cwd = os.getcwd()
    lines = [
        f"No module named {missing!r} (plugin {module!r} is not on the Python path).",
        "Every process of the run imports it, so it must be importable from the directory you "
        f"launch in ({cwd}) or from PYTHONPATH:",
        f"  run from the directory that contains {module.split('.')[0]!r}, or",
        f"  export PYTHONPATH=/path/to/that/directory{os.pathsep}$PYTHONPATH",
    ]
    if module.endswith(".py") or "/" in module or os.sep in module:
        dotted = module[:-3] if module.endswith(".py") else module
        dotted = dotted.replace(os.sep, ".").replace("/", ".").strip(".")
        lines.append(f"--import takes a module name, not a file path: try --import {dotted}")
    return "\n".join(lines)


def import_plugin(module: str) -> None:
    """Import ``module`` as a plugin, or raise :class:`PluginError` saying how to fix it."""
    if not module or module == "__main__":
        raise PluginError(_script_hint(f"--import {module or repr(module)}"))
    main_file = _main_file()
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:  # a parent package is missing or broken
        missing = getattr(e, "name", None) or module
        if isinstance(e, ModuleNotFoundError):
            raise PluginError(_not_found_hint(module, missing)) from None
        raise PluginError(f"cannot import plugin {module!r}: {e}") from None
    if spec is None:
        raise PluginError(_not_found_hint(module, module))
    origin = os.path.realpath(spec.origin) if spec.origin and spec.has_location else None
    if main_file is not None and origin == main_file:
        raise PluginError(_script_hint(f"--import {module} ({origin})"))
    try:
        importlib.import_module(module)
    except Exception:
        raise PluginError(
            f"plugin {module!r} failed while importing:\n{traceback.format_exc()}"
        ) from None
    _share_path(module, origin)


def _share_path(module: str, origin: Optional[str]) -> None:
    """Make sure launched processes find ``module`` too: when only this process's
    ``sys.path`` (e.g. a launching script's directory) holds it, add that entry to
    ``$PYTHONPATH``, which launched processes inherit."""
    if origin is None:
        return
    depth = module.count(".") + (1 if os.path.basename(origin) == "__init__.py" else 0)
    root = os.path.dirname(origin)
    for _ in range(depth):
        root = os.path.dirname(root)
    # A process started with `python -m` in the same directory has it on its path.
    known = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    if any(p and os.path.realpath(p) == root for p in known):
        return
    if any(root == os.path.realpath(p) for p in _site_dirs()):
        return  # an installed package
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p
    )


def _site_dirs() -> Iterable[str]:
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    return [d for d in [*dirs, user] if d]
