"""The actor of ``ppo-math`` / ``async-ppo-math``, with its algorithm chosen on the command line.

    python -m realhf.apps.quickstart ppo-math --import my_algo \\
        actor.train_interface=my_algo actor.train_interface_args.lr_scale=0.5

Each of the actor's MFCs runs a registered :class:`~realhf.api.core.model_api.ModelInterface`:

==================  ==================================  ======================================
option              MFCs                                method called
==================  ==================================  ======================================
train_interface     actor_train                         ``train_step``
gen_interface       actor_gen (ppo-math only)           ``generate``
inf_interface       actor_inf, ref_inf                  ``inference`` (must write ``logprobs``)
==================  ==================================  ======================================

The default, the built-in ``ppo_actor``, takes its options from ``ppo.*``; any other
interface gets its ``*_interface_args`` as keyword arguments, plus ``rollout``, the run's
:class:`~realhf.api.core.model_api.RolloutContext` (``ppo.group_size`` and the log-prob
temperature), when its constructor declares that parameter.  An interface that assumes
another group size or temperature (a ``group_size`` / ``temperature`` option given, or
defaulted, to another value) fails when the experiment is built.  Names are checked
against the interface registry when the config is built, so a module that registers one must
be imported first (``quickstart --import MODULE``, ``$REALHF_PLUGINS`` or the
``realhf.plugins`` entry-point group): an unknown name fails at once with the closest match.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import field
from typing import Any, Dict, Mapping, NamedTuple

from realhf.api.cli_args import ModelConfig
from realhf.api.core.model_api import ModelInterface, RolloutContext
from realhf.api.core.registry import INTERFACES, InterfaceAbstraction, RegistryError

#: the interface every actor MFC runs unless told otherwise; configured by ``ppo.*``
BUILTIN = "ppo_actor"
#: the module that registers the built-in interfaces
BUILTIN_MODULE = "realhf.impl.model.interface"

#: option prefix -> the ModelInterface method its MFCs call
ROLES = {"train": "train_step", "gen": "generate", "inf": "inference"}
#: the constructor parameter that receives the run's RolloutContext
ROLLOUT_ARG = "rollout"
#: RolloutContext field -> the option of the run that sets it
RUN_OPTIONS = {
    "group_size": "ppo.group_size",
    "temperature": "ppo.gen.temperature (or ppo.temperature)",
}

_PLUGIN_HINT = (
    "import the module that registers it with `quickstart --import MODULE` (or "
    "REALHF_PLUGINS=MODULE, or a 'realhf.plugins' entry point)"
)


class ActorInterfaces(NamedTuple):
    """The interface of each kind of actor MFC."""

    train: InterfaceAbstraction
    gen: InterfaceAbstraction
    inf: InterfaceAbstraction


def _name_help(role: str, mfcs: str) -> str:
    return (
        f"registered interface whose {ROLES[role]}() runs {mfcs}; '{BUILTIN}' (configured by "
        f"ppo.*) or one a plugin registers (--import MODULE), given "
        f"actor.{role}_interface_args.* as keyword arguments"
    )


def _args_help(role: str) -> str:
    return (
        f"keyword arguments of actor.{role}_interface, e.g. "
        f"actor.{role}_interface_args.decay=0.9 (none for '{BUILTIN}': it reads ppo.*)"
    )


@dataclasses.dataclass
class ActorConfig(ModelConfig):
    """The trained policy: a model role plus the interfaces (algorithms) of its MFCs."""

    train_interface: str = field(
        default=BUILTIN, metadata={"help": _name_help("train", "actor_train")}
    )
    train_interface_args: Dict[str, Any] = field(
        default_factory=dict, metadata={"help": _args_help("train")}
    )
    gen_interface: str = field(
        default=BUILTIN,
        metadata={
            "help": _name_help("gen", "actor_gen")
            + "; async-ppo-math generates in its generation servers and accepts only "
            f"'{BUILTIN}' here (ppo.gen.* sets sampling)"
        },
    )
    gen_interface_args: Dict[str, Any] = field(
        default_factory=dict, metadata={"help": _args_help("gen")}
    )
    inf_interface: str = field(
        default=BUILTIN,
        metadata={
            "help": _name_help(
                "inf",
                "actor_inf and ref_inf (the proximal and reference "
                "log-probs; it must write the key 'logprobs')",
            )
        },
    )
    inf_interface_args: Dict[str, Any] = field(
        default_factory=dict, metadata={"help": _args_help("inf")}
    )

    def __post_init__(self):
        super().__post_init__()
        for role in ROLES:
            check_interface(self, role)

    def custom(self, role: str) -> bool:
        """Whether ``role``'s MFCs run an interface other than the built-in one."""
        return getattr(self, f"{role}_interface") != BUILTIN

    def interfaces(self, ppo_hparams) -> ActorInterfaces:
        """The abstraction of each kind of actor MFC: the built-in interface gets
        ``ppo_hparams``, any other its ``*_interface_args``; both get ``rollout`` (the
        run's :class:`RolloutContext`) as :func:`contract_args` says.

        Raises:
            ValueError: an interface assumes another group size or temperature.
        """
        rollout = ppo_hparams.rollout
        out = {}
        for role in ROLES:
            check_interface(self, role)  # again: a config may be changed after it was built
            name = getattr(self, f"{role}_interface")
            if name == BUILTIN:
                args = {"hparams": ppo_hparams, ROLLOUT_ARG: rollout}
            else:
                args = contract_args(f"actor.{role}_interface", name, self._args(role), rollout)
            out[role] = InterfaceAbstraction(name, args)
        return ActorInterfaces(**out)

    def _args(self, role: str) -> Dict[str, Any]:
        return getattr(self, f"{role}_interface_args") or {}


