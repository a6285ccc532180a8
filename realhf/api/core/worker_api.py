"""Configs of the DAG workers: the master worker and the model workers.

An experiment (``realhf.experiments``) compiles to one :class:`MasterWorkerConfig` and
``n_model_workers`` :class:`ModelWorkerConfig` s (worker type ``master_worker`` /
``model_worker``).  The model workers form one trainer layout ``d × p × m``
(:class:`~realhf.api.core.allocation.ParallelismConfig`, one worker per rank, ranks
row-major over (data, pipe, tensor)) and every model worker hosts *every* model role in
that layout, so all model workers get the same config; each learns its rank (= worker
index) from its ``WorkerInformation``.

All configs are frozen dataclasses that check themselves on construction and raise
``ValueError`` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from realhf.api.cli_args import (
    DTYPES,
    RECOVER_MODES,
    ExperimentControlConfig,
    LoraConfig,
    OptimizerConfig,
)
from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.dfg import MFCDef, build_graph
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import DatasetAbstraction, InterfaceAbstraction
from realhf.api.core.rollout_config import WeightSync
from realhf.api.wandb_args import WandbConfig
from realhf.base.config_checks import Checks

__all__ = [
    "Placements",
    "ModelSpec",
    "EvalSpec",
    "TrajectoryStreamSpec",
    "ModelWorkerConfig",
    "MasterWorkerConfig",
    "call_sizes",
]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model role, hosted on every model worker in the trainer layout.

    Attributes:
        role: the role name MFCs refer to (``actor``, ``critic``, ``ref``...).
        path: HuggingFace directory the weights are loaded from (``ReaLModel.from_hf``).
        dtype: parameter dtype, one of ``float32``, ``bfloat16``, ``float16``.
        is_critic: load with a scalar value head instead of the LM head.
        critic_lm_logits: a critic whose forward also returns its LM logits through the
            tied embedding, ``[T, 1 + vocab]`` (``ReaLModel(critic_lm_logits=True)``): a
            reward model trained with a language-model regulariser.  Needs ``is_critic``.
        trainable: wrap in a ``TrainEngine`` (AdamW); MFCs of type ``train_step`` need it.
        optimizer: AdamW / LR schedule settings of a trainable role (None: defaults).
            Must stay None for a role that is not trainable.
        gradient_checkpointing: recompute activations in backward.
        publish_weights: after each ``train_step`` of this role write an HF directory to
            ``constants.weight_publication_dir(role, version)`` and set
            ``names.model_version(exp, trial, role)`` (for generation servers).
        weight_sync: how ``publish_weights`` publishes (a
            :class:`~realhf.api.core.rollout_config.WeightSync` or its name): ``disk``, the HF
            directory above; ``shm``, a flat weight file at
            ``constants.weight_shm_path(role, version)`` (generation servers on this host).
        offload: keep the weights in host memory between this role's MFCs and bring them
            to the device around each call (a reference or frozen reward model that is idle
            most of a step).  Only for roles that are not trainable; on CPU workers the
            weights are on the host already and nothing moves.
        lora: LoRA adapters of a trainable causal LM (None, or rank 0: train every weight):
            the base weights stay frozen and only the adapters train, are checkpointed and
            published (:mod:`realhf.impl.model.nn.lora`).
        adapters_of: this role is another role's base model, i.e. that role with its LoRA
            adapters off (a LoRA actor's reference policy): it loads no weights of its own
            and its MFCs run where that role lives.  ``path`` must be that role's.
    """

    role: str
    path: str
    dtype: str = "float32"
    is_critic: bool = False
    critic_lm_logits: bool = False
    trainable: bool = False
    optimizer: Optional[OptimizerConfig] = None
    gradient_checkpointing: bool = False
    publish_weights: bool = False
    weight_sync: WeightSync = WeightSync.DISK
    offload: bool = False
    lora: Optional[LoraConfig] = None
    adapters_of: Optional[str] = None

    def __post_init__(self):
        ck = Checks("ModelSpec")
        object.__setattr__(
            self, "weight_sync", ck.enum("weight_sync", self.weight_sync, WeightSync)
        )
        if not isinstance(self.role, str) or not self.role or any(ch in self.role for ch in "/@ "):
            raise ck.bad(
                "role",
                self.role,
                "use a non-empty name without '/', '@' or spaces, e.g. 'actor'",
            )
        if not isinstance(self.path, str) or not self.path:
            raise ck.bad("path", self.path, f"give the HuggingFace directory of role {self.role!r}")
        if self.dtype not in DTYPES:
            raise ck.bad("dtype", self.dtype, f"use one of {DTYPES}")
        ck.bools(
            self,
            "is_critic",
            "critic_lm_logits",
            "trainable",
            "gradient_checkpointing",
            "publish_weights",
            "offload",
        )
        if self.critic_lm_logits and not self.is_critic:
            raise ck.bad("critic_lm_logits", True, "it is for critics: set is_critic=True")
        if self.offload and self.trainable:
            raise ck.bad(
                "offload",
                True,
                f"role {self.role!r} is trainable; its optimizer works on the device "
                "every step, so offload only roles that are not trained (ref, reward)",
            )
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerConfig):
            raise ck.bad("optimizer", self.optimizer, "use an OptimizerConfig or None")
        if not self.trainable and self.optimizer is not None:
            raise ck.bad(
                "optimizer",
                self.optimizer,
                f"role {self.role!r} is not trainable; set trainable=True or drop the optimizer",
            )
        if self.publish_weights and not self.trainable:
            raise ck.bad(
                "publish_weights",
                True,
                f"only a trainable role publishes weights; role {self.role!r} is not",
            )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ck.bad("lora", self.lora, "use a LoraConfig or None")
        if self.has_lora and not self.trainable:
            raise ck.bad(
                "lora",
                f"rank {self.lora.rank}",
                f"role {self.role!r} does not train; LoRA adapters are for trained roles "
                "(set its lora.rank=0)",
            )
        if self.adapters_of is not None and (self.trainable or self.offload):
            raise ck.bad(
                "adapters_of",
                self.adapters_of,
                f"role {self.role!r} runs on {self.adapters_of!r}'s weights: it cannot train "
                "or be offloaded",
            )

    @property
    def has_lora(self) -> bool:
        """Whether this role trains LoRA adapters."""
        return self.lora is not None and self.lora.enabled

    @property
    def optimizer_config(self) -> OptimizerConfig:
        """The optimizer of a trainable role (defaults when ``optimizer`` is None)."""
        return self.optimizer if self.optimizer is not None else OptimizerConfig()


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What ``evaluate`` runs on each model worker: ``interface.evaluate`` of one role.

    The interface's ``evaluate(model, data, mb_spec)`` receives this worker's shard of the
    eval dataset (all items gathered in one ``SequenceSample``; the ranks of a
    data-parallel replica share one shard and evaluate it together) and returns a dict of
    numbers that are *means over those items*; the workers combine the replicas by an
    item-weighted average, so every rank reports the global mean.
    """

    role: str
    interface_impl: InterfaceAbstraction
    mb_spec: MicroBatchSpec = dataclasses.field(default_factory=MicroBatchSpec)

    def __post_init__(self):
        if isinstance(self.interface_impl, str):
            object.__setattr__(self, "interface_impl", InterfaceAbstraction(self.interface_impl))
        if not isinstance(self.interface_impl, InterfaceAbstraction):
            raise Checks("EvalSpec").bad(
                "interface_impl",
                self.interface_impl,
                "use an InterfaceAbstraction or a registered name",
            )
        if not isinstance(self.mb_spec, MicroBatchSpec):
            raise Checks("EvalSpec").bad("mb_spec", self.mb_spec, "use a MicroBatchSpec")


@dataclasses.dataclass(frozen=True)
class TrajectoryStreamSpec:
    """The training data of asynchronous RL: trajectories streamed by rollout workers.

    Model worker 0 pulls :class:`~realhf.api.core.rollout_api.Trajectory` messages from
    push/pull stream ``stream_name`` and hands them to the master in index order, exactly
    ``batch_size`` per step (trajectory ``k`` is trained by step ``k // batch_size``, the
    contract that makes the staleness bound exact); other ranks get their share through the
    master's transfer plan.  An "epoch" is ``epoch_size`` trajectories (the prompt dataset
    rounded down to whole steps) and only paces epoch-based frequencies.

    Attributes:
        epoch_size: trajectories per epoch (a multiple of ``batch_size``).
        batch_size: trajectories per train step (the manager's ``train_batch_size``).
        max_head_offpolicyness: ``η``: a trajectory trained at version ``v`` with
            ``v - version_start > η`` fails the run (the manager should make it impossible).
        stream_name: the push/pull stream rollout workers push to.
        wait_timeout_s: most seconds to wait for one step's trajectories; the error names
            the missing indices.
    """

    epoch_size: int
    batch_size: int
    max_head_offpolicyness: int = 0
    stream_name: str = "rollout"
    wait_timeout_s: float = 600.0

    def __post_init__(self):
        ck = Checks("TrajectoryStreamSpec")
        ck.integer(self, "epoch_size", 1)
        ck.integer(self, "batch_size", 1)
        ck.integer(self, "max_head_offpolicyness", 0)
        if self.epoch_size % self.batch_size:
            raise ck.bad(
                "epoch_size",
                self.epoch_size,
                f"use a multiple of batch_size={self.batch_size} (every step takes a full batch)",
            )
        if not isinstance(self.stream_name, str) or not self.stream_name or "/" in self.stream_name:
            raise ck.bad("stream_name", self.stream_name, "use a non-empty name without '/'")
        ck.seconds(self, "wait_timeout_s", finite=False)


@dataclasses.dataclass(frozen=True)
class Placements:
    """Per-MFC layouts (parameter reallocation): where each MFC runs and where each model
    lives.  Every layout's ranks are the first ``d·p·m`` model workers.

    Attributes:
        mfcs: ``{mfc name: layout}`` of the MFCs that do not run on the workers' base layout.
        homes: ``{role: layout}``: the layout holding a model's weights (and optimizer
            state); roles not named live on the base layout.
        weightless: MFCs whose interface reads no weights (nothing is reallocated for them;
            they get their role's model only where it lives).
        keep_replicas: keep a replica's memory between its calls (reallocated only when
            its model trained since); False frees it after every call and reallocates
            before the next (for memory-tight devices).
        manual: the allocation gave layouts per MFC (also when they all equal the base).
    """

    mfcs: Dict[str, ParallelismConfig] = dataclasses.field(default_factory=dict)
    homes: Dict[str, ParallelismConfig] = dataclasses.field(default_factory=dict)
    weightless: FrozenSet[str] = frozenset()
    keep_replicas: bool = True
    manual: bool = False

    def __post_init__(self):
        for f in ("mfcs", "homes"):
            d = getattr(self, f)
            if not isinstance(d, dict) or not all(
                isinstance(k, str) and isinstance(v, ParallelismConfig) for k, v in d.items()
            ):
                raise Checks("Placements").bad(f, d, "use a dict of name -> ParallelismConfig")
        object.__setattr__(self, "weightless", frozenset(self.weightless))

    def of_mfc(self, mfc: str, base: ParallelismConfig) -> ParallelismConfig:
        """The layout ``mfc`` runs on."""
        return self.mfcs.get(mfc, base)

    def home(self, role: str, base: ParallelismConfig) -> ParallelismConfig:
        """The layout that holds ``role``'s weights."""
        return self.homes.get(role, base)

    def on_replica(self, mfc: MFCDef, base: ParallelismConfig) -> bool:
        """Whether ``mfc`` runs on a replica of its model (a layout other than its home)."""
        return mfc.name not in self.weightless and self.of_mfc(mfc.name, base) != self.home(
            mfc.role, base
        )

    @property
    def per_mfc(self) -> bool:
        """Whether layouts were given per MFC."""
        return self.manual or bool(self.mfcs or self.homes)

    def data_layout(self, base: ParallelismConfig) -> ParallelismConfig:
        """The layout whose replica heads load the training data, one shard each: the base
        layout, or with per-MFC layouts one shard on worker 0 (so what a step trains on
        does not depend on the layouts; the master moves every call's part to its ranks)."""
        return ParallelismConfig() if self.per_mfc else base

    def layouts(self, base: ParallelismConfig) -> List[ParallelismConfig]:
        """Every distinct layout (base first, then sorted by name: every worker builds their
        process groups in this order)."""
        rest = {str(x): x for x in list(self.mfcs.values()) + list(self.homes.values())}
        rest.pop(str(base), None)
        return [base] + [rest[k] for k in sorted(rest)]

    def describe(self, base: ParallelismConfig) -> str:
        """A stable one-line description (the base layout alone without per-MFC layouts)."""
        if not self.per_mfc:
            return str(base)
        return ",".join(f"{k}:{v}" for k, v in sorted(self.mfcs.items())) + f";base:{base}"

    def check(self, ck: Checks, mfcs: Sequence[MFCDef], base: ParallelismConfig) -> None:
        """Raise (an error of ``ck``'s config) unless the layouts fit the workers of ``base``
        and the graph ``mfcs``."""
        names = {m.name for m in mfcs}
        roles = {m.role for m in mfcs}
        for what, d, known in (("mfcs", self.mfcs, names), ("homes", self.homes, roles)):
            for k, layout in d.items():
                if k not in known:
                    raise ck.bad("placements", k, f"{what} names {k!r}, not one of {sorted(known)}")
                if layout.world_size > base.world_size:
                    raise ck.bad(
                        "placements",
                        f"{k}:{layout}",
                        f"the layout needs {layout.world_size} model workers; there are "
                        f"{base.world_size}",
                    )
        for m in mfcs:
            if m.is_train and self.on_replica(m, base):
                raise ck.bad(
                    "placements",
                    m.name,
                    f"train_step MFC {m.name!r} runs on {self.of_mfc(m.name, base)}, not on "
                    f"model {m.role!r}'s home layout {self.home(m.role, base)}; a model "
                    "trains where its optimizer state lives",
                )


