"""Errors that cross process boundaries, and the timeouts of our streams.

A failure inside a worker must reach whoever waits on it with enough context to
act on without opening the worker's log: which worker, which request, and the
remote traceback.  :class:`ErrorInfo` is the picklable record that travels over
ZMQ; :class:`RemoteError` is what the caller raises from it.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Dict, Optional


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    """What went wrong in another process (plain data, safe to pickle).

    ``worker`` is the worker name (``model_worker/1``); ``handle_name`` the
    request handle or control command that failed (empty when the failure was
    not tied to one); ``traceback`` the formatted remote traceback.
    """

    worker: str
    handle_name: str
    exc_type: str
    message: str
    traceback: str
    request_id: str = ""

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, worker: str, handle_name: str = "", request_id: str = ""
    ) -> "ErrorInfo":
        """Capture ``exc`` (with its traceback) as it is being handled."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            worker=worker,
            handle_name=handle_name,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback=tb,
            request_id=request_id,
        )

    def summary(self) -> str:
        """One line: ``ValueError: bad input``."""
        return f"{self.exc_type}: {self.message}" if self.message else self.exc_type


class RemoteError(RuntimeError):
    """A request failed inside another process.

    Raised on the caller's side; ``info`` holds the worker name, the request
    handle and the remote traceback, all of which appear in ``str(error)``.
    """

    def __init__(self, info: ErrorInfo):
        self.info = info
        where = f"{info.worker}"
        if info.handle_name:
            where += f" while handling {info.handle_name!r}"
        if info.request_id:
            where += f" (request {info.request_id})"
        super().__init__(
            f"{info.summary()} in {where}\n"
            f"--- remote traceback from {info.worker} ---\n{info.traceback.rstrip()}"
        )

    def __reduce__(self):
        # Exceptions pickle through their args; ours is built from ``info``.
        return (RemoteError, (self.info,))


class StreamTimeout(TimeoutError):
    """A receive on a stream or control socket timed out.

    ``waited_for`` names the peer(s) or request(s) the caller was waiting on.
    """

    def __init__(self, message: str, waited_for: str = ""):
        self.waited_for = waited_for
        super().__init__(message)

    def __reduce__(self):
        return (StreamTimeout, (str(self), self.waited_for))


class NoMessage(Exception):
    """A non-blocking receive found nothing queued (not an error)."""


class ExperimentFailed(RuntimeError):
    """The controller stopped an experiment because workers failed.

    ``failures`` maps each failed worker name to the reason (its status and,
    for ERROR, the remote error summary and traceback).
    """

    def __init__(self, experiment: str, trial: str, failures: Dict[str, str]):
        self.experiment = experiment
        self.trial = trial
        self.failures = dict(failures)
        lines = [f"experiment {experiment!r} trial {trial!r} failed:"]
        for worker, reason in sorted(self.failures.items()):
            lines.append(f"  {worker}: {reason}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (ExperimentFailed, (self.experiment, self.trial, self.failures))


class StopRequested(RuntimeError):
    """The controller stopped an experiment because a user asked it to
    (``python -m realhf.apps.main stop``); not a failure to recover from."""


def format_error(info: Optional[ErrorInfo]) -> str:
    """Readable multi-line text for an optional :class:`ErrorInfo`."""
    if info is None:
        return "no error details were published"
    return f"{info.summary()}\n{info.traceback.rstrip()}"