def check_interface(cfg: ActorConfig, role: str) -> None:
    """Fail (ValueError naming the option) unless ``actor.{role}_interface`` is registered,
    implements the method its MFCs call, accepts its arguments and can be imported by the
    worker processes."""
    importlib.import_module(BUILTIN_MODULE)  # the built-in names are always known
    key, name, args = f"actor.{role}_interface", getattr(cfg, f"{role}_interface"), cfg._args(role)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{key}={name!r}: give a registered interface name, e.g. '{BUILTIN}'")
    if name == BUILTIN:
        if args:
            raise ValueError(
                f"{key}_args={args!r}: '{BUILTIN}' takes its options from ppo.* (see --help); "
                f"{key}_args applies to another {key}"
            )
        return
    try:
        factory = INTERFACES.get(name)
        # `rollout` comes from the experiment when it is built: bind a stand-in for it here.
        system = {ROLLOUT_ARG: None} if ROLLOUT_ARG in _params(factory) else {}
        INTERFACES.check(InterfaceAbstraction(name, dict(args)), **system)
    except RegistryError as e:
        hint = f"; {_PLUGIN_HINT}" if name not in INTERFACES else ""
        raise ValueError(f"{key}={name!r}: {e}{hint}") from None
    method = ROLES[role]
    if isinstance(factory, type) and issubclass(factory, ModelInterface):
        if getattr(factory, method) is getattr(ModelInterface, method):
            raise ValueError(
                f"{key}={name!r}: {factory.__qualname__} does not implement {method}(), which "
                f"the MFCs of actor.{role}_interface call; implement it or choose another"
            )
    if getattr(factory, "__module__", None) == "__main__":
        raise ValueError(
            f"{key}={name!r}: {getattr(factory, '__qualname__', factory)} is defined in the "
            "script being run (__main__), which the worker processes cannot import. Move it "
            "into a module (e.g. my_algo.py) and run `python -m realhf.apps.quickstart ... "
            "--import my_algo` from its directory (or with it on PYTHONPATH)"
        )


def contract_args(key: str, name: str, args: Dict[str, Any], rollout: RolloutContext) -> dict:
    """The keyword arguments of interface ``name`` (option ``key``): the user's ``args``,
    plus ``rollout`` when its constructor declares that parameter.

    Raises:
        ValueError: ``args`` sets ``rollout`` itself, or the interface assumes another
            group size or temperature than the run's: a ``group_size`` / ``temperature``
            option given in ``args``, or left at a constructor default, that differs.
    """
    if ROLLOUT_ARG in args:
        raise ValueError(
            f"{key}_args.{ROLLOUT_ARG} is set by the experiment (the run's group size and "
            f"temperature, from ppo.*); remove it"
        )
    params = _params(INTERFACES.get(name))
    for field_name, option in RUN_OPTIONS.items():
        if field_name in args:
            assumed, how = args[field_name], f"{key}_args.{field_name}"
            fix = f"remove {how} or set {option} to {assumed!r}"
        elif _default(params, field_name) is not None:
            assumed, how = _default(params, field_name), f"its default {field_name}"
            run_value = getattr(rollout, field_name)
            fix = f"pass {key}_args.{field_name}={run_value!r} or set {option} to {assumed!r}"
        else:
            continue
        if ROLLOUT_ARG in params:
            fix += f", or drop the option and read {ROLLOUT_ARG}.{field_name}"
        else:
            fix += (
                f", or declare a `{ROLLOUT_ARG}` parameter (a RolloutContext: the run's "
                "group_size and temperature) and drop the option"
            )
        rollout.require(f"{key}={name!r} ({how})", fix, **{field_name: assumed})
    out = dict(args)
    if ROLLOUT_ARG in params:
        out[ROLLOUT_ARG] = rollout
    return out


def _default(params, name: str) -> Any:
    """The constructor's default for ``name``; None when it has none (or defaults to None,
    which assumes nothing)."""
    p = params.get(name)
    if p is None or p.default is inspect.Parameter.empty:
        return None
    return p.default


def _params(factory) -> Mapping[str, inspect.Parameter]:
    """The constructor's parameters by name (none when it has no signature to read)."""
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
