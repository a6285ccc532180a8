"""Run untrusted Python programs with the host out of reach.

Every run happens in a fresh subprocess, as a dedicated unprivileged uid, with
resource limits (CPU seconds, address space, file size, number of processes,
open files, no core dumps), a wall-clock timeout, a fresh writable directory and
a minimal environment. Two modes, chosen once per process and logged:

* ``bwrap`` (preferred): bubblewrap puts the program in new mount, pid, network,
  ipc and uts namespaces. The sandbox sees read-only ``/usr`` and the Python
  installation, the program at ``/code`` (read-only), and size-limited tmpfs at
  ``/sandbox`` (its working directory) and ``/tmp``: nothing of the host's files,
  no network interface but a down loopback. bwrap runs as root (it must, to read
  a Python under ``/root``) and execs ``setpriv`` to drop to the sandbox uid with
  no capabilities before the program starts.
* ``rlimit`` (fallback when bwrap is missing or cannot create namespaces): the
  same uid drop and limits and a fresh working directory on the host. Weaker:
  world-readable host files are readable, and world-writable directories
  (``/tmp``, ``/dev/shm``) writable, though what the uid leaves there is removed
  after the run.

Sockets: the test-case runner (:mod:`functioncall.code.runner`) installs a
seccomp filter that makes socket(2) fail before the program starts, in both
modes; in rlimit mode that is the only network defence, so code run through
:func:`run_python` without the runner has network there.

Each run takes a dedicated uid (:mod:`functioncall.code.uid_slots`): root
ignores RLIMIT_NPROC, so only an unprivileged uid of its own makes the process
limit hold; after the run all its processes are killed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

from functioncall.code.uid_slots import (
    UidSlot,
    remove_files_of,
    setpriv,
    sweep_uid,
)

logger = logging.getLogger(__name__)

MODES = ("bwrap", "rlimit")


@dataclasses.dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Worst-case memory of one run is ``max_processes × memory_mb`` (RLIMIT_AS is
    per process); keep the product well under the host's memory.
    """

    wall_timeout_s: float = 6.0
    memory_mb: int = 1024
    max_processes: int = 8
    max_file_mb: int = 16
    max_open_files: int = 256
    tmpfs_mb: int = 64

    def __post_init__(self):
        checks = {
            "wall_timeout_s": (self.wall_timeout_s, 0.1, 3600),
            "memory_mb": (self.memory_mb, 64, 1 << 20),
            "max_processes": (self.max_processes, 1, 4096),
            "max_file_mb": (self.max_file_mb, 1, 1 << 20),
            "max_open_files": (self.max_open_files, 16, 1 << 20),
            "tmpfs_mb": (self.tmpfs_mb, 1, 1 << 20),
        }
        for name, (value, lo, hi) in checks.items():
            if not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(
                    f"SandboxLimits.{name}={value!r} is out of range; use a number in [{lo}, {hi}]"
                )

    @property
    def cpu_s(self) -> int:
        """CPU-seconds limit: the wall timeout rounded up, plus one."""
        # A backstop above the wall timeout: a busy single-process program is
        # stopped by the wall clock first and reported as timed_out, instead
        # of dying by SIGXCPU/SIGKILL with an unclear return code.
        return int(math.ceil(self.wall_timeout_s)) + 1


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What a sandboxed run did. ``returncode`` is negative for a signal (-9: killed)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    mode: str
    wall_s: float
    uid: int

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# -------------------------------------------------------------------- commands


def _python_roots() -> List[str]:
    """Directories holding the interpreter and its stdlib, to bind read-only."""
    exe_root = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    roots = []
    for p in (sys.base_prefix, sys.prefix, exe_root):
        p = os.path.realpath(p)
        if p not in roots and not (p == "/usr" or p.startswith("/usr/")):
            roots.append(p)
    return roots


def _prlimit_prefix(limits: SandboxLimits) -> List[str]:
    # prlimit sets soft and hard limits alike and runs first, as root, so the
    # limits are in place before any sandboxed code runs and are inherited
    # across bwrap and setpriv.  Once the uid is dropped the program can lower
    # them but never raise them again.  RLIMIT_NPROC is ignored while root and
    # takes effect with the uid switch (see the module docstring).
    mb = 1 << 20
    return [
        "/usr/bin/prlimit",
        f"--cpu={limits.cpu_s}",
        f"--as={limits.memory_mb * mb}",
        f"--fsize={limits.max_file_mb * mb}",
        f"--nproc={limits.max_processes}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
        "--",
    ]


