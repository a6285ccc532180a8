"""Atomic file replacement: readers see the old content or the new, never a mix.

Every write goes to a temp file with a unique name in the target's directory
(same file system, so the final ``os.replace`` is an atomic rename), is flushed
and, by default, fsynced, then renamed over the target; the directory is then
fsynced (best effort) so the rename itself survives a power loss.  Concurrent
writers of one path each use their own temp file, so the last rename wins and
the result is always exactly one writer's complete payload.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Optional, Tuple, Union

__all__ = ["write_atomic", "write_json_atomic"]


def _fsync_dir(directory: str) -> None:
    # Best effort: some file systems (and non-POSIX platforms) cannot open or
    # fsync a directory; the data is already atomic, only durability is lost.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create_temp(directory: str, base: str) -> Tuple[int, str]:
    # Not tempfile.mkstemp: it creates mode 0600, while callers expect what a
    # plain open() gives (0666 minus the umask), e.g. name-resolve entries read
    # by other users' processes.  O_EXCL keeps the name unique per writer.
    while True:
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # astronomically unlikely; just draw another name
            continue


def write_atomic(path: str, data: Union[str, bytes], *, fsync: bool = True) -> None:
    """Replace the file at ``path`` with ``data`` atomically.

    ``str`` data is written as UTF-8.  The parent directory must exist.  With
    ``fsync=False`` the replacement is still atomic for concurrent readers, but
    a machine crash right after may lose it (use it for short-lived state whose
    loss is harmless and whose writes are frequent).  On any error the temp
    file is removed and ``path`` keeps its previous content.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"write_atomic({path!r}): data must be str or bytes, got "
            f"{type(data).__name__}; serialize it first (e.g. write_json_atomic)."
        )
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temp(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # BaseException too: a KeyboardInterrupt mid-write must not leave temp files.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        _fsync_dir(directory)


def write_json_atomic(
    path: str, obj: Any, *, indent: Optional[int] = None, fsync: bool = True
) -> None:
    """:func:`write_atomic` of ``json.dumps(obj, indent=indent)``.

    The object is serialized before any file is created, so an unserializable
    object raises without touching the disk.
    """
    write_atomic(path, json.dumps(obj, indent=indent), fsync=fsync)