def _check_mfcs(ck: Checks, mfcs) -> Tuple[MFCDef, ...]:
    mfcs = tuple(mfcs)
    if not mfcs or not all(isinstance(m, MFCDef) for m in mfcs):
        raise ck.bad("mfcs", mfcs, "give a non-empty list of MFCDef")
    build_graph(mfcs)  # raises DFGError naming a cycle / double producer
    for m in mfcs:
        if m.model_name.replica_id != 0:
            raise ck.bad(
                "mfcs",
                m.name,
                f"MFC {m.name!r} uses replica {m.model_name.replica_id} of role {m.role!r}; "
                "use replica 0: an MFC gets its own copy of a model by running on a layout "
                "of its own (per-MFC allocation_mode), not by a replica id",
            )
        if m.is_train and m.output_keys:
            raise ck.bad(
                "mfcs",
                m.name,
                f"train_step MFC {m.name!r} lists output_keys {list(m.output_keys)}; "
                "a train_step returns statistics, not data: drop the output keys",
            )
    return mfcs


@dataclasses.dataclass(frozen=True)
class ModelWorkerConfig:
    """Config of one model worker (the same for every index).

    Attributes:
        seed: experiment seed; per-call randomness derives from (seed, MFC, global step),
            the data order from (seed, epoch).
        models: the roles this worker hosts.
        mfcs: the dataflow graph (the worker runs the MFCs the master names).
        placements: per-MFC layouts and each model's home layout (parameter
            reallocation); empty: every MFC and model on ``layout``.
        layout: the trainer layout the model workers form (``d·p·m`` must equal the number
            of model workers; checked on configure); None: every worker is a data-parallel
            rank (``d`` = the number of workers).
        dataset: the training dataset; the head (pipe 0, tensor 0) of data-parallel replica
            ``k`` loads shard ``k`` of ``d``; the replica's other ranks load none.
        stream: instead of ``dataset``: trajectories streamed by rollout workers (async RL).
        eval_dataset: the held-out dataset ``evaluate`` runs on (shard ``k`` of ``d`` on
            every rank of replica ``k``: they evaluate it together).
        evaluation: which role/interface ``evaluate`` runs (needs ``eval_dataset``).
        tokenizer_path: HF tokenizer directory (empty: no tokenizer; datasets that need one fail).
        dataset_batch_size: most items one ``fetch`` call returns (per worker).
        timeout: seconds any blocking wait may take (process-group setup, data transfer).
        ft_spec: the planned run length; the master's ``initialize`` sends the one measured
            from the loaded datasets, which replaces it.
        imports: modules imported on configure (they register interfaces/datasets).
        torch_num_threads: intra-op threads of this process (None: torch's default).
    """

    seed: int
    models: Sequence[ModelSpec]
    mfcs: Sequence[MFCDef]
    dataset: Optional[DatasetAbstraction]
    ft_spec: FinetuneSpec
    eval_dataset: Optional[DatasetAbstraction] = None
    evaluation: Optional[EvalSpec] = None
    tokenizer_path: str = ""
    dataset_batch_size: int = 64
    timeout: float = 600.0
    imports: Sequence[str] = ()
    torch_num_threads: Optional[int] = None
    stream: Optional[TrajectoryStreamSpec] = None
    layout: Optional[ParallelismConfig] = None
    placements: Placements = dataclasses.field(default_factory=Placements)

    def __post_init__(self):
        ck = Checks("ModelWorkerConfig")
        self._check_layouts(ck)
        self._check_stream(ck)
        ck.integer(self, "seed", 0)
        by_role = self._check_models(ck)
        self._check_graph(ck, by_role)
        self._check_evaluation(ck, by_role)
        self._check_run_settings(ck)

    def _check_layouts(self, ck: Checks) -> None:
        """``layout`` and ``placements`` are of their types (fitted to the graph later)."""
        if self.layout is not None and not isinstance(self.layout, ParallelismConfig):
            raise ck.bad("layout", self.layout, "use a ParallelismConfig (dXpYmZ) or None")
        if not isinstance(self.placements, Placements):
            raise ck.bad("placements", self.placements, "use a Placements")

    def _check_stream(self, ck: Checks) -> None:
        """A stream replaces the dataset, and one fetch holds a whole step of it."""
        if self.stream is None:
            return
        if not isinstance(self.stream, TrajectoryStreamSpec):
            raise ck.bad("stream", self.stream, "use a TrajectoryStreamSpec or None")
        if self.dataset is not None:
            raise ck.bad("dataset", self.dataset, "give either a dataset or a stream, not both")
        if self.dataset_batch_size < self.stream.batch_size:
            raise ck.bad(
                "dataset_batch_size",
                self.dataset_batch_size,
                f"a stream step fetches {self.stream.batch_size} trajectories at once; use >= that",
            )

    def _check_models(self, ck: Checks) -> Dict[str, ModelSpec]:
        """``models`` is a non-empty list of ModelSpec, one per role; returns them by role."""
        models = tuple(self.models)
        if not models or not all(isinstance(m, ModelSpec) for m in models):
            raise ck.bad("models", self.models, "give a non-empty list of ModelSpec")
        roles = [m.role for m in models]
        dup = sorted({r for r in roles if roles.count(r) > 1})
        if dup:
            raise ck.bad("models", dup, "each role may appear once")
        # Frozen dataclass: normalise through object.__setattr__.  Tuples keep
        # the config immutable after the checks, even if the caller's lists
        # change later.
        object.__setattr__(self, "models", models)
        return {m.role: m for m in models}

    def _check_graph(self, ck: Checks, by_role: Dict[str, ModelSpec]) -> None:
        """``mfcs`` is a valid graph that fits the layouts, and every MFC runs on a hosted
        role (a trainable one for a ``train_step``)."""
        mfcs = _check_mfcs(ck, self.mfcs)
        object.__setattr__(self, "mfcs", mfcs)
        if self.layout is not None:
            self.placements.check(ck, mfcs, self.layout)
        roles = list(by_role)
        for m in mfcs:
            if m.role not in by_role:
                raise ck.bad(
                    "mfcs",
                    m.name,
                    f"MFC {m.name!r} runs on role {m.role!r}, which is not in models {roles}",
                )
            if m.is_train and not by_role[m.role].trainable:
                raise ck.bad(
                    "models",
                    m.role,
                    f"MFC {m.name!r} trains role {m.role!r}; "
                    f"set ModelSpec(role={m.role!r}, trainable=True)",
                )
        self._check_lora(ck, by_role, mfcs)

    def _check_lora(self, ck: Checks, by_role: Dict[str, ModelSpec], mfcs) -> None:
        """A role on another's base (``adapters_of``) names a LoRA role of the same path;
        LoRA roles run every MFC at home (reallocation to other layouts does not carry
        adapters yet)."""
        for spec in by_role.values():
            host = by_role.get(spec.adapters_of) if spec.adapters_of is not None else spec
            if spec.adapters_of is not None and (host is None or not host.has_lora):
                raise ck.bad(
                    "models",
                    spec.role,
                    f"adapters_of={spec.adapters_of!r}: no role with LoRA adapters of that name "
                    f"in models {list(by_role)}",
                )
            if spec.adapters_of is not None and host.path != spec.path:
                raise ck.bad(
                    "models",
                    spec.role,
                    f"role {spec.role!r} is {host.role!r}'s base model, so its path must be "
                    f"{host.path!r}, not {spec.path!r} (give it its own weights without "
                    "adapters_of)",
                )
            if not host.has_lora or self.layout is None:
                continue
            home = self.placements.home(spec.role, self.layout)
            for m in mfcs:
                if m.role == spec.role and self.placements.on_replica(m, self.layout):
                    raise ck.bad(
                        "placements",
                        m.name,
                        f"MFC {m.name!r} of LoRA role {spec.role!r} runs on another layout "
                        f"than its home {home}; reallocation does not carry adapters yet: "
                        "place it at home",
                    )
            if spec.adapters_of is not None and home != self.placements.home(
                host.role, self.layout
            ):
                raise ck.bad(
                    "placements",
                    spec.role,
                    f"role {spec.role!r} runs on {host.role!r}'s weights: give it the same "
                    "home layout",
                )

    def _check_evaluation(self, ck: Checks, by_role: Dict[str, ModelSpec]) -> None:
        """The datasets are DatasetAbstractions, and ``evaluation`` evaluates a hosted role
        on ``eval_dataset``."""
        for f in ("dataset", "eval_dataset"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, DatasetAbstraction):
                raise ck.bad(f, v, "use a DatasetAbstraction or None")
        if self.evaluation is None:
            return
        if not isinstance(self.evaluation, EvalSpec):
            raise ck.bad("evaluation", self.evaluation, "use an EvalSpec or None")
        if self.evaluation.role not in by_role:
            raise ck.bad(
                "evaluation", self.evaluation.role, f"evaluate a role in models {list(by_role)}"
            )
        if self.eval_dataset is None:
            raise ck.bad("eval_dataset", None, "evaluation needs an eval_dataset")

    def _check_run_settings(self, ck: Checks) -> None:
        """The plain settings: run length, tokenizer, fetch size, timeout, imports, threads."""
        if not isinstance(self.ft_spec, FinetuneSpec):
            raise ck.bad("ft_spec", self.ft_spec, "use a FinetuneSpec")
        if not isinstance(self.tokenizer_path, str):
            raise ck.bad("tokenizer_path", self.tokenizer_path, "use a directory path or ''")
        ck.integer(self, "dataset_batch_size", 1)
        ck.seconds(self, "timeout", finite=False)
        imports = tuple(self.imports)
        if not all(isinstance(x, str) and x for x in imports):
            raise ck.bad("imports", self.imports, "give module names as strings")
        object.__setattr__(self, "imports", imports)
        ck.integer(self, "torch_num_threads", 1, allow_none=True)

    def model_spec(self, role: str) -> ModelSpec:
        """The :class:`ModelSpec` of ``role``."""
        for m in self.models:
            if m.role == role:
                return m
        raise KeyError(f"no model role {role!r}; roles: {[m.role for m in self.models]}")


