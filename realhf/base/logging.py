"""Per-worker loggers: coloured on a terminal, plain in files.

Every realhf process names its loggers after what it is (``master_worker/0``,
``model_worker/3``); ``getLogger(name, type_)`` picks a format for the kind of
output (``system`` for workers, ``benchmark`` for timings, ``colored`` for user
facing messages).  Colour codes are emitted only when the stream is a TTY so log
files and captured test output stay plain text.

All output goes through one stderr handler on the package logger ``realhf``: the
loggers made here and plain ``logging.getLogger(__name__)`` loggers of realhf modules
propagate to it, so a module's INFO lines are printed and formatted like everyone
else's, and a worker's log file (attached to the package logger) receives them all.
The package logger itself does not propagate to the root logger, so nothing prints twice.

Add a worker's log file with :func:`add_file_handler`; the run-directory layout
(``{fileroot}/{experiment}/{trial}/logs/{worker}.log``) lives in
:mod:`realhf.base.constants`.

This module shadows the standard library's ``logging`` inside ``realhf.base``;
it imports the standard one absolutely, so ``import logging`` elsewhere is
unaffected.
"""

from __future__ import annotations

import logging as _std_logging
import os
import sys
import threading
from typing import Dict, Optional

__all__ = [
    "getLogger",
    "add_file_handler",
    "remove_file_handler",
    "set_level",
    "LOG_TYPES",
    "DEBUG",
    "INFO",
    "WARNING",
    "ERROR",
    "CRITICAL",
]

DEBUG = _std_logging.DEBUG
INFO = _std_logging.INFO
WARNING = _std_logging.WARNING
ERROR = _std_logging.ERROR
CRITICAL = _std_logging.CRITICAL

_DATEFMT = "%Y%m%d-%H:%M:%S"
# One format per kind of output.  The logger (worker) name follows the time
# stamp so `grep` over a directory of worker logs finds one worker's lines.
LOG_TYPES: Dict[str, str] = {
    "system": "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s",
    "benchmark": "%(asctime)s.%(msecs)03d [BENCH] %(name)s: %(message)s",
    "colored": "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s",
    "plain": "%(message)s",
}

_COLOURS = {
    "DEBUG": "\033[36m",  # cyan
    "INFO": "\033[32m",  # green
    "WARNING": "\033[33m",  # yellow
    "ERROR": "\033[31m",  # red
    "CRITICAL": "\033[1;31m",  # bold red
}
_RESET = "\033[0m"

# Our loggers live under this prefix in the stdlib hierarchy so configuring
# them never touches third-party loggers (and vice versa).
_ROOT = "realhf"
_lock = threading.Lock()
_configured: Dict[str, _std_logging.Logger] = {}
_file_handlers: Dict[str, _std_logging.Handler] = {}


def _default_level() -> int:
    name = os.environ.get("REALHF_LOG_LEVEL", "INFO").upper()
    level = _std_logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(
            f"REALHF_LOG_LEVEL={name!r} is not a logging level; use one of "
            "DEBUG, INFO, WARNING, ERROR, CRITICAL."
        )
    return level


class _ColourFormatter(_std_logging.Formatter):
    """Colours the level name, only when the handler's stream is a TTY."""

    def __init__(self, fmt: str, stream=None) -> None:
        super().__init__(fmt, datefmt=_DATEFMT)
        self._stream = stream  # None: whatever sys.stderr is at emit time

    def format(self, record: _std_logging.LogRecord) -> str:
        text = super().format(record)
        stream = sys.stderr if self._stream is None else self._stream
        isatty = getattr(stream, "isatty", None)
        if isatty is not None and isatty():
            colour = _COLOURS.get(record.levelname, "")
            return f"{colour}{text}{_RESET}" if colour else text
        return text


class _TypedFormatter(_std_logging.Formatter):
    """Formats each record in the format of the logger type it came from.

    One handler serves every realhf logger, so the type travels on the record
    (set by the logger's :class:`_ShortName` filter); records of plain module
    loggers use the ``system`` format.
    """

    def __init__(self) -> None:
        super().__init__()
        self._by_type = {t: _ColourFormatter(fmt) for t, fmt in LOG_TYPES.items()}

    def format(self, record: _std_logging.LogRecord) -> str:
        return self._by_type[getattr(record, "realhf_type", "system")].format(record)


