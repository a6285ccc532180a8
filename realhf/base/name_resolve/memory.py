"""In-process backend: a dict.  For single-process tests and tools.

Entries live as long as the process, so TTL'd entries never expire while
their owner (this process) lives, which is exactly the TTL contract.
"""

from __future__ import annotations

import threading
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.base.name_resolve._repository import (
    NameEntryExistsError,
    NameRecordRepository,
    in_subtree,
)


class MemoryNameRecordRepository(NameRecordRepository):
    """A name-resolve store visible to the threads of this process only."""

    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self._store: Dict[str, Tuple[str, str]] = {}  # key -> (value, token)
        self._lock = threading.Lock()

    def _put(self, key: str, value: str, ttl: Optional[float], replace: bool) -> object:
        # A fresh token per put, so that _remove_if_owned/_refresh of an
        # earlier owner never touch an entry that was replaced since.
        token = uuid.uuid4().hex
        with self._lock:
            if key in self._store and not replace:
                raise NameEntryExistsError(
                    f"name-resolve key {key!r} already exists (memory backend); "
                    "pass replace=True to overwrite."
                )
            self._store[key] = (value, token)
        return token

    def _read(self, key: str) -> Optional[str]:
        with self._lock:
            entry = self._store.get(key)
        return None if entry is None else entry[0]

    def _items(self, prefix: str) -> List[Tuple[str, str]]:
        with self._lock:
            return [(k, v) for k, (v, _) in self._store.items() if in_subtree(k, prefix)]

    def _remove(self, keys: Sequence[str]) -> int:
        with self._lock:
            return sum(self._store.pop(k, None) is not None for k in keys)

    def _remove_if_owned(self, key: str, token: object) -> None:
        with self._lock:
            entry = self._store.get(key)
            if entry is not None and entry[1] == token:
                del self._store[key]

    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        with self._lock:
            entry = self._store.get(key)
        return entry is not None and entry[1] == token
