"""etcd v3 backend, for experiments spanning several machines.

Uses ``pyetcd`` (etcd-sdk-python, the maintained fork of the ``etcd3``
client with the same API).  Each TTL'd entry gets its own lease, refreshed by
the owner's keepalive thread every ttl/3; etcd deletes the key when the lease
runs out.  Note that etcd rounds leases up to its minimum TTL (a few seconds
with default election settings).

Ownership tokens are the key's ``mod_revision`` right after our write, so
``reset`` never deletes an entry another process has replaced since.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.base.name_resolve._repository import (
    NameEntryExistsError,
    NameRecordRepository,
)

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 2379
#: ms between grpc's tries to reconnect to an etcd that went away (see __init__)
RECONNECT_BACKOFF_MS = 500


def parse_address(address: str) -> Tuple[str, int]:
    """``"host:port"`` (optionally ``etcd3://`` / ``http://`` prefixed) → (host, port).

    Raises ValueError naming the address and the expected form.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"etcd address must be 'host:port', got {address!r}.")
    rest = address.strip()
    for scheme in ("etcd3://", "etcd://", "http://"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
    rest = rest.rstrip("/")
    host, sep, port_s = rest.rpartition(":")
    if not sep or not host or not port_s.isdigit() or "/" in host or " " in host:
        raise ValueError(
            f"Malformed etcd address {address!r}: expected 'host:port', e.g. "
            "'127.0.0.1:2379' (or 'etcd3://127.0.0.1:2379')."
        )
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"etcd address {address!r} has port {port} outside 1..65535.")
    return host, port


def _check_host_port(host, port) -> Tuple[str, int]:
    if not isinstance(host, str) or not host or ":" in host or "/" in host or " " in host:
        raise ValueError(
            f"Malformed etcd host {host!r}: give a host name or IPv4 address "
            "such as '127.0.0.1' (the port goes in port=)."
        )
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"Malformed etcd port {port!r}: need an int in 1..65535.")
    return host, port


