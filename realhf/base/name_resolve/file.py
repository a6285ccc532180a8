"""File-system backend: one directory tree shared by the processes of a machine.

This is the embedded default (see :mod:`realhf.base.name_resolve`).  Key
``a/b/c`` is stored as the file ``{root}/a/b/c/.entry`` holding JSON::

    {"value": "...", "expires_at": 1732250000.0 or null, "owner": "<uuid>"}

* Readers never see a half-written entry: writers write a temp file in the same
  directory and ``os.replace`` it over ``.entry``.
* Check-then-write sequences on a key (``add`` without replace, keepalive refresh,
  ``delete``) hold an exclusive ``flock`` on that key's own lock file ``.lock`` beside
  its ``.entry``, so concurrent ``add`` of one key from many processes has exactly one
  winner.  One lock per key, not one for the tree: a process that hangs while holding a
  lock (SIGSTOP, a debugger, a stalled disk) blocks only that key — with one tree-wide
  lock it froze every process's keepalives, and the whole run with them.  A lock held
  for over :data:`LOCK_WAIT` seconds fails the operation with a ``TimeoutError`` naming
  the key.  Plain reads take no lock.
* A lock file lives exactly as long as its key: the holder that leaves a key without an
  entry removes the file before it lets go (a run that adds and deletes keys for days
  leaves no files behind, and ``clear_subtree`` takes the locks with the entries).  A
  process that was waiting on a removed file sees, once it holds it, that the path no
  longer names that file, and locks the current one instead: one holder at a time.
* Private: directories are made mode 0700 and lock files 0600, so another local user can
  neither read the run's addresses nor take a key's lock and stall the run.
* Empty directories are pruned after a delete without any lock: ``rmdir`` removes
  only empty ones, and a process whose directory vanished under it makes it again.
* TTL: ``expires_at`` is wall-clock time (all users share this machine's
  clock); the owner rewrites it every ttl/3.  Readers treat an expired entry
  as absent, and writers overwrite or remove it.

Works on local file systems and on NFS with working ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
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
#: a key's lock file, beside its entry (so a cleared subtree takes its locks with it)
LOCK = ".lock"
#: seconds an operation waits for another process to release a key's lock
LOCK_WAIT = 30.0
#: what the backend creates is its user's alone (see the module docstring)
DIR_MODE, LOCK_MODE = 0o700, 0o600


class FileNameRecordRepository(NameRecordRepository):
    """Name-resolve store in a directory tree, safe across processes on one host."""

    backend = "file"

    def __init__(self, root: Optional[str] = None) -> None:
        super().__init__()
        root = constants.name_resolve_root() if root is None else root
        if not isinstance(root, str) or not root:
            raise ValueError(f"file backend root must be a non-empty path, got {root!r}.")
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isdir(root):
            # A root we make is private; one the user made keeps the mode they gave it.
            with contextlib.suppress(OSError):  # ensure_writable below names the problem
                os.makedirs(root, mode=DIR_MODE, exist_ok=True)
        # Raises PermissionError naming the path when it cannot be used.
        self.root = constants.ensure_writable(root)

    def __repr__(self) -> str:
        return f"FileNameRecordRepository(root={self.root!r})"

    # ---- helpers -----------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock; on the way out, remove the lock file (still holding it) and
        prune the key's empty directories when the key has no entry."""
        d = self._dir(key)
        path = os.path.join(d, LOCK)
        fd = self._acquire(key, path)
        try:
            yield
        finally:
            keyless = not os.path.exists(os.path.join(d, ENTRY))
            if keyless:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            os.close(fd)  # closing releases the flock
            if keyless:
                self._prune(key)

    def _acquire(self, key: str, path: str) -> int:
        """A descriptor of ``path`` holding its exclusive flock (waits up to LOCK_WAIT)."""
        # A fresh descriptor per acquisition: flock belongs to the open file
        # description, so two threads sharing one fd would both "hold" it.
        deadline, pause = time.monotonic() + LOCK_WAIT, 0.001
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, LOCK_MODE)
            except FileNotFoundError:  # the key's directory is new, or was pruned just now
                if time.monotonic() > deadline:
                    raise
                self._makedirs(os.path.dirname(path))
                continue
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"name-resolve key {key!r}: another process has held its "
                                f"lock {path} for over {LOCK_WAIT:g}s (is it hung?)"
                            ) from None
                        time.sleep(pause)
                        pause = min(pause * 2, 0.05)
            except BaseException:
                os.close(fd)
                raise
            if self._is_current(fd, path):
                return fd
            # Its holder removed the file (the key went) while we waited: a process
            # arriving now locks a new file, so this one guards nothing; take that one.
            os.close(fd)

    @staticmethod
    def _is_current(fd: int, path: str) -> bool:
        """Whether ``path`` still names the file open at ``fd``."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        held = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)

    def _makedirs(self, d: str) -> None:
        """``os.makedirs(d, exist_ok=True)``, each directory it makes mode DIR_MODE (makedirs
        gives missing parents the default mode).

        Another process releasing a key prunes directories that are empty: a parent made
        here can be gone again before ``d`` is made in it, and is then made again."""
        while True:
            try:
                os.mkdir(d, DIR_MODE)
                return
            except FileExistsError:
                return
            except FileNotFoundError:
                self._makedirs(os.path.dirname(d))

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
        # Called holding the key's lock, whose file keeps the directory from being pruned.
        # No fsync: entries describe live processes and expire with them, so a machine
        # crash makes them meaningless anyway, while keepalives rewrite them often (an
        # fsync each is costly, on NFS especially).  Atomicity against concurrent readers
        # is what matters here.
        path = self._entry_path(key)
        try:
            write_json_atomic(path, entry, fsync=False)
        except FileNotFoundError:  # the subtree was cleared meanwhile (clear_subtree)
            self._makedirs(os.path.dirname(path))
            write_json_atomic(path, entry, fsync=False)

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

    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        with self._locked(key):
            entry = self._load(self._entry_path(key))
            if entry is None or entry.get("owner") != token:
                return False
            entry["expires_at"] = time.time() + ttl
            self._write(key, entry)
        return True
