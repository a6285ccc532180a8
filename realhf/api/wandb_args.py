"""Options of Weights & Biases tracking: ``cfg.wandb.*``.

The master worker logs every step's numbers to a W&B run when ``wandb.mode`` is
``offline`` (files under ``{run_dir}/wandb/``, uploaded later with ``wandb sync``) or
``online``; ``disabled`` (the default) needs no wandb install.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List

WANDB_MODES = ("disabled", "offline", "online")
# W&B refuses these in project names.
_BAD_PROJECT_CHARS = set("/\\#?%:")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass
class WandbConfig:
    """Where and how the master logs a run to Weights & Biases."""

    mode: str = field(
        default="disabled",
        metadata={
            "help": f"one of {WANDB_MODES}; offline writes {{run_dir}}/wandb/offline-run-*/ "
            "without network (upload it with `wandb sync DIR`); online needs `wandb login`"
        },
    )
    project: str = field(default="", metadata={"help": "W&B project; empty = the experiment name"})
    entity: str = field(
        default="", metadata={"help": "W&B user or team; empty = your default entity"}
    )
    name: str = field(
        default="", metadata={"help": "display name of the run; empty = {experiment}/{trial}"}
    )
    group: str = field(default="", metadata={"help": "W&B group of the run; empty = none"})
    job_type: str = field(default="", metadata={"help": "W&B job type of the run; empty = none"})
    notes: str = field(default="", metadata={"help": "free-text description of the run"})
    tags: List[str] = field(default_factory=list, metadata={"help": "tags of the run"})

    def __post_init__(self):
        _check(self.mode in WANDB_MODES, f"wandb.mode={self.mode!r}; use one of {WANDB_MODES}")
        bad = sorted(set(self.project) & _BAD_PROJECT_CHARS)
        _check(
            not bad and len(self.project) <= 128,
            f"wandb.project={self.project!r}: W&B project names are at most 128 characters "
            f"without any of {''.join(sorted(_BAD_PROJECT_CHARS))}",
        )
        _check(
            all(isinstance(t, str) and t.strip() for t in self.tags),
            f"wandb.tags={self.tags!r}: give non-empty strings",
        )
