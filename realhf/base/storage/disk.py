"""Recognising a full disk in whatever form a writer reports it.

Python's own writes raise ``OSError(ENOSPC)``, but the libraries that write checkpoints
do not: ``torch.save`` raises ``RuntimeError("... unexpected pos ...")`` with the
``OSError`` of the underlying file object as its context (none at all when it is given a
path: write through a Python file object), and safetensors raises ``SafetensorError``
whose message ends in ``(os error 28)``.  :func:`no_space_reason` looks through both.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Optional

__all__ = ["no_space_reason", "free_bytes"]

#: the errors that mean "this write does not fit", and how to say so
_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (a file-size limit, e.g. ulimit -f)",
}
_OS_ERROR = re.compile(r"os error (\d+)")
_MESSAGES = {
    "no space left on device": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "file too large": errno.EFBIG,
}


def no_space_reason(exc: BaseException) -> Optional[str]:
    """Why ``exc`` (or an exception it was raised from or during) says the disk is full;
    None when it is about something else."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _REASONS:
            return _REASONS[exc.errno]
        text = str(exc).lower()
        for m in _OS_ERROR.finditer(text):
            if int(m.group(1)) in _REASONS:
                return _REASONS[int(m.group(1))]
        for phrase, code in _MESSAGES.items():
            if phrase in text:
                return _REASONS[code]
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: str) -> Optional[int]:
    """Bytes free on the file system of ``path`` (its nearest existing ancestor); None if
    unknown."""
    path = os.path.abspath(path)
    while True:
        try:
            return shutil.disk_usage(path).free
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
