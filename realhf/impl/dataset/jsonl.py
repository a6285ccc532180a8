"""Reading JSONL datasets with errors that name the file and line.

A malformed row (bad JSON, a missing or mistyped field) stops loading with a
`DatasetError` such as ``train.jsonl:17: missing field 'prompt'``: a training run
must not silently skip data it was told to use.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping


class DatasetError(ValueError):
    """A dataset file that cannot be used as given."""


def read_jsonl(path: str, required: Mapping[str, type | tuple]) -> List[Dict[str, Any]]:
    """Rows of `path`, each checked to hold `required` fields of the given types."""
    if not path:
        raise DatasetError("dataset path is empty; pass the path of a .jsonl file")
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file '{path}' does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(
                    f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}"
                )
            for key, tp in required.items():
                if key not in row:
                    raise DatasetError(f"{path}:{lineno}: missing field '{key}'")
                if not isinstance(row[key], tp):
                    want = tp.__name__ if isinstance(tp, type) else "/".join(t.__name__ for t in tp)
                    raise DatasetError(
                        f"{path}:{lineno}: field '{key}' must be {want}, got "
                        f"{type(row[key]).__name__}"
                    )
            rows.append(row)
    if not rows:
        raise DatasetError(f"dataset file '{path}' has no rows")
    return rows


def shard(rows: list, dp_rank: int, world_size: int) -> list:
    """Rows i with i % world_size == dp_rank: every row on exactly one rank."""
    if not 0 <= dp_rank < world_size:
        raise ValueError(f"dp_rank={dp_rank} out of range for world_size={world_size}")
    # Round-robin rather than contiguous blocks: shard sizes differ by at most one, and
    # a file sorted by difficulty or source is spread over all ranks.
    return rows[dp_rank::world_size]


class ItemDataset:
    """A list of one-item `SequenceSample`s, the form model workers load datasets in.

    A dataset with images sets ``row_images`` (a
    :class:`~realhf.impl.dataset.images.RowImages`): reading an item then adds its image
    keys.
    """

    items: list
    row_images = None

    def _finish(
        self, path: str, dropped: int, why: str, dp_rank: int, world_size: int, log
    ) -> None:
        """Log what was dropped and refuse a shard with nothing left."""
        if dropped:
            log.warning(f"{path}: dropped {dropped} {why}")
        if not self.items:
            raise DatasetError(f"{path}: no usable rows on rank {dp_rank}/{world_size}")

    def __len__(self) -> int:
        return len(self.items)

    def longest(self) -> int:
        """Tokens of the longest item (all its sequences, e.g. both answers of a pair)."""
        return max(
            (
                max(sum(sum(seqs) for seqs in lens) for lens in item.seqlens.values())
                for item in self.items
            ),
            default=0,
        )

    def __getitem__(self, i: int):
        if self.row_images is not None:
            return self.row_images.attach(i, self.items[i])
        return self.items[i]
