"""What an experiment asks of the system: which workers, their configs, and in what order.

An *experiment* is a registered factory that returns an :class:`ExperimentConfig`:
for each worker type the list of per-index worker configs (plain dataclasses,
pickled to the workers), the order in which the controller configures the
types, and what counts as "finished".  Workers (``realhf.system``) never import
``realhf.experiments``; the controller process rebuilds the experiment from
its registered name and sends each worker its own slice together with a
:class:`WorkerInformation`.

    register_experiment("my-exp", lambda **kw: ExperimentConfig(workers={...}))
    cfg = make_experiment("my-exp", **kwargs)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from realhf.api.core.registry import Registry

__all__ = [
    "DEFAULT_CONFIGURE_ORDER",
    "WorkerInformation",
    "Scheduling",
    "ExperimentConfig",
    "register_experiment",
    "make_experiment",
    "registered_experiments",
]

# The controller configures worker types in this order: servers first, so that
# the workers that connect to them find their addresses (name_resolve).
DEFAULT_CONFIGURE_ORDER: Tuple[str, ...] = (
    "generation_server",
    "gserver_manager",
    "model_worker",
    "master_worker",
    "rollout_worker",
)


def _check_name(kind: str, v: str) -> None:
    if not isinstance(v, str) or not v or "/" in v:
        raise ValueError(f"{kind} must be a non-empty string without '/', got {v!r}.")


@dataclasses.dataclass(frozen=True)
class WorkerInformation:
    """Who a worker is: sent with ``configure`` so the worker can check it."""

    experiment_name: str
    trial_name: str
    worker_type: str
    worker_index: int
    worker_count: int

    def __post_init__(self):
        _check_name("experiment_name", self.experiment_name)
        _check_name("trial_name", self.trial_name)
        _check_name("worker_type", self.worker_type)
        if not isinstance(self.worker_count, int) or self.worker_count < 1:
            raise ValueError(f"worker_count must be an int >= 1, got {self.worker_count!r}.")
        if not isinstance(self.worker_index, int) or not 0 <= self.worker_index < self.worker_count:
            raise ValueError(
                f"worker_index must be an int in [0, {self.worker_count}), "
                f"got {self.worker_index!r}."
            )

    @property
    def worker_name(self) -> str:
        """``{worker_type}/{worker_index}``, the name used in keys and logs."""
        return f"{self.worker_type}/{self.worker_index}"


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """Resources one process of a worker type needs (read by launchers).

    ``gpu`` devices per process (0 = CPU only); ``env`` extra environment
    variables for the process.
    """

    cpu: int = 1
    gpu: int = 0
    mem_mb: int = 1024
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for f in ("cpu", "gpu", "mem_mb"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Scheduling.{f} must be an int >= 0, got {v!r}.")


@dataclasses.dataclass
class ExperimentConfig:
    """The workers of an experiment.

    Attributes:
        workers: worker type -> one config per worker index (the worker's
            ``config_class`` instances).
        configure_order: the order in which the controller configures worker
            types; every type in ``workers`` must appear in it.
        completion_types: the run has finished when every worker of these
            types is COMPLETED; empty means all workers.
        scheduling: per worker type resources; default ``Scheduling()``.
        restartable_types: worker types that hold no training state (generation
            servers, rollout workers): a lost or failed one is restarted alone —
            relaunched by the launcher, configured and started again by the
            controller — while the others keep running.  Any other worker's loss
            stops the run (and ``recover_mode=auto`` relaunches everything).
        max_worker_restarts: restarts each restartable worker may get in one launch;
            one more failure stops the run.
    """

    workers: Dict[str, List[Any]]
    configure_order: Sequence[str] = DEFAULT_CONFIGURE_ORDER
    completion_types: Sequence[str] = ()
    scheduling: Dict[str, Scheduling] = dataclasses.field(default_factory=dict)
    restartable_types: Sequence[str] = ()
    max_worker_restarts: int = 3

    def __post_init__(self):
        if not isinstance(self.workers, dict) or not self.workers:
            raise ValueError(
                "ExperimentConfig.workers must be a non-empty dict {worker_type: [config, ...]}."
            )
        for t, cfgs in self.workers.items():
            _check_name("worker type", t)
            if not isinstance(cfgs, (list, tuple)) or not cfgs:
                raise ValueError(
                    f"ExperimentConfig.workers[{t!r}] must be a non-empty list of configs "
                    f"(one per worker index), got {cfgs!r}."
                )
        self.configure_order = tuple(self.configure_order)
        missing = [t for t in self.workers if t not in self.configure_order]
        if missing:
            raise ValueError(
                f"ExperimentConfig.configure_order {list(self.configure_order)} does not "
                f"list worker types {missing}; add them where they should be configured."
            )
        self.completion_types = tuple(self.completion_types)
        unknown = [t for t in self.completion_types if t not in self.workers]
        unknown += [t for t in self.scheduling if t not in self.workers]
        self.restartable_types = tuple(self.restartable_types)
        unknown += [t for t in self.restartable_types if t not in self.workers]
        if unknown:
            raise ValueError(
                f"ExperimentConfig names worker types {unknown} in completion_types/"
                f"scheduling/restartable_types that have no workers; known types: "
                f"{sorted(self.workers)}."
            )
        if not isinstance(self.max_worker_restarts, int) or self.max_worker_restarts < 0:
            raise ValueError(
                f"ExperimentConfig.max_worker_restarts must be an int >= 0, got "
                f"{self.max_worker_restarts!r}."
            )

    @property
    def ordered_types(self) -> List[str]:
        """Worker types present in this experiment, in configure order."""
        return [t for t in self.configure_order if t in self.workers]

    def worker_names(self) -> List[str]:
        """All worker names (``type/index``) in configure order."""
        return [f"{t}/{i}" for t in self.ordered_types for i in range(len(self.workers[t]))]

    def worker_info(
        self, experiment_name: str, trial_name: str, worker_type: str, index: int
    ) -> WorkerInformation:
        """The :class:`WorkerInformation` of worker ``worker_type/index``."""
        return WorkerInformation(
            experiment_name, trial_name, worker_type, index, len(self.workers[worker_type])
        )

    def scheduling_of(self, worker_type: str) -> Scheduling:
        """Resources of ``worker_type`` (defaults when unset)."""
        return self.scheduling.get(worker_type, Scheduling())


#: experiment name -> ``factory(**kwargs) -> ExperimentConfig`` (what the controller and every
#: worker rebuild a run from; a quickstart experiment registers its builder here too)
EXPERIMENTS: Registry[ExperimentConfig] = Registry("experiment")


def register_experiment(name: str, factory: Callable[..., ExperimentConfig]) -> None:
    """Register ``factory(**kwargs) -> ExperimentConfig`` under ``name``.

    Registering the same factory twice is a no-op (modules may be imported twice under
    pytest); a different factory under a taken name is a ``RegistryError``.
    """
    EXPERIMENTS.register(name, factory)


def make_experiment(name: str, **kwargs) -> ExperimentConfig:
    """Build the experiment registered as ``name`` with ``kwargs``."""
    if name not in EXPERIMENTS:
        raise ValueError(
            f"No experiment registered as {name!r}; registered: {registered_experiments()}. "
            "Import the module that registers it (realhf.apps.remote --import MODULE)."
        )
    cfg = EXPERIMENTS.get(name)(**kwargs)
    if not isinstance(cfg, ExperimentConfig):
        raise TypeError(
            f"experiment factory {name!r} returned {type(cfg).__name__}, expected ExperimentConfig."
        )
    return cfg


def registered_experiments() -> List[str]:
    """Names of all registered experiments, sorted."""
    return EXPERIMENTS.names()
