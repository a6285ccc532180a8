"""Watching the jobs of one launch: what every launcher (local, Ray, SLURM) decides alike.

:class:`JobSet` is the watch loop of a launcher; a launcher says how to refresh its jobs'
states (``_poll``) and how to stop everything (``stop_all``), and gets the outcome rules
of :meth:`JobSet.wait`: the controller decides; a failure gives it a grace to report;
once it has exited the others get a grace to exit and are then stopped as stragglers;
:class:`JobFailure` names every failed job with its log tail; ``TimeoutError`` names what
still runs; Ctrl-C/SIGTERM stop everything and re-raise.

:class:`LaunchedJob` is what the loop needs of one job: its name, whether it is done or
failed, a description of how it exited and the tail of its log.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
import signal
import threading
import time
import weakref
from typing import Callable, Dict, Iterator, Mapping, Optional, Sequence

from realhf.base import logging

logger = logging.getLogger("launcher", "system")

__all__ = [
    "CONTROLLER_TYPE",
    "JobFailure",
    "JobSet",
    "LaunchedJob",
    "describe_returncode",
    "interrupt_on_signals",
    "read_log_tail",
]

CONTROLLER_TYPE = "controller"
LOG_TAIL_LINES = 25


def describe_returncode(rc: Optional[int]) -> str:
    """``exit code 1`` / ``killed by SIGKILL`` (negative codes) / ``running`` (None)."""
    if rc is None:
        return "running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def read_log_tail(path: str, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of the log file ``path`` (read from its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(lines[-n:])


class LaunchedJob:
    """One launched process as the watch loop sees it.

    Subclasses provide ``worker_type``, ``index``, ``log_path``, ``returncode`` (None while
    running, negative: killed by that signal) and a settable ``stopped_as_straggler``;
    one that can end without an exit code (a lost actor) overrides ``done``/``failed``.
    """

    worker_type: str
    index: int
    log_path: str
    stopped_as_straggler: bool

    @property
    def returncode(self) -> Optional[int]:
        raise NotImplementedError

    @property
    def name(self) -> str:
        """``{worker_type}/{index}``."""
        return f"{self.worker_type}/{self.index}"

    @property
    def done(self) -> bool:
        """It has ended (no process is left to wait for)."""
        return self.returncode is not None

    @property
    def failed(self) -> bool:
        """It has ended other than with exit code 0."""
        return self.returncode not in (None, 0)

    def describe_exit(self) -> str:
        """``exit code 1`` / ``killed by SIGKILL`` / ``running``."""
        return describe_returncode(self.returncode)

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last ``n`` lines of the job's log file."""
        return read_log_tail(self.log_path, n)


