"""The trainer's data in asynchronous RL: trajectories pulled from rollout workers, in index order.

A model worker whose config has a :class:`~realhf.api.core.worker_api.TrajectoryStreamSpec`
uses a :class:`TrajectoryStreamLoader` where it would use a
:class:`~realhf.impl.dataset.shard_loader.ShardLoader`; both answer the master's ``fetch`` the same
way (epoch, position, ``take``), so the master's step loop, recovery and epoch accounting do
not know whether data comes from a file or from rollouts.

Rank 0 owns the stream: it pulls :class:`~realhf.api.core.rollout_api.Trajectory` messages
and releases them ``B`` at a time in index order (:class:`IndexOrderBatcher`), so the
trajectory with index ``k`` is trained by step ``k // B`` — the trainer's half of the exact
staleness bound (:mod:`realhf.system.rollout.staleness`).  It also checks that bound on every
trajectory and fails the run, naming the trajectory, if it is ever exceeded.  Other ranks
hold no items (shard size 0) and get theirs through the master's transfer plan.

Rank 0 appends one line per released batch to ``{run_dir}/trajectories.jsonl`` (which
prompts, from which worker and epoch, started and ended at which weight versions, trained by
which step); after a recovery the lines of the replayed steps appear again, the last line of a
step is the one that counts.

While rank 0 waits longer than a pull slice for a batch it publishes the missing indices
(``names.stream_missing``): the gserver manager reissues those whose rollout worker died
after taking the index (:meth:`StalenessController.reissue`).  A copy of an index that
arrives after another one is dropped and counted (``rollout/duplicates_dropped``): the first
arrival wins, so no trajectory index is trained twice.

Recoverable state: the position (epoch, used, next index) and, per rollout worker, the
prompts already trained in that worker's current epoch — a resumed rollout worker reads
them from the checkpoint and skips those prompts (:func:`rollout_position`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Dict, List, Optional

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.rollout_api import Trajectory
from realhf.api.core.worker_api import TrajectoryStreamSpec
from realhf.base import logging, name_resolve, names
from realhf.base.storage import recover
from realhf.system.rollout.staleness import IndexOrderBatcher
from realhf.system.transport.errors import StreamTimeout
from realhf.system.transport.push_pull import EndOfStream, PullerStream

logger = logging.getLogger("stream_loader", "system")

__all__ = ["StalenessViolation", "TrajectoryStreamLoader", "rollout_position"]

# How long one pull blocks before the loader re-checks its deadline.
_PULL_SLICE_S = 1.0


class StalenessViolation(RuntimeError):
    """A trajectory would be trained more than ``max_head_offpolicyness`` versions after it
    started."""


class TrajectoryStreamLoader:
    """See the module docstring.

    Args:
        spec: the stream's settings.
        experiment_name, trial_name: where the stream's address is published.
        rank: this model worker's data-parallel rank (rank 0 pulls).
        name: for messages (the worker name).
        log_path: rank 0 appends one JSON line per released batch here (step, indices,
            prompts, producing workers, versions): the provenance of every trained sample.
    """

    def __init__(
        self,
        spec: TrajectoryStreamSpec,
        experiment_name: str,
        trial_name: str,
        rank: int,
        name: str = "model_worker",
        log_path: Optional[str] = None,
    ):
        self.spec = spec
        self.name = name
        self.owner = rank == 0
        self.size = spec.epoch_size if self.owner else 0
        self.epoch = 0
        self.n_used = 0
        self.batcher: IndexOrderBatcher[Trajectory] = IndexOrderBatcher(spec.batch_size)
        # rollout worker -> {"epoch": e, "used_ids": [prompt ids trained in epoch e]}
        self.positions: Dict[str, Dict[str, Any]] = {}
        self._stats: Dict[str, float] = {}
        self.log_path = log_path if self.owner else None
        self._missing_key = names.stream_missing(experiment_name, trial_name, spec.stream_name)
        self._published_missing: Optional[List[int]] = None
        self._next_publish = 0.0
        self.puller: Optional[PullerStream] = None
        if self.owner:
            self.puller = PullerStream(
                experiment_name, trial_name, spec.stream_name, 0, message_types=[Trajectory]
            )

    # ---- the ShardLoader surface ------------------------------------------------

    def __len__(self) -> int:
        return self.size

    @property
    def remaining(self) -> int:
        return self.size - self.n_used

    @property
    def next_index(self) -> int:
        """Index of the next trajectory to train (= trajectories trained so far)."""
        return self.batcher.next_index

    def take(self, epoch: int, n: int) -> List[SequenceSample]:
        """The next ``n`` trajectories (a whole batch on rank 0, nothing elsewhere)."""
        if epoch == self.epoch + 1 and not self.remaining:
            self.epoch, self.n_used = epoch, 0
        elif epoch != self.epoch:
            raise ValueError(
                f"{self.name}: asked for trajectories of epoch {epoch} but the stream is in epoch "
                f"{self.epoch} with {self.remaining} left; master and worker disagree"
            )
        self._stats = {}
        if n == 0:
            return []
        if not self.owner:
            raise RuntimeError(
                f"{self.name}: only model worker 0 pulls the trajectory stream; the master "
                "asked this rank for data (its shard size is 0)"
            )
        if n != self.spec.batch_size or n > self.remaining:
            raise ValueError(
                f"{self.name}: a stream step takes exactly batch_size={self.spec.batch_size} "
                f"trajectories, the master asked for {n} ({self.remaining} left in the epoch)"
            )
        t0 = time.monotonic()
        batch = self._wait_batch()
        step = (batch[0].index) // self.spec.batch_size
        self._check_staleness(batch, step)
        self._record_positions(batch)
        self.n_used += n
        self._stats = self._batch_stats(batch, step, time.monotonic() - t0)
        self._log_batch(batch, step)
        return [
            dataclasses.replace(t.to_sequence_sample(), ids=[f"{t.qid}#{t.index}"]) for t in batch
        ]

    def take_stats(self) -> Dict[str, float]:
        """Statistics of the last batch (staleness, wait, queue), for the step's log line."""
        return dict(self._stats)

    # ---- pulling --------------------------------------------------------------

    def _wait_batch(self) -> List[Trajectory]:
        t0 = time.monotonic()
        deadline = t0 + self.spec.wait_timeout_s
        while True:
            batch = self.batcher.pop_batch()
            if batch is not None:
                if self._published_missing:
                    self._publish_missing([])
                return batch
            now = time.monotonic()
            if now - t0 >= _PULL_SLICE_S and now >= self._next_publish:
                self._next_publish = now + 1.0
                self._publish_missing(self.batcher.missing())
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self.batcher.missing()
                raise TimeoutError(
                    f"{self.name}: waited {self.spec.wait_timeout_s:g}s for trajectories "
                    f"{_ranges(missing)} of step {self.batcher.next_index // self.spec.batch_size} "
                    f"({self.batcher.pending} later ones arrived); check the rollout_worker, "
                    "gserver_manager and generation_server logs"
                )
            try:
                msg = self.puller.pull(timeout=min(left, _PULL_SLICE_S))
            except StreamTimeout:
                continue
            if isinstance(msg, EndOfStream):
                logger.info(f"rollout worker {msg.producer_index} ended its stream")
                continue
            if not self.batcher.add(msg.index, msg):
                logger.warning(
                    f"trajectory index {msg.index} (prompt {msg.qid!r}, {msg.worker}) arrived "
                    "again and is dropped: the first copy is kept (the manager reissued an "
                    "index whose rollout worker was lost, and both copies arrived)"
                )

    def _publish_missing(self, missing: List[int]) -> None:
        if missing == self._published_missing:
            return
        try:
            name_resolve.add(self._missing_key, json.dumps(missing), replace=True)
        except Exception as e:  # noqa: BLE001 — a hint for the manager, never fatal here
            logger.warning(f"could not publish the missing trajectory indices: {e!r}")
            return
        self._published_missing = missing

    def _check_staleness(self, batch: List[Trajectory], version: int) -> None:
        eta = self.spec.max_head_offpolicyness
        for t in batch:
            if version - t.version_start > eta:
                raise StalenessViolation(
                    f"trajectory {t.index} (prompt {t.qid!r}, {t.worker}) started at weight "
                    f"version {t.version_start} but would be trained at version {version}: "
                    f"staleness {version - t.version_start} > max_head_offpolicyness={eta}. "
                    "The gserver manager's admission must prevent this; the run stops rather "
                    "than train on it"
                )

    def _record_positions(self, batch: List[Trajectory]) -> None:
        for t in batch:
            pos = self.positions.get(t.worker)
            if pos is None or t.data_epoch > pos["epoch"]:
                self.positions[t.worker] = {"epoch": t.data_epoch, "used_ids": [t.qid]}
            elif t.data_epoch == pos["epoch"]:
                pos["used_ids"].append(t.qid)

    def _log_batch(self, batch: List[Trajectory], version: int) -> None:
        if self.log_path is None:
            return
        rec = {
            "step": version + 1,  # 1-based, like metrics.jsonl
            "trained_version": version,
            "indices": [t.index for t in batch],
            "prompts": [t.qid for t in batch],
            "workers": [t.worker for t in batch],
            "data_epochs": [t.data_epoch for t in batch],
            "version_start": [t.sample.data["version_start"].tolist() for t in batch],
            "version_end": [t.sample.data["version_end"].tolist() for t in batch],
        }
        if all("n_turns" in t.sample.metadata for t in batch):  # multi-turn agents
            rec["n_turns"] = [t.sample.metadata["n_turns"][0] for t in batch]
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _batch_stats(
        self, batch: List[Trajectory], version: int, waited: float
    ) -> Dict[str, float]:
        per_seq = [version - int(v) for t in batch for v in t.sample.data["version_start"].tolist()]
        rewards = [r for t in batch for r in t.sample.data["rewards"].tolist()]
        now = time.time()
        turns = {}
        if all("n_turns" in t.sample.metadata for t in batch):  # multi-turn agents
            n = [x for t in batch for x in t.sample.metadata["n_turns"][0]]
            turns = {"rollout/turns_mean": sum(n) / len(n)}
        return {
            **turns,
            "rollout/reward": sum(rewards) / len(rewards),
            "rollout/reward_positive_frac": sum(r > 0 for r in rewards) / len(rewards),
            "rollout/staleness_mean": sum(per_seq) / len(per_seq),
            "rollout/staleness_max": float(max(per_seq)),
            "rollout/version_start_min": float(min(t.version_start for t in batch)),
            "rollout/interrupted_frac": sum(t.version_end > t.version_start for t in batch)
            / len(batch),
            "rollout/age_s": sum(now - t.birth_time for t in batch) / len(batch),
            "rollout/wait_s": waited,
            "rollout/queued": float(self.batcher.pending),
            "rollout/duplicates_dropped": float(self.batcher.duplicates),
        }

    # ---- recovery ---------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        return {
            "stream": True,
            "epoch": self.epoch,
            "n_used": self.n_used,
            "shard_size": self.size,
            "next_index": self.batcher.next_index,
            "rollout_positions": self.positions,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state.get("stream") or state.get("shard_size") != self.size:
            raise ValueError(
                f"{self.name}: the recover checkpoint's data state ({_brief(state)}) is not a "
                f"trajectory stream of epoch size {self.size}; resume with the same "
                "experiment, train_batch_size and number of model workers"
            )
        self.epoch = int(state["epoch"])
        self.n_used = int(state["n_used"])
        self.batcher = IndexOrderBatcher(self.spec.batch_size, int(state["next_index"]))
        self.positions = {w: dict(p) for w, p in state.get("rollout_positions", {}).items()}

    def close(self) -> None:
        if self.puller is not None:
            self.puller.close()


def rollout_position(ckpt_dir: str, worker: str) -> Optional[Dict[str, Any]]:
    """Epoch and trained prompt ids of rollout worker ``worker`` saved in ``ckpt_dir``, or None."""
    path = recover.data_state_path(ckpt_dir, 0)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        state = json.load(f)
    return state.get("rollout_positions", {}).get(worker)


def _ranges(xs: List[int]) -> str:
    if not xs:
        return "[]"
    return f"[{xs[0]}..{xs[-1]}]" if xs == list(range(xs[0], xs[-1] + 1)) else str(xs)


def _brief(state: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={state.get(k)!r}" for k in ("stream", "epoch", "shard_size"))
