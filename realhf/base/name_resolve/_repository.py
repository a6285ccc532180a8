"""The backend-independent half of name resolution.

:class:`NameRecordRepository` implements the public operations (key checks,
sub-entries, waiting, watching, keepalive of TTL'd entries, cleanup of what this
process added) on top of a handful of primitive operations that each backend
provides (``_put``, ``_read``, ``_items``, ``_remove``, ``_remove_if_owned``,
``_refresh``).

Outages of the store itself (a backend's :attr:`~NameRecordRepository.transient_errors`:
etcd restarting, a network blip) are ridden out: every operation retries with backoff for
up to ``outage_tolerance`` seconds (default :data:`DEFAULT_OUTAGE_TOLERANCE`, or
``$REALHF_NAME_RESOLVE_OUTAGE_S``), logging when the store goes away and when it is back,
and only then raises ``ConnectionError`` naming the store, the operation and how long it
tried.  Keepalives keep retrying on their own; an entry is lost only when the store itself
expired it (an outage longer than its TTL).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import sys
import threading
import time
import traceback
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from realhf.base import logging

logger = logging.getLogger("name_resolve")

__all__ = [
    "DEFAULT_OUTAGE_TOLERANCE",
    "NameEntryExistsError",
    "NameEntryNotFoundError",
    "NameRecordRepository",
    "normalize_key",
]

# wait() without an explicit timeout gives up after this long, so a missing
# peer is reported instead of hanging a worker forever.
DEFAULT_WAIT_TIMEOUT = 300.0


class NameEntryExistsError(KeyError):
    """``add`` of a key that already exists (without ``replace=True``)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NameEntryNotFoundError(KeyError):
    """``get``/``delete`` of a key that does not exist (or has expired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def normalize_key(name: str) -> str:
    """Strip surrounding ``/`` and check the segments of key ``name``.

    Keys are ``/``-separated paths.  Segments may not be empty or start with
    ``.`` (the file backend keeps its bookkeeping in dot-files, and ``..``
    would escape its root).
    """
    if not isinstance(name, str):
        raise TypeError(f"name-resolve keys are str, got {type(name).__name__}: {name!r}.")
    key = name.strip("/")
    if not key:
        raise ValueError(f"name-resolve key {name!r} is empty.")
    for seg in key.split("/"):
        if not seg or seg.startswith(".") or "\0" in seg:
            raise ValueError(
                f"name-resolve key {name!r} has an invalid segment {seg!r}: segments "
                "must be non-empty, must not start with '.', and contain no NUL."
            )
    return key


def _check_value(value) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(
        f"name-resolve values are str (or int/float, stored as text), got "
        f"{type(value).__name__}: {value!r}. Serialize it (e.g. json.dumps) first."
    )


def in_subtree(key: str, prefix: str) -> bool:
    """Whether ``key`` is ``prefix`` itself or below it (path-wise, not string-wise)."""
    return key == prefix or key.startswith(prefix + "/")


@dataclasses.dataclass
class _Owned:
    """An entry this repository added and may have to keep alive / delete."""

    token: object  # backend's proof that the stored entry is still ours
    delete_on_exit: bool
    ttl: Optional[float]
    next_refresh: float = 0.0


#: seconds an operation retries while the store is unreachable (see the module docstring)
DEFAULT_OUTAGE_TOLERANCE = 30.0
#: seconds between keepalive attempts while the store is unreachable
OUTAGE_RETRY_S = 0.5


def _outage_tolerance() -> float:
    env = os.environ.get("REALHF_NAME_RESOLVE_OUTAGE_S")
    if env is None:
        return DEFAULT_OUTAGE_TOLERANCE
    try:
        value = float(env)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(
            f"REALHF_NAME_RESOLVE_OUTAGE_S={env!r}: give the seconds name-resolve operations "
            "may retry while the store is unreachable (a number >= 0)"
        )
    return value


def _warn_if_late(key: str, owned: "_Owned", now: float) -> None:
    """Log when a refresh runs so late that readers may have seen the entry expire.

    Refreshes are due every ttl/3; one that runs more than a third of the TTL late means
    this process could not run its keepalive thread for that long (the host overloaded,
    or a C call holding the GIL).  The main thread's stack at this moment is the best
    clue to which.
    """
    late = now - owned.next_refresh
    if owned.ttl is None or late <= owned.ttl / 3:
        return
    main = sys._current_frames().get(threading.main_thread().ident)
    where = "".join(traceback.format_stack(main)[-6:]) if main is not None else "(unknown)"
    logger.warning(
        f"keepalive of name-resolve key {key!r} ran {late:.1f}s late (TTL {owned.ttl:g}s): "
        f"this process was stalled; its main thread is now at:\n{where}"
    )


class NameRecordRepository(abc.ABC):
    """A key-value store of short strings with TTL'd entries (one backend)."""

    #: backend name, as given to ``reconfigure``
    backend: str = ""
    #: exceptions of the backend that mean "the store is unreachable right now"
    transient_errors: Tuple[type, ...] = ()

    def __init__(self) -> None:
        #: seconds an operation retries while the store is unreachable
        self.outage_tolerance = _outage_tolerance()
        self._owned: Dict[str, _Owned] = {}
        self._owned_lock = threading.Lock()
        self._closed = threading.Event()
        self._keepalive_wake = threading.Event()
        self._keepalive_thread: Optional[threading.Thread] = None
        self._watchers: List[threading.Thread] = []
        # A forked child inherits this object but owns none of its entries;
        # reset()/close() there must not delete the parent's keys.
        self._pid = os.getpid()

    # ---- primitives each backend implements ------------------------------

    @abc.abstractmethod
    def _put(self, key: str, value: str, ttl: Optional[float], replace: bool) -> object:
        """Store key; return an ownership token. Raise NameEntryExistsError if
        the key exists (and is not expired) and ``replace`` is False."""

    @abc.abstractmethod
    def _read(self, key: str) -> Optional[str]:
        """The live value of key, or None."""

    @abc.abstractmethod
    def _items(self, prefix: str) -> List[Tuple[str, str]]:
        """Live (key, value) pairs with ``in_subtree(key, prefix)``, any order."""

    @abc.abstractmethod
    def _remove(self, keys: Sequence[str]) -> int:
        """Delete the given keys; return how many existed."""

    @abc.abstractmethod
    def _remove_if_owned(self, key: str, token: object) -> None:
        """Delete key only if it is still the entry identified by token."""

    @abc.abstractmethod
    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        """Extend the life of key by ttl; False when it is gone or no longer ours."""

    def _clear(self, prefix: str) -> None:
        """Delete prefix and everything below it; backends may do better."""
        self._remove([k for k, _ in self._items(prefix)])

    def _close_backend(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release backend resources (connections); called once by close()."""

    # ---- public API --------------------------------------------------------

    def add(
        self,
        name: str,
        value,
        delete_on_exit: bool = True,
        keepalive_ttl: Optional[float] = None,
        replace: bool = False,
    ) -> None:
        """Store ``value`` under ``name``.

        Args:
            delete_on_exit: remove the entry in :meth:`reset` (called at exit
                for the module-level repository).
            keepalive_ttl: seconds; if given, the entry disappears about this
                long after this process stops refreshing it (i.e. dies).  A
                background thread refreshes it every ttl/3.
            replace: overwrite an existing entry instead of raising.

        Raises:
            NameEntryExistsError: the key exists and ``replace`` is False.
        """
        self._check_open()
        key = normalize_key(name)
        text = _check_value(value)
        if keepalive_ttl is not None:
            if not isinstance(keepalive_ttl, (int, float)) or keepalive_ttl <= 0:
                raise ValueError(
                    f"keepalive_ttl must be a positive number of seconds or None, "
                    f"got {keepalive_ttl!r}."
                )
            keepalive_ttl = float(keepalive_ttl)
        token = self._retrying(f"add {key!r}", self._put, key, text, keepalive_ttl, replace)
        # Refreshing every ttl/3 leaves room for a failed or late refresh (a
        # slow store, a long GC pause) before the entry expires under a live
        # owner.
        with self._owned_lock:
            self._owned[key] = _Owned(
                token,
                delete_on_exit,
                keepalive_ttl,
                time.monotonic() + (keepalive_ttl or 0) / 3,
            )
        if keepalive_ttl is not None:
            self._ensure_keepalive_thread()

    def add_subentry(self, name: str, value, **kwargs) -> str:
        """Add ``value`` under a fresh key ``{name}/{uuid8}`` and return that key.

        Keyword arguments are those of :meth:`add`.
        """
        root = normalize_key(name)
        while True:
            key = f"{root}/{uuid.uuid4().hex[:8]}"
            try:
                self.add(key, value, **kwargs)
                return key
            except NameEntryExistsError:  # 1 in 4e9; draw again
                continue

    def get(self, name: str) -> str:
        """The value of ``name``; raises NameEntryNotFoundError if absent."""
        self._check_open()
        key = normalize_key(name)
        value = self._retrying(f"get {key!r}", self._read, key)
        if value is None:
            raise NameEntryNotFoundError(
                f"name-resolve key {key!r} not found ({self.backend} backend)."
            )
        return value

    def get_subtree(self, name_root: str) -> List[str]:
        """Values of ``name_root`` and every key below it, ordered by key."""
        self._check_open()
        root = normalize_key(name_root)
        return [v for _, v in sorted(self._retrying(f"list {root!r}", self._items, root))]

    def find_subtree(self, name_root: str) -> List[str]:
        """Keys ``name_root`` and below it (path-wise), sorted."""
        self._check_open()
        root = normalize_key(name_root)
        return sorted(k for k, _ in self._retrying(f"list {root!r}", self._items, root))

    def delete(self, name: str) -> None:
        """Delete ``name``; raises NameEntryNotFoundError if absent."""
        self._check_open()
        key = normalize_key(name)
        with self._owned_lock:
            self._owned.pop(key, None)
        if self._retrying(f"delete {key!r}", self._remove, [key]) == 0:
            raise NameEntryNotFoundError(
                f"name-resolve key {key!r} not found ({self.backend} backend); nothing to delete."
            )

    def clear_subtree(self, name_root: str) -> None:
        """Delete ``name_root`` and every key below it (no error if none)."""
        self._check_open()
        root = normalize_key(name_root)
        with self._owned_lock:
            for k in [k for k in self._owned if in_subtree(k, root)]:
                del self._owned[k]
        self._retrying(f"clear {root!r}", self._clear, root)

    def wait(
        self,
        name: str,
        timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT,
        poll_frequency: float = 0.1,
    ) -> str:
        """Block until ``name`` exists and return its value.

        Args:
            timeout: seconds; None waits forever (use only where something
                else bounds the wait).
            poll_frequency: seconds between checks.

        Raises:
            TimeoutError: naming the key, after ``timeout`` seconds.
        """
        key = normalize_key(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_open()
            value = self._retrying(f"wait for {key!r}", self._read, key)
            if value is not None:
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"Timed out after {timeout:g}s waiting for name-resolve key "
                    f"{key!r} ({self.backend} backend); the process that should "
                    "register it may have failed to start or crashed."
                )
            wait_s = poll_frequency
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            if self._closed.wait(wait_s):
                self._check_open()

    def watch_names(
        self,
        names,
        call_back: Callable[[], None],
        poll_frequency: float = 5.0,
        wait_timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT,
    ) -> threading.Thread:
        """Call ``call_back()`` once, from a daemon thread, when all ``names`` are gone.

        First waits (in the caller, up to ``wait_timeout`` each) for every name
        to exist, so a watch set up before its targets registered does not
        fire at once.  The watcher stops without calling back when this
        repository is closed.  Returns the watcher thread.
        """
        if isinstance(names, str):
            names = [names]
        keys = [normalize_key(n) for n in names]
        if not keys:
            raise ValueError("watch_names needs at least one name to watch.")
        for key in keys:
            self.wait(key, timeout=wait_timeout)

        def _watch() -> None:
            while not self._closed.is_set():
                try:
                    if all(self._read(k) is None for k in keys):
                        break
                except Exception as e:  # backend hiccup: report, keep watching
                    logger.warning(f"watch_names({keys}) poll failed: {e!r}")
                if self._closed.wait(poll_frequency):
                    return
            else:  # loop condition failed: closed between polls, so no callback
                return
            try:
                call_back()
            except Exception:
                logger.exception(f"watch_names callback for {keys} raised")

        thread = threading.Thread(target=_watch, name=f"name_resolve-watch-{keys[0]}", daemon=True)
        thread.start()
        self._watchers.append(thread)
        return thread

    def reset(self) -> None:
        """Delete the entries this repository added with ``delete_on_exit``.

        An entry that another process has since replaced is left alone.  In a
        process forked from the one that added the entries this does nothing.
        """
        if os.getpid() != self._pid:
            return
        # Pick the entries under the lock, remove them outside it: backend
        # calls may block (an etcd timeout) and the keepalive thread needs
        # the lock meanwhile.
        with self._owned_lock:
            mine = [(k, o) for k, o in self._owned.items() if o.delete_on_exit]
            for k, _ in mine:
                del self._owned[k]
        for key, owned in mine:
            try:
                self._remove_if_owned(key, owned.token)
            except Exception as e:  # best effort at exit; say what was left
                logger.warning(f"Could not remove name-resolve key {key!r}: {e!r}")

    def close(self) -> None:
        """:meth:`reset`, stop keepalive and watcher threads, release the backend."""
        if self._closed.is_set():
            return
        # reset() first, while the backend (e.g. the etcd client) still works.
        self.reset()
        self._closed.set()
        self._keepalive_wake.set()
        if self._keepalive_thread is not None:
            self._keepalive_thread.join(timeout=5)
        self._close_backend()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed.is_set()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- outages of the store ---------------------------------------------

    def _retrying(self, what: str, fn, *args):
        """``fn(*args)``, retried with backoff while the store is unreachable, for up to
        :attr:`outage_tolerance` seconds; then ConnectionError naming what failed."""
        t0, delay, warned = time.monotonic(), 0.1, False
        while True:
            try:
                result = fn(*args)
            except self.transient_errors as e:
                waited = time.monotonic() - t0
                if waited >= self.outage_tolerance or self._closed.is_set():
                    raise ConnectionError(
                        f"the {self._where()} was unreachable for {waited:.1f}s "
                        f"(outage tolerance {self.outage_tolerance:g}s, "
                        f"$REALHF_NAME_RESOLVE_OUTAGE_S) during {what}: {type(e).__name__}: {e}"
                    ) from e
                if not warned:
                    logger.warning(
                        f"{self._where()} unreachable during {what} ({type(e).__name__}); "
                        f"retrying for up to {self.outage_tolerance:g}s"
                    )
                    warned = True
                self._closed.wait(min(delay, max(0.0, self.outage_tolerance - waited)))
                delay = min(2 * delay, 2.0)
                continue
            if warned:
                logger.info(
                    f"{self._where()} reachable again after {time.monotonic() - t0:.1f}s ({what})"
                )
            return result

    def _where(self) -> str:
        """The store, for messages (backends name their address)."""
        return f"{self.backend} name-resolve store"

    # ---- keepalive ---------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RuntimeError(
                f"This {self.backend} name-resolve repository is closed (reconfigure() "
                "replaced it or close() was called); use realhf.base.name_resolve's "
                "module functions, which follow reconfigure()."
            )

    def _ensure_keepalive_thread(self) -> None:
        with self._owned_lock:
            if self._keepalive_thread is None or not self._keepalive_thread.is_alive():
                self._keepalive_thread = threading.Thread(
                    target=self._keepalive_loop,
                    name=f"name_resolve-keepalive-{self.backend}",
                    daemon=True,
                )
                self._keepalive_thread.start()
        self._keepalive_wake.set()

    def _keepalive_loop(self) -> None:
        failing_since: Optional[float] = None
        while not self._closed.is_set():
            now = time.monotonic()
            with self._owned_lock:
                due = [
                    (k, o)
                    for k, o in self._owned.items()
                    if o.ttl is not None and o.next_refresh <= now
                ]
            # Refresh outside the lock, for the same reason as in reset().
            for key, owned in due:
                if failing_since is None:  # in an outage, lateness is the store's
                    _warn_if_late(key, owned, now)
                failed = False
                try:
                    alive = self._refresh(key, owned.token, owned.ttl)
                    if failing_since is not None:
                        logger.info(
                            f"keepalives reach the {self._where()} again after "
                            f"{time.monotonic() - failing_since:.1f}s"
                        )
                        failing_since = None
                        # A restarted store gives leases only about one TTL from its start:
                        # refresh every entry now, not on the schedule of the outage.
                        with self._owned_lock:
                            due_now = time.monotonic()  # due now, not late
                            for o in self._owned.values():
                                o.next_refresh = min(o.next_refresh, due_now)
                except Exception as e:  # transient: retry soon, entry may survive
                    if failing_since is None:  # once per outage, not once per key and try
                        failing_since = time.monotonic()
                        logger.warning(
                            f"Keepalive of name-resolve key {key!r} failed: {e!r}; retrying "
                            "until the store answers (it expires the entry only after its TTL)"
                        )
                    alive, failed = True, True
                with self._owned_lock:
                    if self._owned.get(key) is not owned:
                        continue  # deleted or re-added meanwhile
                    if alive:
                        # While the store is away, try often: the first answer counts.
                        owned.next_refresh = time.monotonic() + (
                            min(owned.ttl / 3, OUTAGE_RETRY_S) if failed else owned.ttl / 3
                        )
                    else:
                        # Gone or replaced by someone else: no longer ours.
                        del self._owned[key]
                        logger.warning(
                            f"name-resolve key {key!r} expired or was replaced in the "
                            f"{self._where()}; it is no longer kept alive"
                        )
            with self._owned_lock:
                pending = [o.next_refresh for o in self._owned.values() if o.ttl is not None]
            sleep = 1.0 if not pending else max(0.01, min(pending) - time.monotonic())
            # A wake-up set between wait() returning and clear() is lost; the
            # 1 s cap bounds how late a newly added short-TTL entry is seen.
            self._keepalive_wake.wait(min(sleep, 1.0))
            self._keepalive_wake.clear()
