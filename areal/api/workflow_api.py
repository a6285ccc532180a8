"""Rollout workflows and the executor that keeps them running beside training.

A :class:`RolloutWorkflow` turns one dataset row into a trajectory batch:
``await workflow.arun_episode(engine, row) -> SequenceSample | None`` (None: dropped, e.g. a
group whose answers all agree).

The :class:`WorkflowExecutor` runs episodes in the background (an asyncio loop in a daemon
thread) while the trainer trains, and hands out finished trajectories in batches of ``B``
under the worker system's exact staleness rule — the same
:class:`~realhf.system.rollout.staleness.StalenessController` and index-order batcher, so no
trajectory trains more than ``η`` versions after the version its episode started at:

    executor.submit(rows)                 # a stream of dataset rows (cycled)
    batch = executor.wait()               # the next B trajectories, in index order
    ... train, save ...
    executor.pause(); engine.update_weights(path, v); executor.set_version(v); executor.resume()

A new episode starts only when the controller admits it at the current version (capacity:
``max_concurrent_rollouts`` and the bound); a finished one takes the next index when rule 2
allows (else it waits); a dropped one frees its slot.  ``pause`` stops new episodes from
starting (running ones continue and are cut at their next chunk by the weight update).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Iterable, List, Optional

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from realhf.api.core.data_api import SequenceSample
from realhf.base import logging
from realhf.system.rollout.staleness import IndexOrderBatcher, StalenessController

logger = logging.getLogger("areal.executor")

__all__ = ["RolloutWorkflow", "WorkflowExecutor"]


class RolloutWorkflow:
    """One episode: a dataset row in, a trajectory (or None) out."""

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Optional[SequenceSample]:
        raise NotImplementedError(f"{type(self).__name__} does not implement arun_episode()")


class WorkflowExecutor:
    """See the module docstring.

    Args:
        engine: the inference engine the workflow generates with.
        workflow: the episode to run on every row.
        config: batch size ``B``, bound ``η``, concurrency, wait timeout.
    """

    def __init__(
        self, engine: InferenceEngine, workflow: RolloutWorkflow, config: InferenceEngineConfig
    ):
        self.engine, self.workflow, self.config = engine, workflow, config
        self.controller = StalenessController(
            config.train_batch_size, config.max_head_offpolicyness, config.max_concurrent_rollouts
        )
        self.batcher: IndexOrderBatcher = IndexOrderBatcher(config.train_batch_size)
        self._version = 0
        self._paused = threading.Event()
        self._cond = threading.Condition()
        self._rows: Optional[Iterable] = None
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stats = {"started": 0, "accepted": 0, "dropped": 0}
        #: per released batch: the versions its trajectories started at (for the log)
        self.last_batch_versions: List[int] = []

    # ---- control --------------------------------------------------------------------

    def submit(self, rows: Iterable) -> None:
        """Start running episodes over ``rows`` (cycled forever) in the background."""
        if self._thread is not None:
            raise RuntimeError("WorkflowExecutor.submit: already running")
        self._rows = itertools.cycle(list(rows))
        self._thread = threading.Thread(target=self._main, name="rollout-executor", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """No new episode starts until :meth:`resume`."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def set_version(self, version: int) -> None:
        """The trainer published weight version ``version`` (= train steps done)."""
        with self._cond:
            self._version = version

    def wait(self, timeout: Optional[float] = None) -> List[SequenceSample]:
        """The next ``B`` trajectories in index order (blocks; fails after ``timeout``,
        default ``wait_timeout_s``, naming what it waited for)."""
        timeout = self.config.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"a rollout episode failed: {self._error!r}") from (
                        self._error
                    )
                batch = self.batcher.pop_batch()
                if batch is not None:
                    self.last_batch_versions = [v for v, _ in batch]
                    return [t for _, t in batch]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"WorkflowExecutor.wait: no batch of {self.config.train_batch_size} "
                        f"trajectories within {timeout:g}s ({self.batcher.pending} ready, "
                        f"{self.controller.running} running, stats {self.stats})"
                    )
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    # ---- the background loop -----------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._loop())
        except BaseException as e:  # surfaced by wait()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    async def _loop(self) -> None:
        tasks = set()
        try:
            while not self._stop.is_set():
                for t in [t for t in tasks if t.done()]:
                    tasks.discard(t)
                    t.result()  # an episode's error ends the executor
                adm = None
                if not self._paused.is_set():
                    with self._cond:
                        version = self._version
                    adm = self.controller.admit(version, owner="lite")
                if adm is None:
                    await asyncio.sleep(0.01)
                    continue
                self.stats["started"] += 1
                tasks.add(asyncio.create_task(self._episode(adm, next(self._rows))))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            close = getattr(self.engine, "aclose", None)
            if close is not None:
                await close()

    async def _episode(self, adm, row) -> None:
        traj = await self.workflow.arun_episode(self.engine, row)
        if traj is None:
            self.controller.reject(adm.rollout_id, "dropped by the workflow")
            self.stats["dropped"] += 1
            return
        while True:  # rule 2: the index may have to wait for earlier deadlines
            index = self.controller.accept(adm.rollout_id)
            if index is not None:
                break
            await asyncio.sleep(0.01)
        with self._cond:
            self.batcher.add(index, (adm.version, traj))
            self.stats["accepted"] += 1
            self._cond.notify_all()
