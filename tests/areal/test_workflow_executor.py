"""The light API's executor: batches of B in index order under the exact staleness bound,
dropped episodes free their slot, failures surface in wait()."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from areal.api.workflow_api import RolloutWorkflow, WorkflowExecutor
from realhf.api.core.data_api import SequenceSample


class _Engine(InferenceEngine):
    pass


class _Episodes(RolloutWorkflow):
    """Episodes of random length; every fifth row is dropped; row -1 fails."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)
        self.n = 0

    async def arun_episode(self, engine, row):
        await asyncio.sleep(self.rng.random() * 0.02)
        if row == -1:
            raise ValueError("the episode broke")
        if row % 5 == 0:
            return None
        self.n += 1
        return SequenceSample.from_default(
            ids=[f"q{row}-{self.n}"], seqlens=[1], data={"rewards": torch.tensor([1.0])}
        )


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_batches_respect_the_staleness_bound_exactly(eta):
    B = 4
    cfg = InferenceEngineConfig(
        train_batch_size=B,
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=16,
        wait_timeout_s=30,
    )
    ex = WorkflowExecutor(_Engine(), _Episodes(), cfg)
    ex.submit(range(1, 50))
    try:
        for step in range(12):
            batch = ex.wait()
            assert len(batch) == B
            # every trajectory started at most eta versions before the step that trains it
            assert all(0 <= step - v <= eta for v in ex.last_batch_versions), (
                step,
                ex.last_batch_versions,
            )
            if eta == 0:
                assert ex.last_batch_versions == [step] * B  # on-policy
            ex.set_version(step + 1)
    finally:
        ex.close()
    assert ex.stats["dropped"] > 0  # dropped rows freed their slots: the run went on
    assert ex.controller.stats["accepted"] >= 12 * B


def test_a_failing_episode_fails_wait_with_its_error():
    cfg = InferenceEngineConfig(train_batch_size=2, max_concurrent_rollouts=2, wait_timeout_s=30)
    ex = WorkflowExecutor(_Engine(), _Episodes(), cfg)
    ex.submit([-1])
    try:
        with pytest.raises(RuntimeError, match="the episode broke"):
            ex.wait()
    finally:
        ex.close()


def test_wait_names_what_it_waited_for():
    cfg = InferenceEngineConfig(train_batch_size=2, max_concurrent_rollouts=2)
    ex = WorkflowExecutor(_Engine(), _Episodes(), cfg)
    ex.submit([5, 10])  # every row dropped: no batch ever
    try:
        with pytest.raises(TimeoutError, match="no batch of 2 trajectories within 0.5s"):
            ex.wait(timeout=0.5)
    finally:
        ex.close()
