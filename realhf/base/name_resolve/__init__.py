"""Name resolution: how realhf processes find each other.

A key-value store of short strings with optional TTL'd entries, reached through
module-level functions that delegate to one swappable backend::

    from realhf.base import name_resolve, names
    name_resolve.add(names.worker(exp, trial, "model_worker/0"), "tcp://10.0.0.2:5555",
                     keepalive_ttl=30)
    addr = name_resolve.wait(names.worker(exp, trial, "model_worker/0"), timeout=60)

Backends (``reconfigure(backend, **kwargs)``):

``"memory"``
    a dict held by the repository object, visible to this process's threads
    only; for single-process tests.
``"file"`` (``root=``)
    a directory tree shared by all processes of one machine; the embedded
    default.  Default root ``{fileroot}/name_resolve`` (see
    :mod:`realhf.base.constants`).
``"etcd3"`` (``host=``, ``port=`` or ``address="host:port"``, ``timeout=``)
    an etcd v3 server, for clusters.  Fails within ``timeout`` (5 s) with a
    ConnectionError naming host:port when nothing answers.
``"ray"`` (``address="host:port"``, ``timeout=``)
    the key-value store of a Ray cluster's GCS (``host:port`` = the GCS
    address, as ``ray start --head`` prints it), for experiments launched on
    Ray (``mode=ray``).  Same failure behaviour as etcd3.

Until ``reconfigure`` is called, the first use builds the backend named by the
environment variable ``REALHF_NAME_RESOLVE``:

* ``memory``
* ``file`` or ``file:///abs/path`` (root; default ``{fileroot}/name_resolve``)
* ``etcd3://host:port``
* ``ray://host:port`` (a Ray GCS address, not a Ray Client address)

and the file backend when it is unset.  Launchers set the variable for the
workers they start, so every process of an experiment uses the same store.

Entries added with ``keepalive_ttl`` are refreshed by a background thread of
the adding process and disappear about ``keepalive_ttl`` seconds after it dies
(file and ray: an expiry time in the entry; etcd3: a lease).  Entries added with
``delete_on_exit=True`` (the default) are removed by :func:`reset`, which runs
at interpreter exit (not in forked children, and not on SIGKILL: use a TTL for
entries that must vanish when their owner dies).  The etcd3 (grpc) and Ray
(GCS) clients are not fork-safe: build the repository after forking.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Callable, List, Optional

from realhf.base.name_resolve._repository import (
    DEFAULT_WAIT_TIMEOUT,
    NameEntryExistsError,
    NameEntryNotFoundError,
    NameRecordRepository,
)

__all__ = [
    "NameEntryExistsError",
    "NameEntryNotFoundError",
    "NameRecordRepository",
    "BACKENDS",
    "ENV_VAR",
    "make_repository",
    "from_spec",
    "reconfigure",
    "repository",
    "add",
    "add_subentry",
    "get",
    "get_subtree",
    "find_subtree",
    "wait",
    "watch_names",
    "delete",
    "clear_subtree",
    "reset",
]

ENV_VAR = "REALHF_NAME_RESOLVE"
BACKENDS = ("memory", "file", "etcd3", "ray")


def make_repository(backend: str, **kwargs) -> NameRecordRepository:
    """Build a repository of ``backend`` (one of :data:`BACKENDS`) with ``kwargs``."""
    if backend == "memory":
        from realhf.base.name_resolve.memory import MemoryNameRecordRepository

        return MemoryNameRecordRepository(**kwargs)
    if backend == "file":
        from realhf.base.name_resolve.file import FileNameRecordRepository

        return FileNameRecordRepository(**kwargs)
    if backend == "etcd3":
        from realhf.base.name_resolve.etcd3 import Etcd3NameRecordRepository

        return Etcd3NameRecordRepository(**kwargs)
    if backend == "ray":
        from realhf.base.name_resolve.ray_kv import RayKVNameRecordRepository

        return RayKVNameRecordRepository(**kwargs)
    raise ValueError(
        f"Unknown name-resolve backend {backend!r}; valid backends: {', '.join(BACKENDS)}."
    )


def from_spec(spec: str) -> NameRecordRepository:
    """Build a repository from a ``REALHF_NAME_RESOLVE``-style spec string.

    ``memory`` | ``file`` | ``file:///abs/root`` | ``etcd3://host:port`` |
    ``ray://host:port`` (the GCS address of a Ray cluster).
    """
    s = spec.strip()
    if s == "memory":
        return make_repository("memory")
    if s == "file":
        return make_repository("file")
    if s.startswith("file://"):
        root = s[len("file://") :]
        if not root.startswith("/"):
            raise ValueError(
                f"{ENV_VAR}={spec!r}: a file root must be absolute, e.g. file:///tmp/nr."
            )
        return make_repository("file", root=root)
    if s.startswith("etcd3://"):
        return make_repository("etcd3", address=s)
    if s.startswith("ray://"):
        return make_repository("ray", address=s)
    raise ValueError(
        f"{ENV_VAR}={spec!r} is not understood; use one of 'memory', 'file', "
        "'file:///abs/path', 'etcd3://host:port' or 'ray://gcs_host:port'."
    )


# Guards _repo only; repositories do their own locking.
_lock = threading.RLock()
_repo: Optional[NameRecordRepository] = None


def _default() -> NameRecordRepository:
    spec = os.environ.get(ENV_VAR)
    return from_spec(spec) if spec else make_repository("file")


def repository() -> NameRecordRepository:
    """The repository the module functions use (built on first use)."""
    global _repo
    with _lock:
        if _repo is None:
            _repo = _default()
        return _repo


def reconfigure(backend: str, **kwargs) -> NameRecordRepository:
    """Switch this process to a new ``backend`` repository and return it.

    The previous repository is closed: its ``delete_on_exit`` entries are
    removed and its keepalive/watch threads stop.
    """
    global _repo
    new = make_repository(backend, **kwargs)
    with _lock:
        old, _repo = _repo, new
    # Closed outside the lock: close() deletes entries and joins the keepalive
    # thread, which can take seconds against an unreachable etcd, and other
    # threads should meanwhile already reach the new repository.
    if old is not None:
        old.close()
    return new


def add(
    name: str,
    value,
    delete_on_exit: bool = True,
    keepalive_ttl: Optional[float] = None,
    replace: bool = False,
) -> None:
    """See :meth:`NameRecordRepository.add`."""
    repository().add(
        name, value, delete_on_exit=delete_on_exit, keepalive_ttl=keepalive_ttl, replace=replace
    )


def add_subentry(name: str, value, **kwargs) -> str:
    """See :meth:`NameRecordRepository.add_subentry`."""
    return repository().add_subentry(name, value, **kwargs)


def get(name: str) -> str:
    """See :meth:`NameRecordRepository.get`."""
    return repository().get(name)


def get_subtree(name_root: str) -> List[str]:
    """See :meth:`NameRecordRepository.get_subtree`."""
    return repository().get_subtree(name_root)


def find_subtree(name_root: str) -> List[str]:
    """See :meth:`NameRecordRepository.find_subtree`."""
    return repository().find_subtree(name_root)


def wait(
    name: str,
    timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT,
    poll_frequency: float = 0.1,
) -> str:
    """See :meth:`NameRecordRepository.wait`."""
    return repository().wait(name, timeout=timeout, poll_frequency=poll_frequency)


def watch_names(
    names,
    call_back: Callable[[], None],
    poll_frequency: float = 5.0,
    wait_timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT,
) -> threading.Thread:
    """See :meth:`NameRecordRepository.watch_names`."""
    return repository().watch_names(
        names, call_back, poll_frequency=poll_frequency, wait_timeout=wait_timeout
    )


def delete(name: str) -> None:
    """See :meth:`NameRecordRepository.delete`."""
    repository().delete(name)


def clear_subtree(name_root: str) -> None:
    """See :meth:`NameRecordRepository.clear_subtree`."""
    repository().clear_subtree(name_root)


def reset() -> None:
    """Remove the entries this process added with ``delete_on_exit=True``."""
    with _lock:
        repo = _repo
    if repo is not None:
        repo.reset()


@atexit.register
def _cleanup_at_exit() -> None:
    with _lock:
        repo = _repo
    if repo is not None and not repo.closed:
        try:
            repo.close()
        except Exception:  # the store may be gone already; nothing to save
            pass