class Etcd3NameRecordRepository(NameRecordRepository):
    """Name-resolve store in an etcd v3 cluster (one endpoint)."""

    backend = "etcd3"

    def __init__(
        self,
        host: Optional[str] = None,
        port: Optional[int] = None,
        address: Optional[str] = None,
        timeout: float = 5.0,
    ) -> None:
        """Connect to etcd at ``host:port`` (or ``address='host:port'``).

        Args:
            timeout: seconds for every RPC, including the connection probe
                done here; an unreachable server fails within about this long.

        Raises:
            ValueError: malformed address.
            ConnectionError: etcd does not answer at host:port.
        """
        super().__init__()
        if address is not None:
            if host is not None or port is not None:
                raise ValueError("Give either address= or host=/port= for etcd3, not both.")
            host, port = parse_address(address)
        host, port = _check_host_port(
            DEFAULT_HOST if host is None else host, DEFAULT_PORT if port is None else port
        )
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"etcd3 timeout must be positive seconds, got {timeout!r}.")
        self.host, self.port, self.timeout = host, port, float(timeout)
        try:  # imported lazily: the client pulls in grpc, and is an extra
            import pyetcd
        except ImportError as e:
            raise ImportError(
                "name_resolve=etcd3 needs the etcd client: pip install 'realhf[etcd]' "
                f"(the etcd-sdk-python package) — {e}"
            ) from e

        self._etcd_exceptions = pyetcd.Etcd3Exception
        from pyetcd import exceptions as etcd_errors

        # etcd down, restarting or unreachable: worth waiting out (_repository._retrying).
        self.transient_errors = (
            etcd_errors.ConnectionFailedError,
            etcd_errors.ConnectionTimeoutError,
            etcd_errors.NoServerAvailableError,
        )
        # One endpoint whose "failed" mark expires at once (time_retry=0): the
        # library default benches a failed endpoint for 300 s, which would
        # turn one network blip into five minutes of errors.
        #
        # grpc's own reconnect backoff (1 s, x1.6 per failed try, up to 120 s) grows
        # while etcd is down: after a 10 s restart it tried again only 3-7 s after etcd
        # was back, long enough for a status key's lease (6 s TTL, which a restarted
        # etcd extends by one TTL) to run out.  A try every 0.5 s at most is one
        # refused connect per process while etcd is down, and nothing once it is up.
        backoff = [
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ]
        endpoint = pyetcd.Endpoint(host, port, secure=False, time_retry=0.0, opts=backoff)
        self._client = pyetcd.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=self.timeout)
        self._leases: Dict[str, object] = {}  # key -> pyetcd Lease we own
        try:
            self._client.status()
        except Exception as e:
            self._client.close()
            # grpc errors stringify to a multi-line dump; details() is the gist.
            detail = e.details() if callable(getattr(e, "details", None)) else str(e)
            raise ConnectionError(
                f"Cannot reach etcd at {host}:{port} within {self.timeout:g}s "
                f"({type(e).__name__}: {detail}). Start etcd there or point "
                "REALHF_NAME_RESOLVE / reconfigure('etcd3', host=, port=) at a "
                "running server."
            ) from e

    def __repr__(self) -> str:
        return f"Etcd3NameRecordRepository({self.host}:{self.port})"

    def _where(self) -> str:
        return f"etcd3 backend at {self.host}:{self.port}"

    # ---- primitives --------------------------------------------------------

    def _put(self, key: str, value: str, ttl: Optional[float], replace: bool) -> object:
        c = self._client
        # Leases are whole seconds; rounding up keeps e.g. ttl=0.5 from
        # becoming a zero-second lease.
        lease = c.lease(int(math.ceil(ttl))) if ttl is not None else None
        put = c.transactions.put(key, value, lease=lease)
        # Reading back inside the same transaction gives the mod_revision of
        # exactly our write, even if another writer replaces the key right after.
        get = c.transactions.get(key)
        if replace:
            ok, responses = c.transaction(compare=[], success=[put, get], failure=[])
        else:
            # create_revision == 0 is etcd's "key does not exist"; checked and
            # written in one transaction, so concurrent adds have one winner.
            ok, responses = c.transaction(
                compare=[c.transactions.create(key) == 0],
                success=[put, get],
                failure=[],
            )
        if not ok:
            # The lease had to exist before the transaction; do not leave it
            # on the server until its TTL runs out.
            if lease is not None:
                lease.revoke()
            raise NameEntryExistsError(
                f"name-resolve key {key!r} already exists ({self._where()}); pass "
                "replace=True to overwrite."
            )
        ((_value, meta),) = responses[-1]
        old = self._leases.pop(key, None)
        if old is not None:  # our own earlier entry under this key
            self._revoke_quietly(old)
        if lease is not None:
            self._leases[key] = lease
        return meta.mod_revision

    def _read(self, key: str) -> Optional[str]:
        value, _ = self._client.get(key)
        return None if value is None else value.decode()

    def _items(self, prefix: str) -> List[Tuple[str, str]]:
        # etcd prefixes are string-wise: "a/b/" keeps "a/bc" out, and the
        # key "a/b" itself is read separately.
        out = [(m.key.decode(), v.decode()) for v, m in self._client.get_prefix(prefix + "/")]
        own = self._read(prefix)
        if own is not None:
            out.append((prefix, own))
        return out

    def _remove(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            n += bool(self._client.delete(key))
            lease = self._leases.pop(key, None)
            if lease is not None:
                self._revoke_quietly(lease)
        return n

    def _clear(self, prefix: str) -> None:
        self._client.delete_prefix(prefix + "/")
        self._client.delete(prefix)
        for key in [k for k in self._leases if k == prefix or k.startswith(prefix + "/")]:
            self._revoke_quietly(self._leases.pop(key))

    def _remove_if_owned(self, key: str, token: object) -> None:
        c = self._client
        # Compare-and-delete in one transaction; a get followed by a delete
        # could remove an entry another process wrote in between.
        c.transaction(
            compare=[c.transactions.mod(key) == int(token)],
            success=[c.transactions.delete(key)],
            failure=[],
        )
        lease = self._leases.pop(key, None)
        if lease is not None:
            self._revoke_quietly(lease)

    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        lease = self._leases.get(key)
        if lease is None:
            return False
        responses = lease.refresh()
        # TTL <= 0 in the reply: the lease had already expired (key gone).
        if not responses or responses[0].TTL <= 0:
            self._leases.pop(key, None)
            return False
        _value, meta = self._client.get(key)
        return meta is not None and meta.mod_revision == token

    def _revoke_quietly(self, lease) -> None:
        try:
            lease.revoke()
        except self._etcd_exceptions:
            pass  # already expired, or server gone: the lease dies anyway

    def _close_backend(self) -> None:
        self._client.close()
