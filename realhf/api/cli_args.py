"""Config dataclasses shared by every quickstart experiment.

Algorithm-specific options (PPO, generation) live with the components that use them and
are composed into experiment configs in `realhf.experiments`. Every field carries a help
text (shown by `python -m realhf.apps.quickstart <exp> --help`) and every dataclass checks
itself in `__post_init__`, naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import field
from typing import List, Optional

from realhf.api.ray_args import RayConfig
from realhf.api.slurm_args import SlurmConfig
from realhf.api.wandb_args import WandbConfig


class RecoverMode(str, enum.Enum):
    """``recover_mode``: what a run does with recover checkpoints.

    The config field stays a plain string (YAML and ``key=value`` give strings);
    code compares ``RecoverMode(cfg.recover_mode)`` against the members.
    """

    DISABLED = "disabled"  # always start afresh
    AUTO = "auto"  # resume from the latest complete recover checkpoint, if any; relaunch on failure
    RESUME = "resume"  # resume; no checkpoint is an error


RECOVER_MODES = tuple(m.value for m in RecoverMode)
LAUNCH_MODES = ("local", "ray", "slurm")
LR_SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16")
#: the embedded tasks (model + data under realhf/assets/), chosen with ``task=NAME``:
#: 2-digit arithmetic with ~6-token answers, and worked chains of 10-240 tokens
EMBEDDED_TASKS = ("tiny_arith", "tiny_long", "tiny_visual")
#: the projections LoRA adapters can go on (HuggingFace's module names)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with a warm-up then constant/linear/cosine learning-rate schedule."""

    lr: float = field(default=2e-5, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-5, metadata={"help": "AdamW epsilon"})
    lr_scheduler_type: str = field(default="constant", metadata={"help": f"one of {LR_SCHEDULES}"})
    warmup_steps_proportion: float = field(
        default=0.0, metadata={"help": "fraction of total steps spent warming up linearly"}
    )
    min_lr_ratio: float = field(
        default=0.0, metadata={"help": "final lr / peak lr for linear and cosine schedules"}
    )
    gradient_clipping: float = field(
        default=1.0, metadata={"help": "max global grad norm; 0 disables clipping"}
    )
    zero_stage: int = field(
        default=0,
        metadata={
            "help": "1: shard the fp32 master weights and Adam state over the data-parallel "
            "ranks (ZeRO-1: 1/d of 8-12 bytes per parameter each); 0: every rank holds all"
        },
    )

    def __post_init__(self):
        _check(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        _check(
            self.lr_scheduler_type in LR_SCHEDULES,
            f"optimizer.lr_scheduler_type={self.lr_scheduler_type!r}; use one of {LR_SCHEDULES}",
        )
        _check(
            0.0 <= self.warmup_steps_proportion < 1.0,
            "optimizer.warmup_steps_proportion must be in [0, 1), "
            f"got {self.warmup_steps_proportion}",
        )
        _check(
            0.0 <= self.min_lr_ratio <= 1.0,
            f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        _check(
            self.gradient_clipping >= 0,
            f"optimizer.gradient_clipping must be >= 0, got {self.gradient_clipping}",
        )
        _check(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optimizer.beta1/beta2 must be in [0, 1)"
        )
        _check(
            self.zero_stage in (0, 1),
            f"optimizer.zero_stage={self.zero_stage!r}; use 0 (no sharding) or 1 (shard the "
            "optimizer state over data-parallel ranks); stages 2 and 3 are not implemented",
        )


@dataclasses.dataclass
class LoraConfig:
    """LoRA adapters on a trained model role (:mod:`realhf.impl.model.nn.lora`): only they
    train; the base weights stay frozen.  ``rank=0`` (the default) trains every weight."""

    rank: int = field(
        default=0, metadata={"help": "adapter rank, e.g. 16; 0: no adapters (full fine-tuning)"}
    )
    alpha: float = field(
        default=16.0, metadata={"help": "scaling numerator: the adapter adds (alpha/rank)·BAx"}
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapters' input"})
    target_modules: List[str] = field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        metadata={"help": f"projections that get adapters, some of {list(LORA_TARGET_MODULES)}"},
    )
    save_merged: bool = field(
        default=False,
        metadata={
            "help": "saved models also hold the base with the adapters merged in, under "
            "<save dir>/merged (a plain HF model); the adapters alone are always saved"
        },
    )

    def __post_init__(self):
        given = list(self.target_modules)
        _check(
            isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0,
            f"lora.rank={self.rank!r}: use a positive integer (e.g. 16), or 0 for no adapters",
        )
        _check(self.alpha > 0, f"lora.alpha={self.alpha!r}: use a positive number (e.g. 2 x rank)")
        _check(
            0.0 <= self.dropout < 1.0, f"lora.dropout={self.dropout!r}: use a probability in [0, 1)"
        )
        unknown = [t for t in given if t not in LORA_TARGET_MODULES]
        _check(
            bool(given) and not unknown,
            f"lora.target_modules={given!r}: "
            + (f"unknown {unknown}; " if unknown else "none given; ")
            + f"use some of {list(LORA_TARGET_MODULES)}",
        )
        # One canonical order: the adapters' flat layout follows it.
        self.target_modules = [t for t in LORA_TARGET_MODULES if t in given]

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``: what multiplies ``B A x`` (PEFT's default scaling)."""
        return self.alpha / self.rank


@dataclasses.dataclass
class ModelConfig:
    """A model role: where its HF checkpoint is and how it trains."""

    path: str = field(
        default="",
        metadata={"help": "HuggingFace model directory; empty = the embedded tiny model"},
    )
    dtype: str = field(default="float32", metadata={"help": f"parameter dtype, one of {DTYPES}"})
    gradient_checkpointing: Optional[bool] = field(
        default=None,
        metadata={
            "help": "recompute activations in backward to save memory; empty: on only when "
            "a local run would not fit in this host's memory without it (--dry-run says)"
        },
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    offload: bool = field(
        default=False,
        metadata={
            "help": "keep the weights in host memory between this model's calls "
            "(models that are not trained: ref); a no-op on CPU workers"
        },
    )

    def __post_init__(self):
        _check(self.dtype in DTYPES, f"model dtype={self.dtype!r}; use one of {DTYPES}")


@dataclasses.dataclass
class MicroBatchConfig:
    """How one model function call cuts its batch into micro-batches."""

    n_mbs: int = field(default=1, metadata={"help": "minimum number of micro-batches"})
    max_tokens_per_mb: Optional[int] = field(
        default=None,
        metadata={
            "help": "token budget per micro-batch (first-fit-decreasing); empty: none (n_mbs "
            "alone decides), unless a local run would not fit in this host's memory: then "
            "the largest power of two that fits (--dry-run says)"
        },
    )

    def __post_init__(self):
        _check(self.n_mbs >= 1, f"n_mbs must be >= 1, got {self.n_mbs}")
        _check(
            self.max_tokens_per_mb is None or self.max_tokens_per_mb >= 1,
            f"max_tokens_per_mb must be >= 1, got {self.max_tokens_per_mb}",
        )

    @property
    def spec(self):
        """The :class:`~realhf.api.core.data_api.MicroBatchSpec` (no budget: ``2**30``)."""
        from realhf.api.core.data_api import MicroBatchSpec

        return MicroBatchSpec(n_mbs=self.n_mbs, max_tokens_per_mb=self.max_tokens_per_mb or 1 << 30)


@dataclasses.dataclass
class ExperimentControlConfig:
    """Run length and how often to save, checkpoint for recovery and evaluate.

    Each frequency may be given in epochs, steps and/or seconds; any that is set fires.
    """

    total_train_epochs: int = field(default=1, metadata={"help": "epochs over the dataset"})
    benchmark_steps: Optional[int] = field(
        default=None, metadata={"help": "stop after this many steps (None: run all epochs)"}
    )
    save_freq_epochs: Optional[int] = field(
        default=None, metadata={"help": "save an HF checkpoint every N epochs"}
    )
    save_freq_steps: Optional[int] = field(
        default=None, metadata={"help": "save an HF checkpoint every N steps"}
    )
    save_freq_secs: Optional[int] = field(
        default=None, metadata={"help": "save an HF checkpoint every N seconds"}
    )
    ckpt_freq_epochs: Optional[int] = field(
        default=None, metadata={"help": "recover checkpoint every N epochs"}
    )
    ckpt_freq_steps: Optional[int] = field(
        default=None, metadata={"help": "recover checkpoint every N steps"}
    )
    ckpt_freq_secs: Optional[int] = field(
        default=None, metadata={"help": "recover checkpoint every N seconds"}
    )
    eval_freq_epochs: Optional[int] = field(
        default=None, metadata={"help": "evaluate every N epochs"}
    )
    eval_freq_steps: Optional[int] = field(
        default=None, metadata={"help": "evaluate every N steps"}
    )
    eval_freq_secs: Optional[int] = field(
        default=None, metadata={"help": "evaluate every N seconds"}
    )
    eval_at_start: bool = field(
        default=False,
        metadata={
            "help": "also evaluate before the first step (a fresh run only), recorded as "
            "step 0 of metrics.jsonl: the start of the run's summary"
        },
    )

    def __post_init__(self):
        # These checks see the merged config (cli_parser builds the dataclasses
        # only after every source is merged), never an intermediate YAML state.
        _check(
            self.total_train_epochs >= 1,
            f"total_train_epochs must be >= 1, got {self.total_train_epochs}",
        )
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith(("_epochs", "_steps", "_secs")) and v is not None:
                _check(v >= 1, f"exp_ctrl.{f.name} must be >= 1 or null, got {v}")


@dataclasses.dataclass
class BaseExperimentConfig:
    """Options every experiment shares: names, where outputs go, how to launch and recover."""

    experiment_name: str = field(
        default="", metadata={"help": "experiment name; empty = the quickstart command name"}
    )
    trial_name: str = field(
        default="run0",
        metadata={"help": "trial name; outputs go to {fileroot}/{experiment}/{trial}"},
    )
    fileroot: str = field(
        default="",
        metadata={"help": "root of run outputs; empty = $REALHF_FILEROOT or ~/.cache/realhf"},
    )
    task: str = field(
        default="tiny_arith",
        metadata={
            "help": f"embedded task, one of {EMBEDDED_TASKS}: its model and data are used "
            "where model / dataset paths are empty, and its length settings are the defaults"
        },
    )
    mode: str = field(default="local", metadata={"help": f"launcher, one of {LAUNCH_MODES}"})
    ray: RayConfig = field(default_factory=RayConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    seed: int = field(default=1, metadata={"help": "random seed of the whole run"})
    allocation_mode: str = field(
        default="d1p1m1",
        metadata={
            "help": "trainer layout dXpYmZ (data/pipe/tensor), "
            "or gen.dXpYmZ+dXpYmZ for generation servers + trainer, "
            "or per-MFC layouts mfc:dXpYmZ,mfc:dXpYmZ,... (README, 'Parallel layouts')"
        },
    )
    keep_replicas: bool = field(
        default=True,
        metadata={
            "help": "with per-MFC layouts, keep a model's replica on an MFC's layout between "
            "calls (memory for speed); false frees it after each call and refills it next time"
        },
    )
    memory_check: bool = field(
        default=True,
        metadata={
            "help": "refuse a local run whose estimated memory (printed by --dry-run) exceeds "
            "what this host has available, before anything starts"
        },
    )
    recover_mode: str = field(default="disabled", metadata={"help": f"one of {RECOVER_MODES}"})
    recover_retries: int = field(
        default=1, metadata={"help": "restarts after a failure when recover_mode=auto"}
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "help": "replace the outputs of an earlier run in the same trial directory "
            "(false: such a run is refused unless recover_mode resumes it)"
        },
    )
    max_recover_checkpoints: int = field(
        default=1,
        metadata={
            "help": "recover checkpoints kept (older ones are deleted); 2 or more keep one to "
            "fall back to when the newest is found damaged at resume"
        },
    )
    worker_restarts: int = field(
        default=3,
        metadata={
            "help": "mode=local: restarts each generation server / rollout worker may get "
            "alone, while the trainer keeps running (0: any lost worker stops the run)"
        },
    )
    name_resolve: str = field(
        default="",
        metadata={
            "help": "name-resolve backend URL: file:///dir, etcd3://host:port, "
            "ray://gcs_host:port or ray (mode=ray: the cluster's own store); "
            "empty = ray with mode=ray, else file under fileroot"
        },
    )
    worker_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds any worker may wait for a peer before failing loudly"},
    )
    torch_threads: Optional[int] = field(
        default=None,
        metadata={
            "help": "intra-op CPU threads of each training process; empty = the cores "
            "shared evenly (async: the trainer gets half the spare cores)"
        },
    )
    exp_ctrl: ExperimentControlConfig = field(default_factory=ExperimentControlConfig)

    @classmethod
    def task_overrides(cls, task: str) -> list[str]:
        """``key=value`` defaults of embedded task ``task`` (applied before the user's own)."""
        return []

    def __post_init__(self):
        _check(
            self.task in EMBEDDED_TASKS,
            f"task={self.task!r}; embedded tasks: {EMBEDDED_TASKS} (README, 'Embedded tasks')",
        )
        _check(
            self.mode in LAUNCH_MODES, f"mode={self.mode!r}; supported launchers: {LAUNCH_MODES}"
        )
        _check(
            self.recover_mode in RECOVER_MODES,
            f"recover_mode={self.recover_mode!r}; use one of {RECOVER_MODES}",
        )
        _check(
            self.recover_retries >= 0, f"recover_retries must be >= 0, got {self.recover_retries}"
        )
        _check(
            isinstance(self.max_recover_checkpoints, int) and self.max_recover_checkpoints >= 1,
            "max_recover_checkpoints must be an integer >= 1, "
            f"got {self.max_recover_checkpoints!r}",
        )
        _check(
            isinstance(self.worker_restarts, int) and self.worker_restarts >= 0,
            f"worker_restarts must be an integer >= 0, got {self.worker_restarts!r}",
        )
        for name in ("experiment_name", "trial_name"):
            v = getattr(self, name)
            _check("/" not in v and "@" not in v, f"{name}={v!r} may not contain '/' or '@'")
        _check(self.worker_timeout > 0, f"worker_timeout must be > 0, got {self.worker_timeout}")
        _check(
            self.torch_threads is None
            or (isinstance(self.torch_threads, int) and self.torch_threads >= 1),
            f"torch_threads={self.torch_threads!r}: use an integer >= 1, or leave it empty",
        )
