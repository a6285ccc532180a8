"""The run's secret: who may talk to a run's sockets.

Every process of a run shares one 32-byte secret.  With it:

* every ZMQ message carries an HMAC-SHA256 of its body (and of the kind of channel it
  travels on, so a message captured on one channel cannot be replayed on another); a
  receiver checks the MAC *before* unpickling and drops anything else (:func:`send` /
  :func:`recv`), counting the drops and logging each sender address once;
* HTTP control routes want ``Authorization: Bearer <token>`` where the token
  (:func:`http_token`) is derived from the secret, so the secret itself never travels.

Where the secret comes from, first match wins:

1. ``$REALHF_SECRET_FILE``: a file of the run directory, mode 0600, written by the launcher
   (:func:`issue`); launchers hand workers only this path, so the secret is never in a
   config, a log, the name-resolve store or a process listing;
2. ``$REALHF_RUN_SECRET`` (hex): for processes started by hand (tests, a standalone server);
3. otherwise this process makes one and puts it in ``$REALHF_RUN_SECRET``, so the processes
   it starts itself share it: a process that starts a run without a launcher is its root.

A process that starts with another run's secret cannot talk to this run: that is the point.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from typing import Dict, Optional, Sequence, Set, Tuple

import zmq

from realhf.base import logging

logger = logging.getLogger("auth")

__all__ = [
    "SECRET_FILE_ENV",
    "SECRET_ENV",
    "MAC_BYTES",
    "run_secret",
    "issue",
    "child_env",
    "http_token",
    "bearer_ok",
    "mac",
    "send",
    "recv",
    "rejected",
    "reset",
]

SECRET_FILE_ENV = "REALHF_SECRET_FILE"
SECRET_ENV = "REALHF_RUN_SECRET"
SECRET_FILE_NAME = "run_secret"
MAC_BYTES = 32

_lock = threading.Lock()
# The secret, read once per process (a worker's environment never changes; tests that
# switch it call reset()).
_secret: Optional[bytes] = None
# One key per channel kind, derived from the secret: a MAC is then one C call over the body.
_kind_keys: Dict[bytes, bytes] = {}


def reset() -> None:
    """Forget the secret read so far (the next use reads the environment again)."""
    global _secret
    with _lock:
        _secret = None
        _kind_keys.clear()


class SecretError(RuntimeError):
    """The run's secret cannot be read (missing file, loose permissions, bad hex)."""


def _read_file(path: str) -> bytes:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError as e:
        raise SecretError(
            f"${SECRET_FILE_ENV} names {path!r}, which cannot be read ({e.strerror}); the "
            "launcher writes it into the run directory: start workers through the launcher, "
            f"or unset ${SECRET_FILE_ENV}."
        ) from e
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"The run's secret {path!r} is readable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}); it must be 0600: `chmod 600 {path}`."
        )
    return _from_hex(raw.decode(errors="replace"), path)


