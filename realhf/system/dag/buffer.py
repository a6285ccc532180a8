"""The master's view of the data in flight: which items exist, what keys they have, where.

The master never holds tensors.  For every item (a unique id) the :class:`SampleBuffer`
records

* its *birth* order (MFCs take the oldest ready items first),
* per key: the sequence lengths, dtype and trailing shape (enough for a receiver to
  allocate a buffer), and which model-worker ranks hold that key's data (the first is
  the *owner*: the rank that produced or loaded it; others received copies),
* its metadata (small JSON-like values, e.g. a math problem's solutions),
* which MFCs have consumed it.

Dataset items enter with :meth:`SampleBuffer.add`, MFC outputs extend them with
:meth:`SampleBuffer.amend`, and :meth:`SampleBuffer.remove` drops them once every MFC
has read them.  The class is plain data (no asyncio, no I/O) so it is unit-tested alone;
the master wraps it in an ``asyncio.Condition``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from realhf.api.core.data_api import SequenceSample

__all__ = ["KeyInfo", "BufferEntry", "SampleBuffer", "BufferError"]


class BufferError(ValueError):
    """Inconsistent bookkeeping: an unknown id, a duplicate, a key produced twice."""


@dataclasses.dataclass
class KeyInfo:
    """One key of one item: its sequence lengths, dtype, trailing shape and holders."""

    seqlens: List[int]
    dtype: Optional[torch.dtype]
    trailing_shape: Tuple[int, ...]
    #: ranks holding the data, the owner first
    holders: List[int]

    @property
    def owner(self) -> int:
        """The rank that produced or loaded this key's data."""
        return self.holders[0]

    @property
    def n_tokens(self) -> int:
        """Total length of the item's sequences for this key."""
        return sum(self.seqlens)


@dataclasses.dataclass
class BufferEntry:
    """Everything the master knows about one item."""

    id: str
    birth: int
    keys: Dict[str, KeyInfo]
    metadata: Dict[str, Any]
    consumed_by: Set[str] = dataclasses.field(default_factory=set)


