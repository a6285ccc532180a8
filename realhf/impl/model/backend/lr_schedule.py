"""Learning-rate schedules: linear warm-up, then constant, linear or cosine decay.

The schedule is a pure function of the step index, so an optimizer restored from a
checkpoint continues with exactly the learning rate an uninterrupted run would use
(no scheduler object whose internal counter must be saved and kept in sync).

With ``total`` steps, ``W = int(warmup_steps_proportion * total)`` warm-up steps, peak
``lr`` and floor ``min_lr = min_lr_ratio * lr``, step ``t`` (0-based) gets::

    t <  W:  lr * (t + 1) / W                               (warm-up reaches lr at t = W-1)
    t >= W:  p = min(1, (t - W) / (total - W))              (decay progress)
             constant: lr
             linear:   min_lr + (lr - min_lr) * (1 - p)
             cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2

Steps past ``total`` stay at the end value (``min_lr`` for linear/cosine).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from realhf.api.cli_args import LR_SCHEDULES, OptimizerConfig

__all__ = ["LRSchedule"]


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a function of the step (see the module docstring).

    Attributes:
        lr: peak learning rate.
        kind: ``constant``, ``linear`` or ``cosine``.
        total_steps: steps the schedule spans (None only for a constant schedule
            without warm-up, which does not depend on it).
        warmup_steps_proportion: fraction of ``total_steps`` spent warming up.
        min_lr_ratio: final lr / peak lr of the linear and cosine schedules.
    """

    lr: float
    kind: str = "constant"
    total_steps: Optional[int] = None
    warmup_steps_proportion: float = 0.0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"LRSchedule.kind={self.kind!r}; use one of {LR_SCHEDULES}")
        if not self.lr > 0:
            raise ValueError(f"LRSchedule.lr={self.lr!r} must be > 0")
        needs_total = self.kind != "constant" or self.warmup_steps_proportion > 0
        if self.total_steps is None and needs_total:
            raise ValueError(
                f"a {self.kind} learning-rate schedule with "
                f"warmup_steps_proportion={self.warmup_steps_proportion} needs the run length: "
                "pass a FinetuneSpec (total_train_steps) to the train engine, or use a constant "
                "schedule without warm-up"
            )
        if self.total_steps is not None and (
            not isinstance(self.total_steps, int) or self.total_steps < 1
        ):
            raise ValueError(f"LRSchedule.total_steps={self.total_steps!r} must be an integer >= 1")

    @classmethod
    def from_config(cls, cfg: OptimizerConfig, total_steps: Optional[int]) -> "LRSchedule":
        """The schedule an :class:`~realhf.api.cli_args.OptimizerConfig` describes."""
        return cls(
            lr=cfg.lr,
            kind=cfg.lr_scheduler_type,
            total_steps=total_steps,
            warmup_steps_proportion=cfg.warmup_steps_proportion,
            min_lr_ratio=cfg.min_lr_ratio,
        )

    @property
    def warmup_steps(self) -> int:
        """Number of warm-up steps ``W``."""
        if self.total_steps is None:
            return 0
        return int(self.warmup_steps_proportion * self.total_steps)

    def __call__(self, step: int) -> float:
        """The learning rate of (0-based) step ``step``."""
        if step < 0:
            raise ValueError(f"learning-rate step must be >= 0, got {step}")
        w = self.warmup_steps
        if step < w:
            return self.lr * (step + 1) / w
        if self.kind == "constant":
            return self.lr
        min_lr = self.min_lr_ratio * self.lr
        # max(1, ...): warm-up may cover the whole run (W = total), leaving no decay steps.
        p = min(1.0, (step - w) / max(1, self.total_steps - w))
        if self.kind == "linear":
            return min_lr + (self.lr - min_lr) * (1.0 - p)
        return min_lr + (self.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
