"""Start the processes of a local run by forking one pre-imported Python process.

Every realhf process imports torch, numba and transformers before it does anything: about
3.4 s of CPU on a 2-core VM, paid once per process, so a seven-process async run spent
more CPU importing than training (``py-spy record --subprocesses`` of a 2-step
async-ppo-math: 24 of 46 CPU seconds).  The fork server imports those libraries once,
then forks a child per process: the child sets its session, environment and log file,
runs ``python -m MODULE ARGS`` in place, and pays ~0.5 s for realhf's own modules.

What a child inherits, and why it is the same as a fresh interpreter for us:

* only *third-party* modules are imported before the fork (:data:`PRELOAD`); realhf's own
  modules, which read ``REALHF_*`` at import, are imported by the child under its own
  environment.  The server starts with the launcher's environment, and a process whose
  environment differs from it in anything but ``REALHF_*`` and ``CUDA_VISIBLE_DEVICES``
  (read at first CUDA use) is started by ``subprocess`` instead (:meth:`ForkServer.can_fork`);
* the server runs no torch op and starts no thread before forking (OpenBLAS's pool, made
  at numpy's import, re-forms after a fork), so no lock is held in the child;
* numpy's global RNG is reseeded from the OS in the child, as a fresh process would be.

A launcher that imports torch and transformers itself to build the experiment
(``quickstart``) does not start the server as a new interpreter: it imports those first,
before realhf's other modules, and forks itself into the server (:func:`start_early`),
which imports the rest of :data:`PRELOAD` while the launcher builds.  A local run then
imports the libraries once, not twice (2-step ppo-math: 23 -> 17.5 CPU seconds here).

Protocol: the launcher writes one JSON request per line to the server's stdin and reads
JSON lines from a pipe the server got as ``argv[1]``: ``{"ready"}`` once the imports are
done, ``{"pid"}`` (or ``{"error"}``) per request, ``{"exited", "rc"}`` when the server reaps
a child.  Only the launcher holds the pipes: nothing listens.  When the launcher dies or
closes the server, the server sees end-of-file and exits, and its children (which ask
for a parent-death signal, see ``realhf.apps.remote``) die with it, as they would with
the launcher.  ``REALHF_FORKSERVER=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

# Imported by the server too, where no logger is made: realhf's loggers read the
# environment when made, and the children must make theirs under their own.
from realhf.base import logging

__all__ = [
    "ForkServer",
    "ForkedProcess",
    "ForkServerError",
    "enabled",
    "forkable",
    "launch",
    "prestart",
    "shared",
    "shared_pids",
]

#: libraries every realhf process imports; a missing one is skipped
PRELOAD = (
    "numpy",
    "torch",
    # torch.optim.Optimizer imports dynamo on first use (~1.7 s here)
    "torch._dynamo",
    "numba",
    "transformers",
    "safetensors.torch",
    "zmq",
    "pydantic",
    "fastapi",
    "uvicorn",
    "aiohttp",
)
#: what of :data:`PRELOAD` a launcher imports itself (to build the experiment): a server
#: forked from the launcher (:func:`start_early`) has them from it and imports the rest
LAUNCHER_IMPORTS = frozenset({"numpy", "torch", "numba", "transformers"})
#: transformers attributes resolved at preload (its top level imports lazily)
_TRANSFORMERS_ATTRS = ("AutoTokenizer", "PreTrainedTokenizerFast", "AutoConfig")
#: modules whose ``python -m`` command lines may be forked instead of executed
FORKABLE_MODULES = frozenset({"realhf.apps.remote"})
#: environment variables a forked child may have that the server did not: ours (read by
#: realhf's modules, which the child imports itself) and pytest's per-test ones
_CHILD_ONLY_PREFIXES = ("REALHF_", "PYTEST_")
_CHILD_ONLY_KEYS = frozenset({"CUDA_VISIBLE_DEVICES"})
#: a child whose fate is unknown because the server that reaped it is gone
LOST_RC = 255
ENV_SWITCH = "REALHF_FORKSERVER"
# The server's modules to import come through its environment, not its argv: a child's
# title (setproctitle) replaces argv's memory, and one shorter than the server's argv is
# shown NUL-padded, which psutil and `ps -o args` read as a single word.
_PRELOAD_ENV = "REALHF_FORKSERVER_PRELOAD"


def forkable(argv: Sequence[str], modules: Optional[frozenset] = None) -> bool:
    """Whether ``argv`` is ``python -m`` of one of ``modules`` (default
    :data:`FORKABLE_MODULES`), run by this interpreter."""
    modules = FORKABLE_MODULES if modules is None else modules
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in modules


class ForkServerError(RuntimeError):
    """The fork server cannot start a process (it is gone, or did not become ready)."""


def enabled() -> bool:
    """Whether local launches fork their processes (Linux, unless ``REALHF_FORKSERVER=0``)."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SWITCH, "1") != "0"