def _from_hex(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < 16:
        raise SecretError(
            f"The run's secret in {where} is not hex of at least 16 bytes; make one with "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`."
        )
    return key


def run_secret() -> bytes:
    """This run's secret (see the module docstring for where it comes from)."""
    global _secret
    key = _secret
    if key is not None:
        return key
    with _lock:
        if _secret is not None:
            return _secret
        path, env = os.environ.get(SECRET_FILE_ENV), os.environ.get(SECRET_ENV)
        if path:
            key = _read_file(path)
        elif env:
            key = _from_hex(env, f"${SECRET_ENV}")
        else:
            key = secrets.token_bytes(32)
            os.environ[SECRET_ENV] = key.hex()
        _kind_keys.clear()
        _secret = key
        return key


def child_env() -> Dict[str, str]:
    """The variables a process this one starts needs to share its secret (a secret made
    now if there was none: children started before the first message would otherwise make
    their own)."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return {SECRET_FILE_ENV: path}
    return {SECRET_ENV: run_secret().hex()}


def issue(run_dir: str) -> Dict[str, str]:
    """Make a fresh secret for a launch: a 0600 file in ``run_dir``; returns the workers' env.

    A fresh secret per launch means processes of an earlier launch of the same trial (still
    shutting down, or a stale worker on another node) cannot talk to this one.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(os.path.abspath(run_dir), SECRET_FILE_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may not clear group/other bits of an old file
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return {SECRET_FILE_ENV: path}


def http_token() -> str:
    """The bearer token of this run's HTTP control routes (derived; not the secret itself)."""
    return hmac.new(run_secret(), b"realhf-http-token", hashlib.sha256).hexdigest()


def bearer_ok(authorization: Optional[str], token: Optional[str] = None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time)."""
    if not authorization:
        return False
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), (token or http_token()).encode())


# ---- ZMQ messages -----------------------------------------------------------------


def mac(kind: bytes, body) -> bytes:
    """HMAC-SHA256 of ``body`` under the key of channel ``kind`` (``HMAC(secret, kind)``), so
    a message signed for one channel does not verify on another."""
    key = _kind_keys.get(kind)
    if key is None:
        key = _kind_keys[kind] = hmac.digest(run_secret(), b"realhf-zmq\0" + kind, "sha256")
    return hmac.digest(key, body, "sha256")


#: Bodies up to this size travel in one frame with their MAC; larger ones in a frame of
#: their own, sent without a copy.  (A second frame costs ~10 µs; copying 64 KB about as much.)
ONE_FRAME_MAX = 64 * 1024


def send(sock, kind: bytes, body: bytes, flags: int = 0, prefix: Sequence[bytes] = ()) -> None:
    """Send ``body`` with its MAC on a ZMQ socket, after ``prefix`` frames (e.g. a ROUTER's
    identity): ``[*prefix, MAC + body]``, or ``[*prefix, MAC, body]`` for a large body."""
    m = mac(kind, body)
    # Frame by frame: pyzmq's send_multipart costs more than the MAC itself.
    for p in prefix:
        sock.send(p, flags | zmq.SNDMORE)
    if len(body) <= ONE_FRAME_MAX:
        sock.send(m + body, flags)
    else:
        sock.send(m, flags | zmq.SNDMORE)
        sock.send(body, flags, copy=False)


# Drops by channel kind, and the senders already logged (each logged once).
_rejected: Dict[str, int] = {}
_logged: Set[Tuple[str, str]] = set()


def rejected() -> Dict[str, int]:
    """How many messages each channel kind dropped for a missing or wrong MAC."""
    with _lock:
        return dict(_rejected)


def recv(sock, kind: bytes, where: str, n_prefix: int = 0):
    """Receive one message and check its MAC: ``(prefix frames, body)``, or None if dropped.

    ``body`` is a memoryview of the received frame (no copy; ``pickle.loads`` takes it).  A
    dropped message is counted, and its sender's address (ZMQ's ``Peer-Address``) logged the
    first time that sender sends one; a dropped body is never unpickled.  The caller has
    polled already: this reads what is there.
    """
    frames = [sock.recv(copy=False)]
    while frames[-1].more:  # (not recv_multipart: see send)
        frames.append(sock.recv(copy=False))
    body = got = None
    if len(frames) == n_prefix + 1:  # MAC + body in one frame
        buf = frames[-1].buffer
        if len(buf) >= MAC_BYTES:
            got, body = buf[:MAC_BYTES], buf[MAC_BYTES:]
    elif len(frames) == n_prefix + 2:  # MAC, then a large body
        got, body = frames[-2].buffer, frames[-1].buffer
    if body is not None and hmac.compare_digest(got, mac(kind, body)):
        return [f.bytes for f in frames[:n_prefix]], body
    try:
        peer = frames[-1].get("Peer-Address")
    except Exception:  # noqa: BLE001 — not a TCP transport, or an old libzmq
        peer = "unknown"
    k = kind.decode()
    with _lock:
        _rejected[k] = _rejected.get(k, 0) + 1
        first = (k, peer) not in _logged
        _logged.add((k, peer))
    if first:
        logger.warning(
            f"{where}: dropped a message from {peer} without this run's MAC ({len(frames)} "
            "frames); further drops from it are counted, not logged. A process of another "
            "run, or of an earlier launch of this one, may be sending here; processes started "
            f"by hand share a run's secret through ${SECRET_ENV} or ${SECRET_FILE_ENV}."
        )
    return None