class _StderrHandler(_std_logging.StreamHandler):
    """Looks up ``sys.stderr`` at emit time (pytest's capsys swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # the base __init__ assigns it
        pass


def _install_package_logger() -> _std_logging.Logger:
    """Give the package logger its one stderr handler (idempotent)."""
    package = _std_logging.getLogger(_ROOT)
    if not any(isinstance(h, _StderrHandler) for h in package.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_TypedFormatter())
        package.addHandler(handler)
        package.setLevel(_default_level())
        package.propagate = False
    return package


def getLogger(name: Optional[str] = None, type_: str = "system") -> _std_logging.Logger:
    """Return the logger ``name`` printing to stderr in the ``type_`` format.

    Args:
        name: usually the worker name, e.g. ``"model_worker/2"``; None gives
            the package logger ``"realhf"``.
        type_: one of :data:`LOG_TYPES`.

    The same (name) always returns the same logger; the format is fixed by the
    first call.
    """
    if type_ not in LOG_TYPES:
        raise ValueError(f"Unknown log type {type_!r}; valid types: {sorted(LOG_TYPES)}.")
    full = _ROOT if name is None else f"{_ROOT}.{name}"
    with _lock:
        logger = _configured.get(full)
        if logger is not None:
            return logger
        level = _default_level()
        _install_package_logger()
        logger = _std_logging.getLogger(full)
        logger.setLevel(level)
        if name is not None:
            # Printing and log files are the package logger's handlers'; this one
            # only names its records and picks their format.
            logger.addFilter(_ShortName(name, type_))
        _configured[full] = logger
        return logger


class _ShortName(_std_logging.Filter):
    """Shows a logger's short name (no ``realhf.`` prefix) and tags its format type."""

    def __init__(self, short: str, type_: str) -> None:
        super().__init__()
        self._short = short
        self._type = type_

    def filter(self, record: _std_logging.LogRecord) -> bool:
        # Mutating the record (rather than formatting differently) is what
        # lets the package logger's shared handlers see the short name: a
        # logger's filters run once, before the record propagates to them.
        record.name = self._short
        record.realhf_type = self._type
        return True


def add_file_handler(path: str, level: Optional[int] = None) -> _std_logging.Handler:
    """Also write every realhf logger's records (plain text) to ``path``.

    Intended for a worker's log file.  The parent directory is created.
    Calling twice with the same path returns the existing handler.
    """
    path = os.path.abspath(path)
    with _lock:
        if path in _file_handlers:
            return _file_handlers[path]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Append: a worker restarted after a failure (or a recovered run) must
        # not wipe the lines that explain why it was restarted.
        handler = _std_logging.FileHandler(path, mode="a", encoding="utf-8")
        handler.setFormatter(_std_logging.Formatter(LOG_TYPES["system"], datefmt=_DATEFMT))
        if level is not None:
            handler.setLevel(level)
        _file_handlers[path] = handler
        _install_package_logger().addHandler(handler)
    return handler


def remove_file_handler(path: str) -> None:
    """Detach and close the handler added by :func:`add_file_handler`."""
    path = os.path.abspath(path)
    with _lock:
        handler = _file_handlers.pop(path, None)
    if handler is None:
        return
    _std_logging.getLogger(_ROOT).removeHandler(handler)
    handler.close()


def set_level(level: int) -> None:
    """Set the level of every realhf logger created so far (and the default)."""
    # Through the environment too, so that worker processes spawned after this
    # call start at the same level.
    os.environ["REALHF_LOG_LEVEL"] = _std_logging.getLevelName(level)
    with _lock:
        _install_package_logger().setLevel(level)
        for logger in _configured.values():
            logger.setLevel(level)


# realhf/__init__.py imports this module, so module loggers of any realhf import
# have a handler to propagate to before anyone calls getLogger().
_install_package_logger()
