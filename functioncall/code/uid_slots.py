"""Dedicated uids for sandboxed runs, and cleaning up after them.

RLIMIT_NPROC counts processes per uid across the whole machine (and root is
exempt), so every concurrent run gets a uid of its own from a small range
(``REALHF_SANDBOX_UID_BASE``, default 61000; ``REALHF_SANDBOX_SLOTS`` uids,
default 16), held with a file lock so that separate processes share the range
safely. After a run, every process of the uid is killed and what it left in the
world-writable temp directories is removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
from typing import List

logger = logging.getLogger(__name__)

_LOCK_DIR = "/tmp/realhf-sandbox-locks"
#: the world-writable directories (``find / -xdev -type d -perm -0002``, and the tmpfs ones):
#: where a sandbox uid can create files on the host, and where its leftovers are swept
SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


#: the sandbox uids when $REALHF_SANDBOX_UID_BASE / $REALHF_SANDBOX_SLOTS are not set
DEFAULT_UID_BASE, DEFAULT_SLOTS = 61000, 16


def uid_range() -> range:
    """The uids sandboxed runs may take (from the environment, else the defaults)."""
    base = int(os.environ.get("REALHF_SANDBOX_UID_BASE", str(DEFAULT_UID_BASE)))
    slots = int(os.environ.get("REALHF_SANDBOX_SLOTS", str(DEFAULT_SLOTS)))
    if base < 1000 or slots < 1:
        raise ValueError(
            f"REALHF_SANDBOX_UID_BASE={base} / REALHF_SANDBOX_SLOTS={slots}: need a base "
            ">= 1000 of uids no account uses and at least one slot"
        )
    return range(base, base + slots)


class UidSlot:
    """A dedicated uid held (by flock) for the length of one run."""

    def __init__(self, wait_s: float = 120.0):
        uids = uid_range()
        # Root-only lock files: a sandboxed program (which in rlimit mode can
        # write to /tmp) must not be able to open, and so hold, a slot's lock.
        os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
        deadline = time.monotonic() + wait_s
        while True:
            for uid in uids:
                if _uid_has_account(uid):
                    continue  # never borrow a real account's uid
                fd = os.open(
                    os.path.join(_LOCK_DIR, f"uid-{uid}.lock"), os.O_CREAT | os.O_RDWR, 0o600
                )
                # flock, not a pid file: the kernel drops it when the holder
                # dies, so a crashed verifier never leaks a slot.
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.uid, self._fd = uid, fd
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {wait_s:.0f}s for a free sandbox uid in {uids.start}..{uids.stop - 1} "
                    "(all held by other runs); raise REALHF_SANDBOX_SLOTS or run fewer at once"
                )
            time.sleep(0.05)

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


def _uid_has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: kill(-1) sent *as that uid* reaches only its own.

    setpriv switches uid before exec and exits with an error if it cannot, so the
    kill never runs as root (where kill(-1) would end every process on the host).
    """
    if uid < 1000:
        raise ValueError(f"refusing to sweep uid {uid}: not a sandbox uid")
    sweep = "import os\ntry:\n os.kill(-1, 9)\nexcept ProcessLookupError:\n pass"
    # -I -S: no environment variables and no site-packages code take part in a
    # command that runs as the sandbox uid; it also starts faster.
    subprocess.run(
        setpriv(uid) + [os.path.realpath(sys.executable), "-I", "-S", "-c", sweep],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={},
        timeout=10,
        check=False,
    )


def processes_of(uid: int) -> List[str]:
    """Pids (as strings) of the processes of ``uid``, zombies included."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(name)
            except OSError:
                pass  # exited while we looked
    return found


def sweep_uid(uid: int, timeout: float = 10.0) -> None:
    """Kill what is left of ``uid`` and wait until it is gone, zombies included.

    Killed orphans stay zombies until the host's init reaps them, and zombies
    still count against RLIMIT_NPROC: the next run on this uid must not inherit
    them. Usually nothing is left (bwrap's pid namespace dies with the run) and
    this costs one scan of /proc. The timeout is generous because reaping by
    init is slow on a loaded machine (3 s was seen to fall short at load 8).
    """
    if not processes_of(uid):
        return
    kill_uid(uid)
    deadline = time.monotonic() + timeout
    while True:
        left = processes_of(uid)
        if not left:
            return
        if time.monotonic() > deadline:
            logger.warning(
                "sandbox uid %d still has %d process(es) after %.0fs: %s",
                uid,
                len(left),
                timeout,
                ",".join(left[:8]),
            )
            return
        time.sleep(0.05)


def remove_files_of(uid: int) -> None:
    """Delete what ``uid`` left in world-writable directories (rlimit mode has no
    private /tmp)."""
    # This runs as root over directories the program could write to, so it
    # must never follow a link it planted: stat/is_dir look at the entry
    # itself, unlink removes a symlink and not its target, and rmtree (the
    # fd-based, symlink-attack-resistant version on Linux) removes links
    # inside a directory instead of descending through them.
    for d in SHARED_WRITABLE_DIRS:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                pass


def setpriv(uid: int) -> List[str]:
    """Command prefix that execs as ``uid`` with no groups, no capabilities, no new
    privileges."""
    # --clear-groups drops root's supplementary groups (files readable by
    # group 0 stay closed); emptying the inheritable and bounding sets means no
    # capability can come back through file capabilities of an exec'd binary;
    # --no-new-privs makes setuid programs (su, sudo, mount) run unprivileged.
    return [
        "/usr/bin/setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]