# ---- the server process ---------------------------------------------------------------


def _preload(names: Sequence[str]) -> Dict[str, str]:
    """Import ``names``; the ones that failed, with why."""
    skipped = {}
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # an optional dependency; the child imports what it needs
            skipped[name] = repr(e)
            continue
        if name == "transformers":
            for attr in _TRANSFORMERS_ATTRS:
                getattr(mod, attr, None)
    return skipped


def _warm_up() -> None:
    """In the server, what the children would each do on first use of a preloaded library."""
    if "numba" in sys.modules:
        # The first jitted call of a process builds numba's CPU target context (~0.7 s
        # here, even for a function loaded from numba's disk cache): built once here,
        # every child has it.  It starts no thread.
        from numba.core.registry import cpu_target

        cpu_target.target_context.refresh()


def _write(fd: int, msg: dict) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _exit_code(status: int) -> int:
    """A waitpid status as Popen reports it (negative: killed by that signal)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve(reply_fd: int) -> Optional[dict]:
    """Fork a child per request; return the request in the child, None at end-of-file."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()
    children = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _write(reply_fd, {"exited": pid, "rc": _exit_code(status)})
        if 0 not in readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return None  # the launcher closed us or died
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            # The child leads its own session (and process group) before its pid is
            # reported: the launcher may signal the group at once (proc_group.stop_groups),
            # and a group that does not exist yet reads as one already gone.
            session_r, session_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as e:
                os.close(session_r)
                os.close(session_w)
                _write(reply_fd, {"error": f"fork failed: {e}"})
                continue
            if pid == 0:
                os.setsid()
                for fd in (0, reply_fd, wake_r, wake_w, session_r, session_w):
                    os.close(fd)
                return request
            os.close(session_w)
            os.read(session_r, 1)  # end-of-file once the child has closed it (or died)
            os.close(session_r)
            children.add(pid)
            _write(reply_fd, {"pid": pid})