def call_sizes(step_items: int, n_seqs: int) -> list:
    """How many items each call of an MFC with ``n_seqs`` gets in a step of ``step_items``.

    A step's items go through every MFC in calls of ``n_seqs`` items, oldest first; the
    last call takes what is left.
    """
    full, rest = divmod(step_items, n_seqs)
    return [n_seqs] * full + ([rest] if rest else [])


@dataclasses.dataclass(frozen=True)
class MasterWorkerConfig:
    """Config of the master worker.

    Attributes:
        seed: experiment seed (checked against a recover checkpoint).
        mfcs: the dataflow graph; the same list the model workers got.
        exp_ctrl: run length and save / recover-checkpoint / eval frequencies.
        n_model_workers: how many model workers (``d·p·m`` of ``layout``).
        placements: per-MFC layouts and each model's home layout (see ModelWorkerConfig).
        layout: the trainer layout the model workers form; None: ``d = n_model_workers``
            (plain data parallelism).  The master splits every MFC call over the ``d``
            data-parallel replicas.
        train_batch_size: items per training step (the last step of an epoch may hold fewer).
        ft_spec: the planned run length (the dataset size is re-measured on start).
        timeout: seconds to wait for any model-worker reply before failing, naming them.
        recover_mode: ``disabled``; ``auto`` (resume from the latest complete recover
            checkpoint if there is one); ``resume`` (there must be one).
        recover_dir: root of recover checkpoints; None: ``{run_dir}/checkpoints/recover``.
        max_recover_checkpoints: complete recover checkpoints kept (older ones are deleted).
        log_stats_keys: substrings of stats keys shown in the progress display / log lines
            (every stat always goes to metrics.jsonl and tensorboard); empty: keys that
            contain ``reward`` or ``loss``.
        eval: run ``evaluate`` on the model workers at the eval frequency.
        progress_interval: seconds between plain progress log lines when stdout is no TTY.
        plot_curves: draw ``curves.png`` (the selected stats and eval metrics) at the end.
        wandb: log every step's numbers to Weights & Biases too (mode ``disabled``: not).
        run_config: the resolved experiment config as plain data, the W&B run's config.
        max_fill_rounds: with an MFC that drops items (dynamic sampling), the most rounds
            of fetch → generate → filter one step runs to fill its batch; after them the
            step trains on the items it kept.
    """

    seed: int
    mfcs: Sequence[MFCDef]
    exp_ctrl: ExperimentControlConfig
    n_model_workers: int
    train_batch_size: int
    ft_spec: FinetuneSpec
    timeout: float = 600.0
    recover_mode: str = "disabled"
    recover_dir: Optional[str] = None
    max_recover_checkpoints: int = 1
    log_stats_keys: Sequence[str] = ()
    eval: bool = False
    progress_interval: float = 0.0
    plot_curves: bool = True
    layout: Optional[ParallelismConfig] = None
    placements: Placements = dataclasses.field(default_factory=Placements)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    run_config: Optional[Dict[str, Any]] = None
    max_fill_rounds: int = 1

    def __post_init__(self):
        ck = Checks("MasterWorkerConfig")
        ck.integer(self, "seed", 0)
        mfcs = _check_mfcs(ck, self.mfcs)
        object.__setattr__(self, "mfcs", mfcs)
        if not isinstance(self.exp_ctrl, ExperimentControlConfig):
            raise ck.bad("exp_ctrl", self.exp_ctrl, "use an ExperimentControlConfig")
        for f in (
            "n_model_workers",
            "train_batch_size",
            "max_recover_checkpoints",
            "max_fill_rounds",
        ):
            ck.integer(self, f, 1)
        layout = self.layout
        if layout is None:
            layout = ParallelismConfig(data=self.n_model_workers)
        if not isinstance(layout, ParallelismConfig):
            raise ck.bad("layout", layout, "use a ParallelismConfig (dXpYmZ) or None")
        if layout.world_size != self.n_model_workers:
            raise ck.bad(
                "layout",
                str(layout),
                f"the layout spans d·p·m = {layout.world_size} model workers but "
                f"n_model_workers={self.n_model_workers}; launch one model worker per rank "
                "of the layout",
            )
        object.__setattr__(self, "layout", layout)
        if not isinstance(self.placements, Placements):
            raise ck.bad("placements", self.placements, "use a Placements")
        self.placements.check(ck, mfcs, layout)
        if not isinstance(self.ft_spec, FinetuneSpec):
            raise ck.bad("ft_spec", self.ft_spec, "use a FinetuneSpec")
        for m in mfcs:
            if m.n_seqs > self.train_batch_size:
                raise ck.bad(
                    "train_batch_size",
                    self.train_batch_size,
                    f"MFC {m.name!r} takes n_seqs={m.n_seqs} items per call, "
                    "more than a step holds; "
                    f"raise train_batch_size to >= {m.n_seqs} or lower n_seqs",
                )
        self.check_call_sizes(self.ft_spec.dataset_size)
        ck.seconds(self, "timeout", finite=False)
        if self.recover_mode not in RECOVER_MODES:
            raise ck.bad("recover_mode", self.recover_mode, f"use one of {RECOVER_MODES}")
        if self.recover_dir is not None and (
            not isinstance(self.recover_dir, str) or not self.recover_dir
        ):
            raise ck.bad("recover_dir", self.recover_dir, "use a directory path or None")
        keys = tuple(self.log_stats_keys)
        if not all(isinstance(k, str) and k for k in keys):
            raise ck.bad("log_stats_keys", self.log_stats_keys, "give non-empty strings")
        object.__setattr__(self, "log_stats_keys", keys)
        ck.bools(self, "eval", "plot_curves")
        if not isinstance(self.progress_interval, (int, float)) or self.progress_interval < 0:
            raise ck.bad("progress_interval", self.progress_interval, "use seconds >= 0")
        if not isinstance(self.wandb, WandbConfig):
            raise ck.bad("wandb", self.wandb, "use a WandbConfig")
        if self.run_config is not None and not isinstance(self.run_config, dict):
            raise ck.bad("run_config", self.run_config, "use a dict or None")

    def check_call_sizes(self, dataset_size: int) -> None:
        """Raise if some MFC call would get fewer items than there are data-parallel replicas.

        Every replica needs at least one item per call (a replica with nothing to train on
        could not take part in the gradient all-reduce).  Steps hold
        ``train_batch_size`` items except the last of an epoch, which holds the rest.
        """
        # Only two step sizes exist: full steps and the epoch's remainder (a
        # dataset smaller than one batch makes a single, short step).
        step_sizes = {min(self.train_batch_size, dataset_size)}
        if dataset_size % self.train_batch_size:
            step_sizes.add(dataset_size % self.train_batch_size)
        dp = self.layout.data
        for m in self.mfcs:
            for s in sorted(step_sizes):
                small = [n for n in call_sizes(s, m.n_seqs) if n < dp]
                if small:
                    raise ValueError(
                        f"MasterWorkerConfig: with dataset_size={dataset_size}, "
                        f"train_batch_size={self.train_batch_size} and n_seqs={m.n_seqs}, MFC "
                        f"{m.name!r} would get a call of {small[0]} item(s) for "
                        f"{dp} data-parallel ranks; every rank needs one. "
                        "Pick train_batch_size and n_seqs so that every call (including the "
                        f"last, partial step of an epoch) holds at least {dp} items (the "
                        "data-parallel degree d)."
                    )

    @property
    def graph(self):
        """The :class:`~realhf.api.core.dfg.DataFlowGraph` of :attr:`mfcs`."""
        return build_graph(self.mfcs)
