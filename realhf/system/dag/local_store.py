"""A model worker's tensors: per item id and key, the packed data and its sequence lengths.

Data is kept in host memory (outputs computed on a GPU are copied out): it is small
next to the models (token ids, log-probs, rewards), moves between workers over gloo, and
the engines put each micro-batch on their device themselves.

Dataset items, MFC outputs and data received from other ranks all land here; an MFC's
input sample is assembled from it (:meth:`LocalStore.sample`) and the master's
``clear_data_cache`` drops items after every MFC has read them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Sequence

import torch

from realhf.api.core.data_api import SequenceSample

__all__ = ["LocalStore"]


@dataclasses.dataclass
class _Slot:
    data: torch.Tensor
    seqlens: List[int]


class LocalStore:
    """``id -> key -> (tensor, seqlens)`` on one model worker."""

    def __init__(self, worker: str = "model_worker"):
        self.worker = worker
        self._items: Dict[str, Dict[str, _Slot]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def ids(self) -> List[str]:
        """Ids with any data here."""
        return list(self._items)

    def has(self, id_: str, key: str) -> bool:
        """Whether ``key`` of ``id_`` is here."""
        return key in self._items.get(id_, {})

    def put(self, id_: str, key: str, data: torch.Tensor, seqlens: Sequence[int]) -> None:
        """Store one item's data for ``key`` (shape ``[sum(seqlens), *trailing]``)."""
        if data.shape[0] != sum(seqlens):
            raise ValueError(
                f"{self.worker}: item {id_!r} key {key!r}: data has {data.shape[0]} rows but "
                f"seqlens {list(seqlens)} sum to {sum(seqlens)}"
            )
        # Detached: stored outputs must not keep the autograd graph of the call alive.
        self._items.setdefault(id_, {})[key] = _Slot(data.detach().cpu(), [int(x) for x in seqlens])

    def put_sample(self, sample: SequenceSample, keys: Iterable[str] = None) -> None:
        """Store every item of ``sample`` (for ``keys``, default all) — data must be present."""
        keys = sorted(sample.keys if keys is None else keys)
        if sample.data is None:
            raise ValueError(f"{self.worker}: cannot store a metadata-only sample {sample!r}")
        for key in keys:
            x = sample.data.get(key)
            if x is None:
                raise ValueError(f"{self.worker}: sample key {key!r} has no data to store")
            parts = torch.split(x, sample.item_tokens(key), dim=0)
            for id_, lens, part in zip(sample.ids, sample.seqlens[key], parts):
                self.put(id_, key, part, lens)

    def get(self, id_: str, key: str) -> torch.Tensor:
        """The data of ``key`` of ``id_``; KeyError names what is missing."""
        try:
            return self._items[id_][key].data
        except KeyError:
            have = sorted(self._items.get(id_, {}))
            raise KeyError(
                f"{self.worker} holds no data for key {key!r} of item {id_!r} "
                f"(it has keys {have}); the master's transfer plan and this worker's store "
                "disagree"
            ) from None

    def sample(self, meta: SequenceSample) -> SequenceSample:
        """Assemble the data of ``meta``'s ids and keys (seqlens/metadata from ``meta``)."""
        data = {}
        for key in sorted(meta.keys):
            parts = []
            for id_, lens in zip(meta.ids, meta.seqlens[key]):
                x = self.get(id_, key)
                if x.shape[0] != sum(lens):
                    raise ValueError(
                        f"{self.worker}: item {id_!r} key {key!r} holds {x.shape[0]} rows but the "
                        f"master expects seqlens {lens}"
                    )
                parts.append(x)
            if parts:
                data[key] = torch.cat(parts, dim=0)
            else:
                data[key] = torch.empty((0, *meta.trailing_shapes[key]), dtype=meta.dtypes[key])
        return SequenceSample(
            keys=set(meta.keys),
            trailing_shapes=dict(meta.trailing_shapes),
            dtypes={k: data[k].dtype for k in meta.keys},
            ids=list(meta.ids),
            seqlens={k: [list(l) for l in v] for k, v in meta.seqlens.items()},
            data=data,
            metadata={m: list(v) for m, v in meta.metadata.items()},
        )

    def drop(self, ids: Iterable[str]) -> int:
        """Forget ``ids`` (unknown ids are ignored: a rank may hold nothing of an item)."""
        n = 0
        for id_ in ids:
            if self._items.pop(id_, None) is not None:
                n += 1
        return n
