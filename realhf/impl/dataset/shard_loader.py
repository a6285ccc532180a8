"""A model worker's deterministic, recoverable pass over its dataset shard.

Each epoch visits the shard in a random order drawn from ``(seed, epoch)`` only, so every
run — and every resumed run — sees the same order.  The loader remembers which item ids
it handed out in the current epoch; :meth:`ShardLoader.state_dict` saves them and
:meth:`ShardLoader.load_state_dict` skips them, so after a restart each item is still
used exactly once per epoch.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from realhf.api.core.data_api import SequenceSample
from realhf.base import seeding

__all__ = ["ShardLoader"]


class ShardLoader:
    """Epoch order, position and used ids over ``dataset`` (items are ``SequenceSample`` s).

    Args:
        dataset: ``len(dataset)`` and ``dataset[i]`` -> a one-item ``SequenceSample``.
        seed: the experiment seed.
        name: for error messages (the worker name).
    """

    def __init__(self, dataset, seed: int, name: str = "model_worker"):
        self.dataset = dataset
        self.seed = seed
        self.name = name
        self.ids: List[str] = []
        for i in range(len(dataset)):
            item = dataset[i]
            if not isinstance(item, SequenceSample) or len(item) != 1:
                raise TypeError(
                    f"{name}: dataset item {i} must be a one-item SequenceSample, got {item!r}"
                )
            self.ids.append(item.ids[0])
        if len(set(self.ids)) != len(self.ids):
            dup = next(x for x in self.ids if self.ids.count(x) > 1)
            raise ValueError(
                f"{name}: dataset id {dup!r} appears more than once; ids must be unique"
            )
        self.epoch = 0
        self._start_epoch(0, used=())

    def __len__(self) -> int:
        return len(self.ids)

    def _order(self, epoch: int) -> List[int]:
        seed = seeding.derive_seed(self.seed, f"dataset_order:epoch{epoch}")
        return np.random.default_rng(seed).permutation(len(self.ids)).tolist()

    def _start_epoch(self, epoch: int, used) -> None:
        used = set(used)
        self.epoch = epoch
        self.used: List[str] = [i for i in self.ids if i in used]
        self._todo = [j for j in self._order(epoch) if self.ids[j] not in used]

    @property
    def n_used(self) -> int:
        """Items handed out in the current epoch."""
        return len(self.ids) - len(self._todo)

    @property
    def remaining(self) -> int:
        """Items of the current epoch not handed out yet."""
        return len(self._todo)

    def take(self, epoch: int, n: int) -> List[SequenceSample]:
        """The next ``n`` items of ``epoch`` (fewer if the epoch has fewer left).

        Asking for the next epoch moves on to it, but only once the current one is used up;
        anything else means the master and this worker disagree on the position.
        """
        if epoch == self.epoch + 1 and not self._todo:
            self._start_epoch(epoch, used=())
        elif epoch != self.epoch:
            raise ValueError(
                f"{self.name}: asked for items of epoch {epoch} but the loader is in epoch "
                f"{self.epoch} with {self.remaining} items left; master and worker disagree"
            )
        if n < 0:
            raise ValueError(f"{self.name}: cannot take {n} items")
        picked, self._todo = self._todo[:n], self._todo[n:]
        self.used.extend(self.ids[j] for j in picked)
        return [self.dataset[j] for j in picked]

    def state_dict(self) -> Dict[str, Any]:
        """Epoch and the ids used in it (JSON-serializable)."""
        return {"epoch": self.epoch, "used_ids": list(self.used), "shard_size": len(self.ids)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume at the saved epoch, skipping the ids used in it."""
        if state.get("shard_size") != len(self.ids):
            raise ValueError(
                f"{self.name}: the recover checkpoint's data state is for a shard of "
                f"{state.get('shard_size')} items, this worker loaded {len(self.ids)}; resume "
                "with the same dataset and number of model workers"
            )
        known = set(self.ids)
        unknown = [i for i in state["used_ids"] if i not in known]
        if unknown:
            raise ValueError(
                f"{self.name}: the recover checkpoint names items {unknown[:3]} that this shard "
                "lacks; resume with the same dataset and number of model workers"
            )
        self._start_epoch(int(state["epoch"]), used=state["used_ids"])