def _bwrap_command(uid: int, code_dir: str, limits: SandboxLimits) -> List[str]:
    tmpfs = str(limits.tmpfs_mb << 20)
    cmd = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        # -try: kernels without cgroup namespaces still get the other ones.
        "--unshare-cgroup-try",
        # The verifier dying must not leave the sandbox running unsupervised.
        "--die-with-parent",
        # setsid(): no controlling terminal, so no TIOCSTI input injection
        # into the terminal the verifier was started from.
        "--new-session",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    for root in _python_roots():
        cmd += ["--ro-bind", root, root]
    # The tmpfs mounts are created by root but written by the sandbox uid,
    # hence the sticky world-writable 1777; each is size-capped so a program
    # cannot fill the host's memory through them.  --clearenv keeps every host
    # variable (tokens, credentials, proxy settings) out of the sandbox.
    cmd += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        tmpfs,
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--size",
        tmpfs,
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--size",
        tmpfs,
        "--perms",
        "1777",
        "--tmpfs",
        "/sandbox",
        "--ro-bind",
        code_dir,
        "/code",
        "--chdir",
        "/sandbox",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/sandbox",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "TMPDIR",
        "/tmp",
        # bwrap drops every capability by default; setpriv needs these two to switch uid,
        # and drops them (and the bounding set) before the program runs.
        "--cap-add",
        "CAP_SETUID,CAP_SETGID",
        "--",
    ]
    return _prlimit_prefix(limits) + cmd + setpriv(uid)


def _rlimit_command(uid: int, limits: SandboxLimits) -> List[str]:
    return _prlimit_prefix(limits) + setpriv(uid)


# ------------------------------------------------------------------------- modes

_mode_lock = threading.Lock()
_mode: Optional[str] = None


def sandbox_mode() -> str:
    """The mode this process runs sandboxes in, decided (and logged) on first call.

    ``REALHF_SANDBOX_MODE`` = ``auto`` (default), ``bwrap`` or ``rlimit`` forces it;
    forcing ``bwrap`` where it cannot work is an error, not a silent fallback.
    """
    global _mode
    with _mode_lock:
        if _mode is not None:
            return _mode
        # Decided once under the lock: verify_batch calls this from many
        # threads, and the bwrap probe should run (and be logged) only once.
        if os.geteuid() != 0:
            raise RuntimeError(
                "the code sandbox must start as root to run programs as a dedicated uid "
                "(RLIMIT_NPROC is what stops a fork bomb, and it counts per uid); run the "
                "verifier as root, e.g. inside the project's container"
            )
        wanted = os.environ.get("REALHF_SANDBOX_MODE", "auto")
        if wanted not in ("auto",) + MODES:
            raise ValueError(f"REALHF_SANDBOX_MODE={wanted!r}; use one of auto, bwrap, rlimit")
        if wanted == "rlimit":
            _mode = "rlimit"
            logger.warning("code sandbox mode: rlimit (forced by REALHF_SANDBOX_MODE)")
            return _mode
        reason = _probe_bwrap()
        if reason is None:
            _mode = "bwrap"
            logger.info(
                "code sandbox mode: bwrap "
                "(pid/net/mount/ipc/uts namespaces, dedicated uid, rlimits)"
            )
        elif wanted == "bwrap":
            raise RuntimeError(f"REALHF_SANDBOX_MODE=bwrap but bwrap cannot run: {reason}")
        else:
            _mode = "rlimit"
            logger.warning(
                "code sandbox mode: rlimit — bwrap unusable (%s); programs run as a dedicated "
                "uid with rlimits and Python-level socket blocking, without namespaces",
                reason,
            )
        return _mode