class JobFailure(RuntimeError):
    """Launched processes failed; names each with its exit and log tail."""

    def __init__(self, failed: Sequence[LaunchedJob], headline: str = "launched processes failed"):
        self.failed = list(failed)
        parts = [headline + ":"]
        for j in self.failed:
            parts.append(
                f"--- {j.name} ({j.describe_exit()}), log {j.log_path} ---\n{j.log_tail()}"
            )
        super().__init__("\n".join(parts))


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise ``KeyboardInterrupt("received SIG...")`` (main
    thread only: elsewhere signal handlers cannot be set, and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    old = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# Job sets alive in this process that asked to be stopped at exit (weak: one that was
# garbage-collected has already stopped its jobs).
_stop_at_exit: "weakref.WeakSet[JobSet]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for s in list(_stop_at_exit):
        s.stop_all()


class JobSet(abc.ABC):
    """The jobs of one launch and the loop that watches them (see the module docstring).

    Subclasses set ``run_name`` (for messages), ``log_dir`` and ``jobs`` (or override
    ``_watched``), implement ``stop_all`` and, unless their jobs' states update by
    themselves, ``_poll``.
    """

    #: "local run", "Ray run", ...: what did not finish, in a TimeoutError
    run_name = "run"
    #: what stopping does, in the log line of an interrupted wait
    interrupt_action = "forwarding SIGINT to all jobs, then stopping them"
    #: how long one wait for news lasts: while watching (unless wait() says), while draining
    check_interval = 0.1
    drain_interval = 0.05
    log_dir: str
    jobs: Sequence[LaunchedJob]
    #: worker type -> restarts each of its jobs may get (partial restarts; see
    #: ``ExperimentConfig.restartable_types``); empty: a failed job fails the launch
    restartable: Mapping[str, int] = {}
    #: returns the controller's restart requests ``{job name: pid or None}`` and removes
    #: them: the job is killed (if that process still runs), then restarted as a failed one
    take_restart_requests: Optional[Callable[[], Dict[str, Optional[int]]]] = None
    _next_request_check = 0.0
    _restart_counts: Optional[Dict[str, int]] = None

    def stop_at_exit(self) -> None:
        """Have ``stop_all`` run when the interpreter exits (unless collected before)."""
        _stop_at_exit.add(self)

    # ---- what a launcher provides ----------------------------------------------

    @abc.abstractmethod
    def stop_all(self, grace: float = 5.0, first_signal: int = signal.SIGTERM) -> None:
        """Stop every job: ``first_signal``, then SIGKILL after ``grace`` s (or the
        launcher's equivalent), and wait until none is left."""

    def _watched(self) -> Sequence[LaunchedJob]:
        """The jobs the loop watches."""
        return self.jobs

    def _poll(self, wait_s: float) -> None:
        """Refresh the jobs' states, waiting up to ``wait_s`` for news."""
        time.sleep(wait_s)

    def _check_progress(self, elapsed: float) -> None:  # noqa: B027 (optional hook)
        """Called after every poll of the watch loop (not while draining); may raise."""

    def _busy(self) -> bool:
        """Something of the launch still runs (after the controller exited)."""
        return not all(j.done for j in self._watched())

    def _timeout_context(self) -> str:
        """More to say in a TimeoutError after the list of what still runs."""
        return ""

    def _after_wait(self) -> None:  # noqa: B027 (optional hook)
        """Called when wait() returns or raises, after everything was stopped."""

    def _relaunch(self, job: LaunchedJob) -> None:
        """Start ``job``'s command again in place of its ended process (partial restarts)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart single jobs")

    def _kill(self, job: LaunchedJob) -> None:
        """Kill ``job``'s process (and its children) at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill single jobs")

    def _restart_jobs(self) -> None:
        """Kill what the controller asked to restart; restart failed restartable jobs."""
        now = time.monotonic()
        if self.take_restart_requests is not None and now >= self._next_request_check:
            self._next_request_check = now + 0.5
            by_name = {j.name: j for j in self._watched()}
            for name, pid in self.take_restart_requests().items():
                job = by_name.get(name)
                if job is None or job.done or (pid is not None and getattr(job, "pid", pid) != pid):
                    continue  # gone already, or already replaced by a new process
                logger.warning(f"{name}: the controller asked for a restart; killing pid {pid}")
                self._kill(job)
        if self._restart_counts is None:
            self._restart_counts = {}
        counts = self._restart_counts
        for job in self._watched():
            limit = self.restartable.get(job.worker_type)
            if limit is None or not job.failed:
                continue
            n = counts.get(job.name, 0)
            if n >= limit:
                continue  # the controller reports it; the launch fails as usual
            counts[job.name] = n + 1
            logger.warning(f"{job.name} {job.describe_exit()}: restarting it ({n + 1}/{limit})")
            self._relaunch(job)

    # ---- the loop --------------------------------------------------------------

    def wait(
        self,
        *,
        timeout: Optional[float] = None,
        main_type: str = CONTROLLER_TYPE,
        failure_grace: float = 30.0,
        exit_grace: float = 15.0,
        check_interval: Optional[float] = None,
    ) -> Dict[str, int]:
        """Wait for the jobs; stop them all on failure; return exit codes by name.

        Jobs of ``main_type`` (the controller) decide the outcome: when they
        have exited, the others get ``exit_grace`` s to finish and are then
        stopped (as stragglers, not counted as failures).
        When any job fails, the main jobs get ``failure_grace`` s to notice
        and report (the controller's report is the better error) before
        everything is stopped.  Ctrl-C (SIGINT) and SIGTERM are forwarded to
        every job, then everything is stopped.  Without ``main_type`` jobs,
        all jobs must exit 0.  States are polled every ``check_interval`` s
        (default: the launcher's ``check_interval``).

        Raises:
            JobFailure: some job failed (names each failed job, with log tail).
            TimeoutError: ``timeout`` s passed (all jobs are stopped).
            KeyboardInterrupt: on Ctrl-C / SIGTERM, after stopping all jobs.
        """
        if not self._watched():
            raise RuntimeError(f"{type(self).__name__}.wait(): nothing was submitted.")
        interval = self.check_interval if check_interval is None else check_interval
        try:
            with interrupt_on_signals():
                try:
                    return self._watch(timeout, main_type, failure_grace, exit_grace, interval)
                except KeyboardInterrupt:
                    logger.warning(f"interrupted: {self.interrupt_action}")
                    self.stop_all(first_signal=signal.SIGINT)
                    raise
                except BaseException:
                    self.stop_all()
                    raise
        finally:
            self._after_wait()

    def _watch(
        self, timeout, main_type, failure_grace, exit_grace, check_interval
    ) -> Dict[str, int]:
        jobs = self._watched()
        t0 = time.monotonic()
        mains = [j for j in jobs if j.worker_type == main_type] or list(jobs)
        first_failure: Optional[float] = None
        while True:
            self._poll(check_interval)
            self._check_progress(time.monotonic() - t0)
            if all(j.done for j in mains):
                return self._outcome(mains, exit_grace)
            if self.restartable:
                self._restart_jobs()
            now = time.monotonic()
            failed = [j for j in jobs if j.failed]
            if failed and first_failure is None:
                first_failure = now
                logger.warning(
                    f"{[f'{j.name} ({j.describe_exit()})' for j in failed]} failed; giving "
                    f"{[j.name for j in mains]} up to {failure_grace:g}s to report"
                )
            if first_failure is not None and now - first_failure > failure_grace:
                raise JobFailure(
                    failed,
                    f"processes failed and {[j.name for j in mains]} did not finish "
                    f"within {failure_grace:g}s",
                )
            if timeout is not None and now - t0 > timeout:
                running = [j.name for j in jobs if not j.done]
                raise TimeoutError(
                    f"{self.run_name} did not finish within {timeout:g}s; still running: "
                    f"{running}{self._timeout_context()}. Logs are in {self.log_dir}."
                )

    def _outcome(self, mains: Sequence[LaunchedJob], exit_grace: float) -> Dict[str, int]:
        """The main jobs have exited: drain the others, then return or raise."""
        # Whatever the outcome, the controller has told the workers to exit: let them
        # finish doing so before stopping the rest.
        self._drain_others(exit_grace)
        jobs = self._watched()
        failed = [j for j in jobs if j.failed and not j.stopped_as_straggler]
        failed_mains = [j for j in mains if j.failed]
        if failed_mains:
            raise JobFailure(failed_mains + [j for j in failed if j not in failed_mains])
        if failed:
            raise JobFailure(failed, "the controller succeeded but these processes failed")
        return {j.name: j.returncode for j in jobs}

    def _drain_others(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._busy() and time.monotonic() < deadline:
            self._poll(self.drain_interval)
        stragglers = [j for j in self._watched() if not j.done]
        if stragglers:
            logger.warning(
                f"{[j.name for j in stragglers]} still running {grace:g}s after the "
                "controller finished; stopping them"
            )
            for j in stragglers:
                j.stopped_as_straggler = True
        self.stop_all()
