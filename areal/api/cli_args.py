"""Config dataclasses of the light API, with ``key=value`` overrides (realhf's parser).

cfg = load_config(GRPOConfig, sys.argv[1:])   # e.g. steps=20 rollout.max_head_offpolicyness=2
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List, Type, TypeVar

from realhf.api.cli_args import LoraConfig, OptimizerConfig
from realhf.api.cli_parser import parse_config
from realhf.api.core.model_api import GenerationHyperparameters

__all__ = ["InferenceEngineConfig", "TrainEngineConfig", "GRPOConfig", "load_config"]

T = TypeVar("T")


@dataclasses.dataclass
class InferenceEngineConfig:
    """The remote inference engine and the rollout executor."""

    train_batch_size: int = field(
        default=32, metadata={"help": "B: trajectories (prompts with their groups) per step"}
    )
    max_head_offpolicyness: int = field(
        default=1,
        metadata={"help": "η: no trajectory trains more than η versions after it started"},
    )
    max_concurrent_rollouts: int = field(
        default=32, metadata={"help": "most episodes running at once"}
    )
    new_tokens_per_chunk: int = field(
        default=1024,
        metadata={"help": "tokens per generate call (a longer answer resumes after updates)"},
    )
    request_timeout_s: float = field(default=600.0, metadata={"help": "per generate call"})
    wait_timeout_s: float = field(
        default=600.0, metadata={"help": "seconds wait() may take for a batch before failing"}
    )
    weight_sync: str = field(
        default="disk",
        metadata={
            "help": "how upload_weights reaches the servers: 'disk' (a HF directory), 'shm' "
            "(a flat file in /dev/shm the servers map; built-in servers on this host) or "
            "'broadcast' (built-in servers pull rank 0's copy over a process group)"
        },
    )


@dataclasses.dataclass
class TrainEngineConfig:
    """The trained model."""

    path: str = field(default="", metadata={"help": "HF model directory; empty = embedded tiny"})
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=2e-4, weight_decay=0.0)
    )
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclasses.dataclass
class GRPOConfig:
    """GRPO on the embedded arithmetic task with the light API."""

    seed: int = 1
    steps: int = field(default=60, metadata={"help": "training steps"})
    group_size: int = field(default=8, metadata={"help": "answers per prompt"})
    max_turns: int = field(default=1, metadata={"help": "answers per member (multi-turn: > 1)"})
    python_tool: bool = field(
        default=False,
        metadata={"help": "answers may call a python tool run in the sandbox (max_turns >= 2)"},
    )
    eval_every: int = field(default=20, metadata={"help": "greedy eval every N steps (0: never)"})
    n_eval: int = field(default=500, metadata={"help": "held-out problems per evaluation"})
    out_dir: str = field(default="/tmp/areal-lite", metadata={"help": "weights and metrics"})
    gen: GenerationHyperparameters = field(
        default_factory=lambda: GenerationHyperparameters(max_new_tokens=16, temperature=1.0)
    )
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)


def load_config(cls: Type[T], argv: List[str]) -> T:
    """``cls`` with ``key=value`` overrides (and ``--config FILE.yaml``) from ``argv``."""
    return parse_config(cls, list(argv))
