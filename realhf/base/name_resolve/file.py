"""File-system backend: one directory tree shared by the processes of a machine.

This is the embedded default (see :mod:`realhf.base.name_resolve`).  Key
``a/b/c`` is stored as the file ``{root}/a/b/c/.entry`` holding JSON::

    {"value": "...", "expires_at": 1732250000.0 or null, "owner": "<uuid>"}

* Readers never see a half-written entry: writers write a temp file in the same
  directory and ``os.replace`` it over ``.entry``.
* Check-then-write sequences on a key (``add`` without replace, keepalive refresh,
  ``delete``) hold an exclusive ``flock`` on that key's own lock file under
  ``{root}/.locks/``, so concurrent ``add`` of one key from many processes has
  exactly one winner.  One lock per key, not one for the tree: a process that hangs
  while holding a lock (SIGSTOP, a debugger, a stalled disk) blocks only that key —
  with one tree-wide lock it froze every process's keepalives, and the whole run with
  them.  A lock held for over :data:`LOCK_WAIT` seconds fails the operation with a
  ``TimeoutError`` naming the key.  Plain reads take no lock.
* Empty directories are pruned after a delete without any lock: ``rmdir`` removes
  only empty ones, and a writer whose directory vanished under it makes it again.
* TTL: ``expires_at`` is wall-clock time (all users share this machine's
  clock); the owner rewrites it every ttl/3.  Readers treat an expired entry
  as absent, and writers overwrite or remove it.

Works on local file systems and on NFS with working ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from typing import Iterator, List, Optional, Sequence, Tuple

from realhf.base import constants
from realhf.base.name_resolve._repository import (
    NameEntryExistsError,
    NameRecordRepository,
)
from realhf.base.storage.atomic_file import write_json_atomic

ENTRY = ".entry"
LOCKS = ".locks"
#: seconds an operation waits for another process to release a key's lock
LOCK_WAIT = 30.0


class FileNameRecordRepository(NameRecordRepository):
    """Name-resolve store in a directory tree, safe across processes on one host."""

    backend = "file"

    def __init__(self, root: Optional[str] = None) -> None:
        super().__init__()
        root = constants.name_resolve_root() if root is None else root
        if not isinstance(root, str) or not root:
            raise ValueError(f"file backend root must be a non-empty path, got {root!r}.")
        # Raises PermissionError naming the path when it cannot be used.
        self.root = constants.ensure_writable(os.path.abspath(os.path.expanduser(root)))
        self._locks = os.path.join(self.root, LOCKS)

    def __repr__(self) -> str:
        return f"FileNameRecordRepository(root={self.root!r})"

    # ---- helpers -----------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        # A fresh descriptor per acquisition: flock belongs to the open file
        # description, so two threads sharing one fd would both "hold" it.
        path = os.path.join(self._locks, hashlib.sha1(key.encode()).hexdigest())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:  # first use, or the tree was cleared
            os.makedirs(self._locks, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            deadline, pause = time.monotonic() + LOCK_WAIT, 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"name-resolve key {key!r}: another process has held its lock "
                            f"{path} for over {LOCK_WAIT:g}s (is it hung?)"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _dir(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _entry_path(self, key: str) -> str:
        return os.path.join(self._dir(key), ENTRY)

    @staticmethod
    def _load(path: str) -> Optional[dict]:
        """The entry at path if it exists and has not expired."""
        try:
            with open(path, "r", encoding="utf-8") as f:
                entry = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        exp = entry.get("expires_at")
        if exp is not None and exp < time.time():
            return None
        return entry

    def _write(self, key: str, entry: dict) -> None:
        d = self._dir(key)
        # No fsync: entries describe live processes and expire with them, so a
        # machine crash makes them meaningless anyway, while keepalives rewrite
        # them often (an fsync each is costly, on NFS especially).  Atomicity
        # against concurrent readers is what matters here.
        for attempt in range(10):
            os.makedirs(d, exist_ok=True)
            try:
                write_json_atomic(os.path.join(d, ENTRY), entry, fsync=False)
                return
            except FileNotFoundError:
                # Another process pruned the (then empty) directory between our makedirs
                # and the temp file: make it again. Once the temp file is in, it stays.
                if attempt == 9:
                    raise

    def _prune(self, key: str) -> None:
        """Remove now-empty directories from key's up to (excluding) the root."""
        d = self._dir(key)
        while os.path.abspath(d) != self.root:
            try:
                os.rmdir(d)
            except OSError:  # not empty (other keys below) or already gone
                return
            d = os.path.dirname(d)

    # ---- primitives --------------------------------------------------------

    def _put(self, key: str, value: str, ttl: Optional[float], replace: bool) -> object:
        token = uuid.uuid4().hex
        entry = {
            "value": value,
            "expires_at": None if ttl is None else time.time() + ttl,
            "owner": token,
        }
        with self._locked(key):
            if not replace and self._load(self._entry_path(key)) is not None:
                raise NameEntryExistsError(
                    f"name-resolve key {key!r} already exists (file backend at "
                    f"{self.root}); pass replace=True to overwrite."
                )
            self._write(key, entry)
        return token

    def _read(self, key: str) -> Optional[str]:
        entry = self._load(self._entry_path(key))
        return None if entry is None else entry["value"]

    def _items(self, prefix: str) -> List[Tuple[str, str]]:
        # os.walk of a missing directory yields nothing (errors are ignored by
        # default), which is the right answer for an absent prefix.  No lock:
        # entries are replaced atomically, and one removed mid-walk is skipped.
        top = self._dir(prefix)
        out = []
        for dirpath, _dirs, files in os.walk(top):
            if ENTRY not in files:
                continue
            entry = self._load(os.path.join(dirpath, ENTRY))
            if entry is None:
                continue
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            out.append((rel, entry["value"]))
        return out

    def _remove(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            with self._locked(key):
                path = self._entry_path(key)
                n += self._load(path) is not None
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.remove(path)
            self._prune(key)
        return n

    def _clear(self, prefix: str) -> None:
        # Removes expired entries and stray temp files too; an entry written while this
        # runs may stay (clearing is for a subtree nobody writes, e.g. a trial at launch).
        shutil.rmtree(self._dir(prefix), ignore_errors=True)
        # The parent may be empty now.  For a top-level prefix the parent is
        # the root, which _prune never removes; pruning the (already gone)
        # prefix itself is then a no-op.
        self._prune(os.path.dirname(prefix) if "/" in prefix else prefix)

    def _remove_if_owned(self, key: str, token: object) -> None:
        with self._locked(key):
            path = self._entry_path(key)
            entry = self._load(path)
            if entry is None or entry.get("owner") != token:
                return
            os.remove(path)
        self._prune(key)

    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        with self._locked(key):
            entry = self._load(self._entry_path(key))
            if entry is None or entry.get("owner") != token:
                return False
            entry["expires_at"] = time.time() + ttl
            self._write(key, entry)
        return True