class SampleBuffer:
    """Items in flight, keyed by id (see the module docstring)."""

    def __init__(self):
        self._entries: Dict[str, BufferEntry] = {}
        self._births = itertools.count()

    # ---- queries ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, id_: str) -> bool:
        return id_ in self._entries

    @property
    def ids(self) -> List[str]:
        """All ids, oldest first."""
        return [e.id for e in sorted(self._entries.values(), key=lambda e: e.birth)]

    def entry(self, id_: str) -> BufferEntry:
        """The :class:`BufferEntry` of ``id_``."""
        try:
            return self._entries[id_]
        except KeyError:
            raise BufferError(f"no item {id_!r} in the buffer ({len(self)} items)") from None

    def has_keys(self, id_: str, keys: Iterable[str]) -> bool:
        """Whether item ``id_`` has every key of ``keys``."""
        e = self.entry(id_)
        return all(k in e.keys for k in keys)

    def ready(
        self, mfc_name: str, input_keys: Sequence[str], among: Optional[Iterable[str]] = None
    ) -> List[str]:
        """Ids (oldest first) that have all ``input_keys`` and ``mfc_name`` has not consumed.

        ``among`` restricts the answer to those ids (e.g. the current step's items).
        """
        pool = self._entries.values() if among is None else [self.entry(i) for i in among]
        out = [
            e
            for e in pool
            if mfc_name not in e.consumed_by and all(k in e.keys for k in input_keys)
        ]
        return [e.id for e in sorted(out, key=lambda e: e.birth)]

    def consumed(self, ids: Iterable[str], mfc_names: Iterable[str]) -> bool:
        """Whether every MFC of ``mfc_names`` has consumed every item of ``ids``."""
        names = set(mfc_names)
        return all(names <= self.entry(i).consumed_by for i in ids)

    def holders(self, id_: str, key: str) -> List[int]:
        """Ranks holding ``key`` of item ``id_`` (owner first)."""
        e = self.entry(id_)
        if key not in e.keys:
            raise BufferError(f"item {id_!r} has no key {key!r} yet (keys: {sorted(e.keys)})")
        return list(e.keys[key].holders)

    def item_tokens(self, ids: Sequence[str], keys: Sequence[str]) -> List[int]:
        """Per item, its token count on the key (of ``keys``) with the most tokens overall."""
        if not keys:
            return [1] * len(ids)
        totals = {k: sum(self.entry(i).keys[k].n_tokens for i in ids) for k in keys}
        # One key measures every item, so the partition balances one quantity; sorted so a
        # tie picks the same key on every run.
        big = max(sorted(keys), key=lambda k: totals[k])
        return [self.entry(i).keys[big].n_tokens for i in ids]

    def meta(self, ids: Sequence[str], keys: Sequence[str]) -> SequenceSample:
        """A metadata-only sample of ``ids`` with ``keys`` and all their metadata.

        Metadata fields that some items lack are filled with None, so items produced by
        different calls still form one sample.
        """
        entries = [self.entry(i) for i in ids]
        for e in entries:
            missing = [k for k in keys if k not in e.keys]
            if missing:
                raise BufferError(f"item {e.id!r} lacks keys {missing} (has {sorted(e.keys)})")
        mkeys = sorted({m for e in entries for m in e.metadata})
        first = {k: entries[0].keys[k] for k in keys} if entries else {}
        return SequenceSample(
            keys=set(keys),
            trailing_shapes=(
                {k: first[k].trailing_shape for k in keys} if entries else {k: () for k in keys}
            ),
            dtypes={k: first[k].dtype for k in keys} if entries else {k: None for k in keys},
            ids=list(ids),
            seqlens={k: [list(e.keys[k].seqlens) for e in entries] for k in keys},
            data=None,
            metadata={m: [e.metadata.get(m) for e in entries] for m in mkeys},
        )

    # ---- updates ----------------------------------------------------------

    def add(self, meta: SequenceSample, owner: int) -> None:
        """Register new items (dataset items fetched by rank ``owner``), oldest first."""
        dup = [i for i in meta.ids if i in self._entries]
        if dup:
            raise BufferError(
                f"items {dup[:5]} are already in the buffer; dataset ids must be unique across "
                "shards and an item is fetched once per epoch"
            )
        for j, id_ in enumerate(meta.ids):
            self._entries[id_] = BufferEntry(
                id=id_,
                birth=next(self._births),
                keys={},
                metadata={m: v[j] for m, v in meta.metadata.items()},
            )
        self.amend(meta, owner)

    def amend(self, meta: SequenceSample, owner: int) -> None:
        """Record that rank ``owner`` now holds ``meta``'s keys of its (existing) items."""
        if meta.data is not None:
            raise BufferError(
                "the master received tensors; model workers must reply with sample.meta() "
                "(tensors stay on the model workers)"
            )
        for j, id_ in enumerate(meta.ids):
            e = self.entry(id_)
            for k in meta.keys:
                if k in e.keys and e.keys[k].owner != owner:
                    raise BufferError(
                        f"key {k!r} of item {id_!r} is already owned by rank {e.keys[k].owner}; "
                        f"rank {owner} produced it again"
                    )
                e.keys[k] = KeyInfo(
                    seqlens=list(meta.seqlens[k][j]),
                    dtype=meta.dtypes[k],
                    trailing_shape=tuple(meta.trailing_shapes[k]),
                    holders=[owner],
                )
            for m, v in meta.metadata.items():
                e.metadata[m] = v[j]

    def add_holder(self, ids: Iterable[str], key: str, rank: int) -> None:
        """Record that ``rank`` received a copy of ``key`` of ``ids``."""
        for id_ in ids:
            info = self.entry(id_).keys[key]
            if rank not in info.holders:
                info.holders.append(rank)

    def mark_consumed(self, ids: Iterable[str], mfc_name: str) -> None:
        """Record that ``mfc_name`` took ``ids`` (they are no longer ready for it)."""
        for id_ in ids:
            e = self.entry(id_)
            if mfc_name in e.consumed_by:
                raise BufferError(f"MFC {mfc_name!r} consumed item {id_!r} twice")
            e.consumed_by.add(mfc_name)

    def remove(self, ids: Iterable[str]) -> None:
        """Forget ``ids``."""
        for id_ in list(ids):
            self.entry(id_)
            del self._entries[id_]

    def holder_map(
        self, ids: Iterable[str], keys: Iterable[str]
    ) -> Mapping[Tuple[str, str], List[int]]:
        """``{(id, key): holders}`` for planning data transfers."""
        keys = list(keys)
        return {(i, k): self.holders(i, k) for i in ids for k in keys}
