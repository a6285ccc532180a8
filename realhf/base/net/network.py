"""Ports and addresses for the sockets workers open.

``find_free_port`` binds a candidate port to prove it is free and remembers
every port it has handed out in this process, so two callers in one process
(e.g. a ZMQ stream and a torch rendezvous) never get the same port even though
neither has bound it yet.  Another process may still take a port between the
check and its use; callers that bind immediately keep that window small.

``gethostip`` returns this host's IP as other hosts would see it, falling back
to ``127.0.0.1`` where the host name does not resolve (containers, sandboxes).
``REALHF_HOST_IP`` overrides it: the local launcher sets it to ``127.0.0.1``, so every
socket of a single-machine run listens on loopback only; ``interface_of`` names the network
interface holding an address (gloo binds by interface name).
"""

from __future__ import annotations

import os
import random
import socket
import threading
from typing import Iterable, List, Optional, Set

__all__ = [
    "find_free_port",
    "find_multiple_free_ports",
    "gethostip",
    "gethostname",
    "interface_of",
    "listening_socket",
]

_lock = threading.Lock()
_handed_out: Set[int] = set()
# Below the Linux ephemeral range (32768+) so OS-assigned client ports do not
# collide with ports we choose for listeners.
DEFAULT_LOW = 10000
DEFAULT_HIGH = 32000


def _bind_ok(port: int, host: str) -> bool:
    """Whether a TCP socket can bind ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # No SO_REUSEADDR: a port in TIME_WAIT counts as taken, as it would
        # for a server that binds without the flag.
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_port(
    low: int = DEFAULT_LOW,
    high: int = DEFAULT_HIGH,
    exclude: Optional[Iterable[int]] = None,
    host: str = "",
) -> int:
    """Return a TCP port in ``[low, high)`` that binds now and was not handed out before.

    Args:
        low, high: the range to draw from.
        exclude: ports never to return (in addition to those already handed out).
        host: interface to test the bind on; "" means all interfaces.

    Raises:
        ValueError: for an empty or out-of-range interval.
        RuntimeError: when no port in the range is free.
    """
    if not (0 < low < high <= 65536):
        raise ValueError(f"Port range [{low}, {high}) is invalid; need 0 < low < high <= 65536.")
    excluded = set(exclude or ())
    candidates = list(range(low, high))
    random.shuffle(candidates)
    with _lock:
        for port in candidates:
            if port in excluded or port in _handed_out:
                continue
            if _bind_ok(port, host):
                _handed_out.add(port)
                return port
    raise RuntimeError(
        f"No free TCP port in [{low}, {high}) (excluding {len(excluded)} given ports "
        f"and {len(_handed_out)} already handed out in this process)."
    )


def find_multiple_free_ports(
    n: int,
    low: int = DEFAULT_LOW,
    high: int = DEFAULT_HIGH,
    exclude: Optional[Iterable[int]] = None,
    host: str = "",
) -> List[int]:
    """Return ``n`` distinct free ports (see :func:`find_free_port`)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}.")
    taken = set(exclude or ())
    ports = []
    for _ in range(n):
        p = find_free_port(low, high, exclude=taken, host=host)
        taken.add(p)
        ports.append(p)
    return ports


def gethostname() -> str:
    """This host's name (``socket.gethostname()``)."""
    return socket.gethostname()


def gethostip() -> str:
    """This host's IPv4 address; ``127.0.0.1`` when it cannot be determined.

    ``$REALHF_HOST_IP`` wins when set.
    """
    env = os.environ.get("REALHF_HOST_IP")
    if env:
        return env
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
    # Some /etc/hosts map the host name to 127.0.1.1, which is loopback too
    # but not reachable by its peers; normalise it.
    if ip.startswith("127."):
        return "127.0.0.1"
    return ip


def interface_of(ip: str) -> Optional[str]:
    """The name of the network interface holding IPv4 ``ip`` (``lo`` for 127.x), or None."""
    import psutil

    if ip.startswith("127."):
        ip = "127.0.0.1"
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def listening_socket(host: str, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on ``host`` at a port the kernel picks (no window in which
    another process could take the port between choosing and binding it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s
