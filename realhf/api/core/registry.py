"""Abstractions (a registered name + its arguments) and the registries that resolve them.

An experiment config never holds classes, only data: ``InterfaceAbstraction("ppo_actor",
args={"eps_clip": 0.2})``.  Implementations register a name when their module is imported
(``register_interface("ppo_actor", PPOActorInterface)``) and the process that runs them turns
the abstraction into an object with ``make_interface(abstraction)``.  A user adds an algorithm,
a dataset, an agent or an environment by writing a class and registering it; no system code
changes.

Unknown names raise :class:`RegistryError` listing the registered names and the closest match;
arguments the class does not accept raise it too, naming the class and what it accepts.

One registry story: everything that is added by name is a :class:`Registry` with these rules —
interfaces, datasets, agents and environments (here), the experiments the workers rebuild
(``realhf.api.core.system_api.EXPERIMENTS``) and the quickstart experiments of the command line
(``realhf.experiments.registry.QUICKSTART``).  :mod:`realhf.apps.plugins` is not a registry: it
is how a module of yours gets imported in every process of a run, so that it registers.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Callable, Dict, Generic, List, Optional, TypeVar, Union

__all__ = [
    "RegistryError",
    "Registry",
    "DatasetAbstraction",
    "InterfaceAbstraction",
    "BackendAbstraction",
    "ModelAbstraction",
    "AgentAbstraction",
    "EnvAbstraction",
    "register_dataset",
    "make_dataset",
    "register_interface",
    "make_interface",
    "register_backend",
    "make_backend",
    "register_model",
    "make_model",
    "register_agent",
    "make_agent",
    "register_env",
    "make_env",
    "DATASETS",
    "INTERFACES",
    "BACKENDS",
    "MODELS",
    "AGENTS",
    "ENVS",
]


class RegistryError(LookupError):
    """An unknown registered name, a duplicate registration or arguments a class rejects."""


@dataclasses.dataclass
class _Abstraction:
    """A registered implementation name plus the keyword arguments for its constructor."""

    type_: str
    args: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        kind = type(self).__name__
        if not isinstance(self.type_, str) or not self.type_:
            raise ValueError(
                f"{kind}.type_ must be a non-empty registered name, got {self.type_!r}"
            )
        if self.args is None:
            self.args = {}
        if not isinstance(self.args, dict) or not all(isinstance(k, str) for k in self.args):
            raise ValueError(
                f"{kind}({self.type_!r}).args must be a dict of keyword arguments "
                f"with string keys, got {self.args!r}"
            )


class DatasetAbstraction(_Abstraction):
    """A dataset by registered name, e.g.
    ``DatasetAbstraction("math_code_prompt", {"path": ...})``."""


class InterfaceAbstraction(_Abstraction):
    """A :class:`~realhf.api.core.model_api.ModelInterface` by registered name (an algorithm)."""


class BackendAbstraction(_Abstraction):
    """A model backend (how a module is trained or run) by registered name."""


class ModelAbstraction(_Abstraction):
    """A model constructor by registered name (e.g. a ReaLModel built from an HF directory)."""


class AgentAbstraction(_Abstraction):
    """An :class:`~realhf.api.core.agent_api.Agent` by registered name."""


class EnvAbstraction(_Abstraction):
    """An :class:`~realhf.api.core.agent_api.EnvironmentService` by registered name."""


T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> factory (usually a class) for one kind of component.

    Registering the same name twice is an error unless it is the same object (or the same
    class re-created by re-importing its module), so two implementations can never silently
    shadow each other.
    """

    def __init__(self, kind: str, abstraction: Optional[type] = None):
        self.kind = kind
        self.abstraction = abstraction
        self._entries: Dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> Callable[..., T]:
        """Register ``factory`` under ``name``; returns the factory (usable as a decorator body)."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} names must be non-empty strings, got {name!r}")
        if not callable(factory):
            raise RegistryError(f"{self.kind} {name!r}: {factory!r} is not callable")
        old = self._entries.get(name)
        # Same qualified name counts as the same factory: re-importing a module
        # (importlib.reload, or a script that is also imported as a module)
        # re-creates its classes and registers them again.
        if old is not None and old is not factory and _identity(old) != _identity(factory):
            raise RegistryError(
                f"{self.kind} {name!r} is already registered to {_identity(old)}; "
                f"cannot register {_identity(factory)} under the same name"
            )
        self._entries[name] = factory
        return factory

    def names(self) -> List[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered under ``name``; unknown names get a helpful error."""
        try:
            return self._entries[name]
        except KeyError:
            pass
        close = difflib.get_close_matches(str(name), self._entries, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise RegistryError(
            f"unknown {self.kind} {name!r}; {hint}registered {self.kind}s: {self.names()} "
            f"(an implementation registers itself when its module is imported)"
        )

    def check(self, cfg: Union[_Abstraction, str], *args, **kwargs) -> Callable[..., T]:
        """The factory :meth:`make` would call for ``cfg``, after the checks it would run
        (a registered name, arguments the factory accepts); nothing is built.  Lets a
        launcher reject a config before any process starts."""
        if isinstance(cfg, str):
            cfg = self.abstraction(cfg)
        if not isinstance(cfg, _Abstraction):
            raise RegistryError(
                f"make_{self.kind} expects a {self.abstraction.__name__} or a name, got {cfg!r}"
            )
        factory = self.get(cfg.type_)
        both = sorted(set(kwargs) & set(cfg.args))
        if both:
            raise RegistryError(
                f"{self.kind} {cfg.type_!r}: arguments {both} are set by the system; "
                "remove them from args"
            )
        _check_accepts(self.kind, cfg.type_, factory, args, {**kwargs, **cfg.args})
        return factory

    def make(self, cfg: Union[_Abstraction, str], *args, **kwargs) -> T:
        """Build ``cfg``: ``factory(*args, **kwargs, **cfg.args)``.

        ``args``/``kwargs`` are what the calling system supplies (e.g. a tokenizer); ``cfg.args``
        are the user's options.  A key given by both is an error.
        """
        if isinstance(cfg, str):
            cfg = self.abstraction(cfg)
        factory = self.check(cfg, *args, **kwargs)
        return factory(*args, **kwargs, **cfg.args)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _identity(entry: Any) -> str:
    """What makes two registrations the same: an entry's own ``registry_identity()`` (an
    object that bundles functions, e.g. a quickstart experiment), else its qualified name."""
    own = getattr(entry, "registry_identity", None)
    return own() if callable(own) else _qualname(entry)


def _check_accepts(kind: str, name: str, factory: Callable, args: tuple, kwargs: Dict[str, Any]):
    """Fail before construction, naming the rejected keywords and the accepted ones."""
    # Binding against the signature instead of calling and catching TypeError:
    # a TypeError raised inside a constructor is a bug there, not a bad config,
    # and must not be reported as one.
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        accepted = [p for p in sig.parameters if p != "self"]
        raise RegistryError(
            f"{kind} {name!r} ({_qualname(factory)}) rejects the arguments {sorted(kwargs)}: {e}; "
            f"it accepts {accepted}"
        ) from None


DATASETS: Registry = Registry("dataset", DatasetAbstraction)
INTERFACES: Registry = Registry("interface", InterfaceAbstraction)
BACKENDS: Registry = Registry("backend", BackendAbstraction)
MODELS: Registry = Registry("model", ModelAbstraction)
AGENTS: Registry = Registry("agent", AgentAbstraction)
ENVS: Registry = Registry("env", EnvAbstraction)


def register_dataset(name: str, cls: Callable) -> Callable:
    """Register a dataset class; built by :func:`make_dataset`."""
    return DATASETS.register(name, cls)


def make_dataset(cfg: Union[DatasetAbstraction, str], *args, **kwargs):
    """Build a registered dataset: ``cls(*args, **kwargs, **cfg.args)``."""
    return DATASETS.make(cfg, *args, **kwargs)


def register_interface(name: str, cls: Callable) -> Callable:
    """Register a ModelInterface subclass (an algorithm); built by :func:`make_interface`."""
    return INTERFACES.register(name, cls)


def make_interface(cfg: Union[InterfaceAbstraction, str], *args, **kwargs):
    """Build a registered interface: ``cls(*args, **kwargs, **cfg.args)``."""
    return INTERFACES.make(cfg, *args, **kwargs)


def register_backend(name: str, cls: Callable) -> Callable:
    """Register a model backend; built by :func:`make_backend`."""
    return BACKENDS.register(name, cls)


def make_backend(cfg: Union[BackendAbstraction, str], *args, **kwargs):
    """Build a registered backend: ``cls(*args, **kwargs, **cfg.args)``."""
    return BACKENDS.make(cfg, *args, **kwargs)


def register_model(name: str, factory: Callable) -> Callable:
    """Register a model constructor; built by :func:`make_model`."""
    return MODELS.register(name, factory)


def make_model(cfg: Union[ModelAbstraction, str], *args, **kwargs):
    """Build a registered model: ``factory(*args, **kwargs, **cfg.args)``."""
    return MODELS.make(cfg, *args, **kwargs)


def register_agent(name: str, cls: Callable) -> Callable:
    """Register an Agent subclass; built by :func:`make_agent`."""
    return AGENTS.register(name, cls)


def make_agent(cfg: Union[AgentAbstraction, str], *args, **kwargs):
    """Build a registered agent: ``cls(*args, **kwargs, **cfg.args)``."""
    return AGENTS.make(cfg, *args, **kwargs)


def register_env(name: str, cls: Callable) -> Callable:
    """Register an EnvironmentService subclass; built by :func:`make_env`."""
    return ENVS.register(name, cls)


def make_env(cfg: Union[EnvAbstraction, str], *args, **kwargs):
    """Build a registered environment: ``cls(*args, **kwargs, **cfg.args)``."""
    return ENVS.make(cfg, *args, **kwargs)
