"""Learning-rate schedule values, computed by hand."""

import math

import pytest

from realhf.api.cli_args import OptimizerConfig
from realhf.impl.model.backend.lr_schedule import LRSchedule


def test_constant_without_warmup_needs_no_total():
    s = LRSchedule(lr=0.1)
    assert [s(t) for t in (0, 1, 1000)] == [0.1, 0.1, 0.1]


def test_constant_with_warmup():
    s = LRSchedule(lr=1.0, kind="constant", total_steps=10, warmup_steps_proportion=0.4)
    assert s.warmup_steps == 4
    assert [s(t) for t in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_decay_to_min_lr():
    # W = 2, decay over the remaining 8 steps towards min_lr = 0.2
    s = LRSchedule(
        lr=1.0, kind="linear", total_steps=10, warmup_steps_proportion=0.2, min_lr_ratio=0.2
    )
    assert s(0) == pytest.approx(0.5)
    assert s(1) == pytest.approx(1.0)
    assert s(2) == pytest.approx(1.0)
    assert s(6) == pytest.approx(0.2 + 0.8 * (1 - 4 / 8))
    assert s(9) == pytest.approx(0.2 + 0.8 * (1 - 7 / 8))
    assert s(10) == pytest.approx(0.2)
    assert s(50) == pytest.approx(0.2)


def test_cosine():
    s = LRSchedule(lr=2.0, kind="cosine", total_steps=4)
    assert [s(t) for t in range(5)] == pytest.approx(
        [2.0, 1.0 + math.cos(math.pi / 4), 1.0, 1.0 + math.cos(3 * math.pi / 4), 0.0]
    )


def test_from_optimizer_config():
    cfg = OptimizerConfig(
        lr=3e-4, lr_scheduler_type="cosine", warmup_steps_proportion=0.1, min_lr_ratio=0.1
    )
    s = LRSchedule.from_config(cfg, total_steps=100)
    assert s.warmup_steps == 10
    assert s(9) == pytest.approx(3e-4)
    assert s(100) == pytest.approx(3e-5)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="FinetuneSpec"):
        LRSchedule(lr=1.0, kind="cosine")
    with pytest.raises(ValueError, match="kind"):
        LRSchedule(lr=1.0, kind="exp", total_steps=3)
    with pytest.raises(ValueError, match=">= 0"):
        LRSchedule(lr=1.0)(-1)