def _probe_bwrap() -> Optional[str]:
    """None if a bwrap sandbox starts and runs Python here, else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    # A generous timeout: the probe is the first sandbox start of the process
    # and may read the whole interpreter from a cold disk cache.
    try:
        res = _run(["-c", "pass"], {}, b"", SandboxLimits(wall_timeout_s=20), "bwrap")
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if res.returncode != 0:
        return f"exit code {res.returncode}: {res.stderr.strip()[-300:]}"
    return None


# --------------------------------------------------------------------------- run


def run_python(
    args: List[str],
    files: Dict[str, str],
    stdin: bytes = b"",
    limits: Optional[SandboxLimits] = None,
    mode: Optional[str] = None,
) -> RunResult:
    """Run ``python -I <args>`` in a sandbox, with ``files`` placed in the code directory.

    In ``args``, ``{code}`` stands for the code directory (``/code`` under bwrap,
    a host path in rlimit mode). A run that overstays ``limits.wall_timeout_s``
    is killed (all its processes) and reported with ``timed_out=True``. ``mode``
    defaults to :func:`sandbox_mode`; pass ``"rlimit"`` to test the fallback.
    """
    default = sandbox_mode()  # also checks that we may switch uids
    if mode is not None and mode not in MODES:
        raise ValueError(f"run_python: mode={mode!r}; use one of {MODES} or None")
    return _run(args, files, stdin, limits or SandboxLimits(), mode or default)


def _run(args, files, stdin, limits, mode) -> RunResult:
    slot = UidSlot()
    host_dir = tempfile.mkdtemp(prefix="realhf-sbx-")
    try:
        sweep_uid(slot.uid)  # leftovers of a verifier that died mid-run
        os.chmod(host_dir, 0o711)  # rlimit mode: others may reach code/ and work/, not list
        code_dir = os.path.join(host_dir, "code")
        os.mkdir(code_dir, 0o755)
        # Root-owned 0755/0644: the sandbox uid can read the program and the
        # runner but not change them (under bwrap /code is read-only anyway).
        for name, content in files.items():
            path = os.path.join(code_dir, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
            os.chmod(path, 0o644)
        if mode == "bwrap":
            cmd = _bwrap_command(slot.uid, code_dir, limits)
            sandbox_code, cwd, env = "/code", host_dir, None
        else:
            cmd = _rlimit_command(slot.uid, limits)
            sandbox_code = code_dir
            cwd = os.path.join(host_dir, "work")
            os.mkdir(cwd, 0o700)
            os.chown(cwd, slot.uid, slot.uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "TMPDIR": cwd}
        argv = [a.replace("{code}", sandbox_code) for a in args]
        # -I: no PYTHON* variables, no user site-packages, and neither the
        # script's directory nor the cwd on sys.path, so files the program
        # writes cannot shadow modules the runner imports.
        cmd = cmd + [os.path.realpath(sys.executable), "-I"] + argv
        return _execute(cmd, cwd, env, stdin, limits, mode, slot.uid, host_dir)
    finally:
        try:
            sweep_uid(slot.uid)
            if mode == "rlimit":
                remove_files_of(slot.uid)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
            slot.release()


def _execute(cmd, cwd, env, stdin, limits, mode, uid, host_dir) -> RunResult:
    # Output goes to files, not pipes: RLIMIT_FSIZE then caps how much a program
    # can print, and no reader thread can be flooded.
    io_dir = os.path.join(host_dir, "io")
    os.mkdir(io_dir, 0o700)  # root only: the program gets these as open fds, not paths
    paths = {k: os.path.join(io_dir, k) for k in ("stdin", "stdout", "stderr")}
    with open(paths["stdin"], "wb") as f:
        f.write(stdin)
    t0 = time.monotonic()
    timed_out = False
    with (
        open(paths["stdin"], "rb") as fin,
        open(paths["stdout"], "wb") as fout,
        open(paths["stderr"], "wb") as ferr,
    ):
        proc = subprocess.Popen(
            cmd,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            cwd=cwd,
            env=env or {},
            close_fds=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limits.wall_timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Kill the group even after a clean exit: the program may have left
            # children behind.  Processes that left the group (setsid, or the
            # session bwrap creates) are caught by sweep_uid in _run, which
            # kills everything the sandbox uid still owns.
            try:
                os.killpg(proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=30)
    wall = time.monotonic() - t0
    cap = limits.max_file_mb << 20

    def read(p):
        with open(p, "rb") as f:
            return f.read(cap).decode("utf-8", errors="replace")

    return RunResult(
        returncode=proc.returncode,
        stdout=read(paths["stdout"]),
        stderr=read(paths["stderr"]),
        timed_out=timed_out,
        mode=mode,
        wall_s=wall,
        uid=uid,
    )
