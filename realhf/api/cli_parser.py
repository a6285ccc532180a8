"""Config dataclasses → command line: YAML files, `key=value` overrides, `--help`.

Every quickstart experiment owns a dataclass config (fields documented with
`field(metadata={"help": ...})`). This module turns it into a CLI:

    cfg = parse_config(PPOMathConfig, ["--config", "x.yaml", "ppo.kl_ctl=0.1"])

- YAML first, then overrides, merged onto the dataclass defaults by omegaconf so types
  are checked ("lr=abc" is an error naming `optimizer.lr`).
- Unknown keys are errors naming the key and suggesting the closest valid one; nothing
  is silently dropped.
- `format_help(cls)` lists every option (dotted path), its type, default and help text.
- After the merge, each dataclass's own `__post_init__` validation runs (omegaconf's
  `to_object` constructs the real dataclasses).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import pathlib
import typing
from typing import Any, Iterator

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A user-facing configuration error; the message says what and how to fix."""


def iter_options(cls, prefix: str = "", values: Any = None) -> Iterator[tuple[str, Any, Any, str]]:
    """Yield (dotted_key, type, default, help) for every leaf option of a dataclass.

    Defaults of nested dataclasses come from the parent's default instance (``values``), so
    a field like ``actor = field(default_factory=lambda: ModelConfig(lr=2e-4))`` shows 2e-4,
    not ModelConfig's own default.
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        if values is not None:
            default = getattr(values, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "???"
        if dataclasses.is_dataclass(tp) and not isinstance(tp, type(None)):
            yield from iter_options(
                tp, key + ".", default if dataclasses.is_dataclass(default) else None
            )
            continue
        yield key, tp, default, f.metadata.get("help", "")


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def format_help(cls, prog: str = "") -> str:
    """A listing of every option of `cls` with type, default and help text."""
    lines = []
    if prog:
        lines.append(f"usage: {prog} [--config FILE.yaml] [key=value ...]\n")
    doc = inspect.cleandoc(cls.__doc__ or "")
    if doc and not doc.startswith(cls.__name__ + "("):
        lines.append(doc + "\n")
    lines.append("options (key=value; nested keys with dots):")
    for key, tp, default, help_ in iter_options(cls):
        lines.append(f"  {key} ({_type_name(tp)}, default: {default!r})")
        if help_:
            lines.append(f"      {help_}")
    return "\n".join(lines)


def _all_keys(cls) -> list[str]:
    return [k for k, *_ in iter_options(cls)]


def _suggest(cls, bad_key: str) -> str:
    keys = _all_keys(cls)
    close = difflib.get_close_matches(bad_key, keys, n=1, cutoff=0.5)
    if not close:  # try matching the last component only ("lr" → "actor.optimizer.lr")
        leaf = bad_key.split(".")[-1]
        close = [k for k in keys if k.split(".")[-1] == leaf][:1] or difflib.get_close_matches(
            leaf, keys, n=1, cutoff=0.6
        )
    return f"; did you mean '{close[0]}'?" if close else ""


def _merge_one(base, other, cls, source: str):
    try:
        return OmegaConf.merge(base, other)
    except ConfigKeyError as e:
        key = getattr(e, "full_key", None) or str(e)
        raise ConfigError(
            f"unknown config key '{key}' in {source}{_suggest(cls, key)} "
            f"(run with --help to list every option)"
        ) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "?")
        msg = str(e).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}' in {source}: {msg}") from None


def parse_config(cls, argv: list[str]):
    """Build an instance of dataclass `cls` from `[--config F.yaml] [key=value ...]`."""
    yaml_path = None
    overrides = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config", "-c"):
            yaml_path = next(it, None)
            if yaml_path is None:
                raise ConfigError("--config needs a YAML file path")
        elif arg.startswith("--config="):
            yaml_path = arg.split("=", 1)[1]
        # A leading "-" means a mistyped flag ("--lr=1"), never a key.
        elif "=" in arg and not arg.startswith("-"):
            overrides.append(arg)
        else:
            raise ConfigError(
                f"cannot parse argument '{arg}': expected '--config FILE.yaml' or 'key=value'"
            )
    loaded = None
    if yaml_path is not None:
        path = pathlib.Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file '{yaml_path}' does not exist")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"cannot read config file '{yaml_path}': {e}") from None
    conf = _merge_sources(cls, [], loaded, yaml_path, overrides)
    # An embedded task (``task=tiny_long``) brings its own defaults (e.g. longer answers),
    # an algorithm preset (``algo=dapo``) its options: merge again with them just above the
    # dataclass defaults, so that the YAML file and the command line still win over them.
    presets = _presets(cls, conf)
    if presets:
        conf = _merge_sources(cls, presets, loaded, yaml_path, overrides)
    return _to_object(conf)


#: preset hooks, lowest priority first: (config key, classmethod of the config class that
#: maps the key's value to ``key=value`` defaults)
PRESET_HOOKS = (("task", "task_overrides"), ("algo", "algo_overrides"))


def _presets(cls, conf) -> list[tuple[str, str]]:
    """``(source, key=value)`` of every preset the chosen values bring, in merge order."""
    out = []
    for key, hook_name in PRESET_HOOKS:
        value = conf.get(key) if key in conf else None
        hook = getattr(cls, hook_name, None)
        if value is None or hook is None:
            continue
        try:
            out += [(f"{key} preset '{ov}'", ov) for ov in hook(value)]
        except ValueError as e:  # an unknown preset name: the hook says which exist
            raise ConfigError(str(e)) from None
    return out


def _merge_sources(cls, presets: list[tuple[str, str]], loaded, yaml_path, overrides: list[str]):
    # Merge order, later wins: dataclass defaults < task presets < algorithm presets <
    # YAML file < each override in command-line order.  Merging one source at a time lets
    # an error name the source it came from.  Nothing is validated beyond types until
    # _to_object() builds the dataclasses, so a YAML value that is invalid alone may still
    # be fixed by a later override.
    conf = OmegaConf.structured(cls)
    for source, ov in presets:
        conf = _merge_one(conf, OmegaConf.from_dotlist([ov]), cls, source)
    if loaded is not None:
        conf = _merge_one(conf, loaded, cls, f"config file '{yaml_path}'")
    for ov in overrides:
        try:
            dot = OmegaConf.from_dotlist([ov])
        except Exception as e:
            raise ConfigError(f"cannot parse override '{ov}': {e}") from None
        conf = _merge_one(conf, dot, cls, f"override '{ov}'")
    return conf


def config_from_dict(cls, values: dict, source: str):
    """Build an instance of dataclass `cls` from an already-parsed nested dict.

    Unlike `key=value` overrides, the values are taken as they are (no YAML parsing of
    strings), so ``"010"``, ``"yes"`` or ``"a: b"`` stay strings and list items keep their
    commas; unknown keys and type errors are ConfigErrors naming `source`.
    """
    conf = _merge_one(OmegaConf.structured(cls), OmegaConf.create(values), cls, source)
    return _to_object(conf)


def _to_object(conf):
    # to_object() instantiates the real dataclasses, innermost first, so every
    # __post_init__ check runs here, on the fully merged values.
    try:
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config: {str(e).splitlines()[0]}") from None


def to_yaml(cfg) -> str:
    """The resolved config as YAML (saved in the run directory as config.yaml)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