def _become(request: dict) -> None:
    """In the child, already in its own session: leave the server's signals, environment
    and output."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)  # fd 0: the server's stdin was closed
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    for fd, path in ((1, request["log"]), (2, request.get("err") or request["log"])):
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, fd)
        os.close(log)
    # Unbuffered, as PYTHONUNBUFFERED=1 makes them: a log is read while the process runs,
    # and a server forked from a launcher (start_early) has the launcher's buffered streams.
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True)
        setattr(sys, name, stream)
    env = dict(request["env"])
    env["REALHF_PARENT_PID"] = str(os.getppid())  # the server: it is our parent now
    os.environ.clear()
    os.environ.update(env)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh process would have its own state
    if "setproctitle" in sys.modules:  # ps and /proc/PID/cmdline show the child's command
        command = [sys.executable, "-m", request["module"], *request["args"]]
        sys.modules["setproctitle"].setproctitle(" ".join(command))
    sys.argv = [request["module"], *request["args"]]


def main() -> None:
    reply_fd = int(sys.argv[1])
    t0 = time.monotonic()
    skipped = _preload([m for m in os.environ.pop(_PRELOAD_ENV, "").split(",") if m])
    _warm_up()
    _run(reply_fd, skipped, time.monotonic() - t0)


def _run(reply_fd: int, skipped: Dict[str, str], seconds: float, title: str = "") -> None:
    """Report ready and serve.  Returns only in a forked child, once the child's module has
    run; the server leaves at the end of its input by ``os._exit``."""
    try:
        import setproctitle

        # Its first call claims the memory of argv and the environment, which it can only
        # do while the environment is the one the process started with: here, not in a
        # child that has replaced it.
        setproctitle.setproctitle(title or setproctitle.getproctitle())
    except ImportError:
        pass
    _write(reply_fd, {"ready": True, "skipped": skipped, "seconds": seconds})
    request = _serve(reply_fd)
    if request is None:
        # Nothing of the server's is left to do: its output is discarded, its children are
        # the launcher's, and its exit hooks, if forked from a launcher, are the
        # launcher's.  A normal exit would spend ~1.3 s of CPU tearing down torch & co.
        os._exit(0)
    _become(request)
    import runpy

    # Runs as `python -m MODULE` would; its SystemExit ends this interpreter normally
    # (non-daemon threads joined, atexit hooks run, streams flushed).
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _serve_forked(req_r: int, reply_fd: int, preload: Sequence[str], t0: float):
    """The server forked from a launcher (:func:`start_early`): set up as :class:`ForkServer`
    starts one (its own session, requests on stdin, output discarded), import the rest of
    ``preload``, then serve.  Never returns: each child leaves by ``SystemExit``, which
    unwinds the launcher's frames above it (none of them catches it) and exits the
    interpreter normally (the server leaves by ``os._exit`` in :func:`_run`)."""
    os.setsid()
    os.dup2(req_r, 0)
    os.close(req_r)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    skipped = _preload(preload)
    _warm_up()
    title = f"{sys.executable} -m realhf.scheduler.forkserver (forked by the launcher)"
    _run(reply_fd, skipped, time.monotonic() - t0, title=title)
    raise SystemExit(0)


# ---- the launcher's side --------------------------------------------------------------


class ForkedProcess:
    """A child of the fork server, watched like a :class:`subprocess.Popen`.

    The server reaps it and reports its exit code; ``poll``/``wait``/``returncode``
    behave as Popen's (negative: killed by that signal).
    """

    def __init__(self, server: "ForkServer", pid: int, args: List[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._server.lost:
            # Its exit went with the server; a process that is gone is reported lost.
            if not os.path.exists(f"/proc/{self.pid}"):
                self.returncode = LOST_RC
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server._exited:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self._server._exited.wait(0.1 if left is None else min(left, 0.1))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ServerProcess:
    """A server forked from this process (:func:`start_early`), watched as the Popen of a
    server started with ``subprocess`` is."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its code is unknown
                self.returncode = LOST_RC
            else:
                if pid:
                    self.returncode = _exit_code(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """A pre-imported server process that forks ``python -m realhf.apps.remote`` processes.

    The server's own output is discarded (what it could print is what its imports print);
    modules it could not import are logged here at debug level.

    Args:
        env: its environment (default ``os.environ``), with ``PYTHONUNBUFFERED=1`` unless
            set: the children's stdio is the server's.
        preload: the modules it imports before forking.
        ready_timeout: how long :meth:`spawn` waits for the imports to finish.
        reply_timeout: how long one fork may take to be acknowledged.
    """

    def __init__(
        self,
        env: Optional[Mapping[str, str]] = None,
        *,
        preload: Sequence[str] = PRELOAD,
        ready_timeout: float = 300.0,
        reply_timeout: float = 30.0,
        here: bool = False,
    ):
        self.ready_timeout = ready_timeout
        self.reply_timeout = reply_timeout
        self.env = _server_env(os.environ if env is None else env)
        self.cwd = os.getcwd()
        self.lost = False
        #: set when a fork failed (:func:`launch`): its launches are executed from then on
        self.failed = False
        self._children: Dict[int, ForkedProcess] = {}
        #: the argv of the request in flight (one at a time, under ``_spawn_lock``)
        self._spawning: List[str] = []
        self._replies: List[dict] = []
        self._ready = False
        self._cond = threading.Condition()
        self._exited = threading.Condition()
        self._spawn_lock = threading.Lock()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        if here:
            self.proc = self._fork_here(preload, (req_r, req_w, rep_r, rep_w))
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "realhf.scheduler.forkserver", str(rep_w)],
                stdin=req_r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**self.env, _PRELOAD_ENV: ",".join(preload)},
                pass_fds=(rep_w,),
                start_new_session=True,
            )
        os.close(req_r)
        os.close(rep_w)
        self._requests = os.fdopen(req_w, "wb", buffering=0)
        self._reader = threading.Thread(
            target=self._read_replies, args=(rep_r,), name="forkserver-replies", daemon=True
        )
        self._reader.start()

    def _fork_here(self, preload: Sequence[str], fds: tuple) -> "_ServerProcess":
        """Import what of ``preload`` a launcher imports anyway (:data:`LAUNCHER_IMPORTS`)
        in this process, then fork it into the server, which imports the rest while the
        launcher goes on."""
        req_r, req_w, rep_r, rep_w = fds
        t0 = time.monotonic()
        skipped = _preload([m for m in preload if m in LAUNCHER_IMPORTS])
        # As those libraries left it: the launches of this process compare theirs with it.
        self.env = _server_env(os.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(req_w)
            os.close(rep_r)
            _serve_forked(req_r, rep_w, [m for m in preload if m not in LAUNCHER_IMPORTS], t0)
        if skipped:  # a logger made after the fork: the server's children make their own
            logging.getLogger("forkserver", "system").debug(f"not preloaded here: {skipped}")
        return _ServerProcess(pid)

    def _read_replies(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                msg = json.loads(line)
                if "pid" in msg:
                    # Registered here, before the next line is read: the server may report
                    # the child's exit right after its pid, before spawn() wakes up.
                    with self._exited:
                        child = ForkedProcess(self, msg["pid"], self._spawning)
                        self._children[child.pid] = child
                    msg["child"] = child
                if "exited" in msg:
                    with self._exited:
                        child = self._children.pop(msg["exited"], None)
                        if child is not None:
                            child.returncode = msg["rc"]
                        self._exited.notify_all()
                    continue
                with self._cond:
                    if msg.get("ready"):
                        self._ready = True
                        logging.getLogger("forkserver", "system").debug(
                            f"fork server {self.proc.pid} ready after {msg['seconds']:.1f}s; "
                            f"not preloaded: {msg['skipped'] or 'none'}"
                        )
                    else:
                        self._replies.append(msg)
                    self._cond.notify_all()
        with self._cond, self._exited:
            self.lost = True
            self._cond.notify_all()
            self._exited.notify_all()

    def can_fork(
        self, argv: Sequence[str], env: Mapping[str, str], modules: Optional[frozenset] = None
    ) -> bool:
        """Whether ``argv`` run with ``env`` may be forked from this server: it is
        ``python -m`` of one of ``modules`` (default :data:`FORKABLE_MODULES`), from the same
        directory, and its environment differs from the server's only in variables no
        preloaded library reads at import."""
        if self.lost or self.failed or not forkable(argv, modules) or os.getcwd() != self.cwd:
            return False
        return not self.env_difference(env)

    def env_difference(self, env: Mapping[str, str]) -> List[str]:
        """The variables of ``env`` that differ from the server's and that a preloaded
        library might have read at import (a child with any of them is executed)."""
        mine, theirs = _inherited(self.env), _inherited(env)
        return sorted(key for key in set(mine) | set(theirs) if mine.get(key) != theirs.get(key))

    def _wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                if self.lost:
                    raise ForkServerError(f"the fork server (pid {self.proc.pid}) exited {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ForkServerError(
                        f"the fork server (pid {self.proc.pid}) did not answer within "
                        f"{timeout:.0f}s {what}"
                    )
                self._cond.wait(left)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: str,
        err_path: Optional[str] = None,
    ) -> ForkedProcess:
        """Fork ``argv`` (``python -m MODULE ARGS``, see :meth:`can_fork`) with ``env``,
        its stdout appended to ``log_path`` and its stderr to ``err_path`` (default the
        same), in a session of its own."""
        request = {"module": argv[2], "args": list(argv[3:]), "env": dict(env), "log": log_path}
        request["err"] = err_path
        for path in (log_path, err_path or log_path):
            open(path, "ab").close()  # an unwritable log fails here, as Popen's would
        with self._spawn_lock:
            if self.lost:
                raise ForkServerError(f"the fork server (pid {self.proc.pid}) exited")
            self._wait_for(lambda: self._ready, self.ready_timeout, "while importing its libraries")
            self._spawning = list(argv)
            try:
                self._requests.write((json.dumps(request) + "\n").encode())
            except OSError as e:
                raise ForkServerError(f"the fork server (pid {self.proc.pid}) exited: {e}") from e

            def reply():
                return self._replies.pop(0) if self._replies else None

            msg = self._wait_for(reply, self.reply_timeout, f"to fork {' '.join(argv[2:5])}")
            if "error" in msg:
                raise ForkServerError(msg["error"])
            return msg["child"]

    def close(self, timeout: float = 10.0) -> None:
        """End the server (its children are the launcher's to stop first).

        A server still importing has forked nothing and would read the end of its input
        only once done: it is killed at once rather than waited for."""
        try:
            self._requests.close()
        except OSError:
            pass
        with self._cond:
            ready = self._ready
        try:
            self.proc.wait(timeout if ready else 0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _server_env(env: Mapping[str, str]) -> Dict[str, str]:
    env = dict(env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _inherited(env: Mapping[str, str]) -> Dict[str, str]:
    """The part of ``env`` a forked child takes from its server: every variable but the
    child's own (a preloaded library may have read it at import)."""
    return {
        k: v
        for k, v in _server_env(env).items()
        if not (k in _CHILD_ONLY_KEYS or k.startswith(_CHILD_ONLY_PREFIXES))
    }


_shared: Dict[tuple, ForkServer] = {}
_shared_lock = threading.Lock()


def _close_shared() -> None:
    with _shared_lock:
        servers = list(_shared.values())
        _shared.clear()
    for server in servers:
        server.close()


atexit.register(_close_shared)


def _key(env: Mapping[str, str]) -> tuple:
    return (os.getcwd(), tuple(sorted(_inherited(env).items())))


def shared(env: Optional[Mapping[str, str]] = None) -> Optional[ForkServer]:
    """This process's fork server for children with environment ``env`` (default
    ``os.environ``) in the current directory, started on first use; None when
    :func:`enabled` is false.

    A process keeps one server per environment it launches with (a long-lived launcher such
    as a test session changes its own): starting one closes those that have no children.
    """
    if not enabled():
        return None
    env = os.environ if env is None else env
    key = _key(env)
    idle = []
    with _shared_lock:
        server = _shared.get(key)
        if server is None or server.lost:
            for k, other in list(_shared.items()):
                if other.lost or not other._children:
                    idle.append(_shared.pop(k))
            server = _shared[key] = ForkServer(env)
    for other in idle:  # outside the lock: closing waits for the process
        other.close()
    return server


def launch(
    argv: Sequence[str],
    env: Mapping[str, str],
    log_path: str,
    *,
    err_path: Optional[str] = None,
    modules: Optional[frozenset] = None,
    fork: bool = True,
    cwd: Optional[str] = None,
):
    """Start ``argv`` with ``env`` in ``cwd`` (default this process's) and a session of its
    own, stdin from ``/dev/null``, stdout appended to ``log_path`` and stderr to
    ``err_path`` (default the same file).

    It is forked from this process's fork server for ``env`` (:func:`shared`) when ``fork``
    and :meth:`ForkServer.can_fork` allow it (``modules``: the modules whose ``python -m``
    may be forked, default :data:`FORKABLE_MODULES`), else executed by ``subprocess``.  A
    server that fails to fork is not asked again (a warning says so).  Returns a
    :class:`ForkedProcess` or a :class:`subprocess.Popen`: both poll, wait, signal and
    report their exit code alike."""
    if cwd is not None and os.path.realpath(cwd) != os.path.realpath(os.getcwd()):
        fork = False  # the server forks in this process's directory
    server = shared(env) if fork and forkable(argv, modules) else None
    if server is not None and server.can_fork(argv, env, modules):
        try:
            return server.spawn(argv, env, log_path, err_path)
        except ForkServerError as e:
            server.failed = True
            logging.getLogger("forkserver", "system").warning(
                f"{e}; starting these processes with subprocess from now on"
            )
    with contextlib.ExitStack() as files:
        log = files.enter_context(open(log_path, "ab"))
        err = files.enter_context(open(err_path, "ab")) if err_path else subprocess.STDOUT
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=err,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def shared_pids() -> List[int]:
    """The pids of this process's fork servers (they outlive the launches that use them)."""
    return [s.proc.pid for s in list(_shared.values()) if not s.lost]


def prestart() -> None:
    """Start the fork server for ``os.environ`` now, so that its imports overlap the
    caller's own work."""
    shared()


#: realhf's modules a process may have imported when it forks itself into its fork server:
#: its own entry module's packages and this module (none reads the environment at import)
_EARLY_MODULES = frozenset(
    {"realhf", "realhf.base", "realhf.base.logging", "realhf.apps", "realhf.scheduler", __name__}
)


def start_early() -> Optional[ForkServer]:
    """Make this process's fork server (for ``os.environ``) by importing
    :data:`LAUNCHER_IMPORTS` here and forking (the server imports the rest of
    :data:`PRELOAD`): a launcher that imports torch & co. itself then pays for them once,
    not once more in a server of its own (~5 s of CPU per run on a 2-core VM).

    Call it first thing in a launcher's ``__main__``, before realhf's other modules and
    before any thread: the server must hold only third-party modules, as one started by
    ``subprocess`` does.  Where it cannot (forking off, a module or thread too many), it
    does nothing and returns None, and :func:`shared` starts a server when one is needed.
    The server is used if the launch's environment is still this one (see
    :meth:`ForkServer.can_fork`); otherwise it is closed at the first launch, unused.
    """
    early = {m for m in sys.modules if m.split(".")[0] == "realhf"} - _EARLY_MODULES
    if not enabled() or early or threading.active_count() > 1:
        logging.getLogger("forkserver", "system").debug(
            f"no early fork server: modules {sorted(early)}, {threading.active_count()} threads"
        )
        return None
    server = ForkServer(here=True)
    with _shared_lock:
        _shared.setdefault(_key(os.environ), server)
    return server


if __name__ == "__main__":
    main()
