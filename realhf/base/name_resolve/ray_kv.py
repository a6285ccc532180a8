"""Ray backend: the key-value store inside a Ray cluster's GCS.

For experiments launched on Ray (``mode=ray``): the cluster already runs a
store every node can reach, so no etcd is needed.  Spec ``ray://HOST:PORT``
where ``HOST:PORT`` is the cluster's GCS address (what ``ray start --head``
prints, port 6379 by default) — not a Ray Client ``ray://...:10001`` address.

Processes talk to the GCS directly through Ray's ``GcsClient``; they do not
become Ray drivers (no ``ray.init``), so a worker subprocess pays about a
millisecond per call and nothing more.  Entries live in their own namespace
(:data:`NAMESPACE`) as JSON::

    {"value": "...", "expires_at": 1732250000.0 or null, "owner": "<uuid>"}

* The GCS store offers atomic put-if-absent and nothing like a transaction,
  so check-then-write sequences (``add`` over an expired entry, ``replace``,
  keepalive refresh, ``delete``) take a per-key lock: a put-if-absent of the
  key in :data:`LOCK_NAMESPACE`.  A lock older than :data:`LOCK_TTL` (its
  holder died between two calls) is broken.  A plain ``add`` of an absent key
  is a single put-if-absent, so concurrent adds have exactly one winner.
* TTL: ``expires_at`` is the writer's wall-clock time; the owner rewrites it
  every ttl/3 and readers treat an expired entry as absent.  Nodes need clocks
  in step (NTP) to well within the TTLs used (seconds).
* Clusters with token authentication: the client reads the token the way Ray
  does (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``);
  processes started by Ray actors inherit it.

Like the etcd client, the GCS client is not fork-safe: build the repository
after forking.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from typing import Iterator, List, Optional, Sequence, Tuple

from realhf.base.name_resolve._repository import (
    NameEntryExistsError,
    NameRecordRepository,
)

NAMESPACE = b"realhf_name_resolve"
LOCK_NAMESPACE = b"realhf_name_resolve_locks"
#: seconds after which a per-key lock counts as abandoned (held for two RPCs normally)
LOCK_TTL = 10.0
#: seconds a caller waits for a per-key lock before failing
LOCK_WAIT = 30.0
DEFAULT_PORT = 6379


def parse_address(address: str) -> Tuple[str, int]:
    """``"host:port"`` (optionally ``ray://`` prefixed) → (host, port).

    Raises ValueError naming the address and the expected form.
    """
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"Ray GCS address must be 'host:port', got {address!r}.")
    rest = address.strip()
    if rest.startswith("ray://"):
        rest = rest[len("ray://") :]
    rest = rest.rstrip("/")
    host, sep, port_s = rest.rpartition(":")
    if not sep or not host or not port_s.isdigit() or "/" in host or " " in host:
        raise ValueError(
            f"Malformed Ray GCS address {address!r}: expected 'host:port', e.g. "
            "'ray://10.0.0.1:6379' (the address `ray start --head` prints)."
        )
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"Ray GCS address {address!r} has port {port} outside 1..65535.")
    return host, port


def _probe(host: str, port: int, timeout: float) -> None:
    """Fail within ``timeout`` when nothing listens at host:port.

    Ray's own client retries an unreachable GCS for tens of seconds before it
    gives up; a TCP connect answers in one round trip.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(
            f"Cannot reach the Ray GCS at {host}:{port} within {timeout:g}s ({e}). Start "
            "the cluster (`ray start --head`) or point REALHF_NAME_RESOLVE / "
            "reconfigure('ray', address=) at its GCS address."
        ) from e


class RayKVNameRecordRepository(NameRecordRepository):
    """Name-resolve store in a Ray cluster's GCS key-value store."""

    backend = "ray"

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        """Connect to the GCS at ``address`` (``host:port`` or ``ray://host:port``).

        Args:
            timeout: seconds for every call, including the connection probe
                done here; an unreachable GCS fails within about this long.

        Raises:
            ValueError: malformed address.
            ConnectionError: no GCS answers at the address.
            ImportError: ``ray`` is not installed.
        """
        super().__init__()
        host, port = parse_address(address)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"ray backend timeout must be positive seconds, got {timeout!r}.")
        self.host, self.port, self.timeout = host, port, float(timeout)
        self.address = f"{host}:{port}"
        try:  # imported lazily: ray is an optional, heavy dependency
            from ray._raylet import GcsClient
            from ray.exceptions import RpcError
        except ImportError as e:
            raise ImportError(
                f"name_resolve=ray://... needs Ray: pip install 'ray==2.60.0' — {e}"
            ) from e
        # The GCS down, restarting or unreachable (each call gives up after `timeout`).
        self.transient_errors = (RpcError,)
        _probe(host, port, self.timeout)
        try:
            self._client = GcsClient(address=self.address)
            self._client.internal_kv_get(b"probe", NAMESPACE, timeout=self.timeout)
        except Exception as e:
            raise ConnectionError(
                f"The Ray GCS at {self.address} did not answer within {self.timeout:g}s "
                f"({type(e).__name__}: {e}). Is it a Ray head node's GCS port, and is the "
                "auth token (RAY_AUTH_TOKEN) set when the cluster requires one?"
            ) from e

    def __repr__(self) -> str:
        return f"RayKVNameRecordRepository({self.address})"

    def _where(self) -> str:
        return f"ray backend at {self.address}"

    # ---- GCS calls -----------------------------------------------------------

    def _get_raw(self, key: str, ns: bytes = NAMESPACE) -> Optional[dict]:
        raw = self._client.internal_kv_get(key.encode(), ns, timeout=self.timeout)
        return None if raw is None else json.loads(raw)

    def _put_raw(self, key: str, entry: dict, overwrite: bool, ns: bytes = NAMESPACE) -> bool:
        """Store entry; True if the key was new."""
        data = json.dumps(entry).encode()
        return (
            self._client.internal_kv_put(key.encode(), data, overwrite, ns, timeout=self.timeout)
            == 1
        )

    def _del_raw(self, key: str, ns: bytes = NAMESPACE) -> int:
        return self._client.internal_kv_del(key.encode(), False, ns, timeout=self.timeout)

    @staticmethod
    def _live(entry: Optional[dict]) -> Optional[dict]:
        if entry is None:
            return None
        exp = entry.get("expires_at")
        return None if exp is not None and exp < time.time() else entry

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        me = uuid.uuid4().hex
        deadline = time.monotonic() + LOCK_WAIT
        pause = 0.001
        while not self._put_raw(
            key, {"owner": me, "expires_at": time.time() + LOCK_TTL}, False, LOCK_NAMESPACE
        ):
            if self._live(self._get_raw(key, LOCK_NAMESPACE)) is None:
                # Abandoned by a holder that died mid-operation (or released
                # just now): remove it and race for it again.
                self._del_raw(key, LOCK_NAMESPACE)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"name-resolve key {key!r}: another process has held its lock for over "
                    f"{LOCK_WAIT:g}s ({self._where()})."
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        try:
            yield
        finally:
            held = self._get_raw(key, LOCK_NAMESPACE)
            if held is not None and held.get("owner") == me:
                self._del_raw(key, LOCK_NAMESPACE)

    # ---- primitives --------------------------------------------------------

    def _put(self, key: str, value: str, ttl: Optional[float], replace: bool) -> object:
        token = uuid.uuid4().hex
        entry = {
            "value": value,
            "expires_at": None if ttl is None else time.time() + ttl,
            "owner": token,
        }
        if not replace and self._put_raw(key, entry, overwrite=False):
            return token  # the common case: the key was absent
        with self._locked(key):
            if not replace and self._live(self._get_raw(key)) is not None:
                raise NameEntryExistsError(
                    f"name-resolve key {key!r} already exists ({self._where()}); pass "
                    "replace=True to overwrite."
                )
            self._put_raw(key, entry, overwrite=True)
        return token

    def _read(self, key: str) -> Optional[str]:
        entry = self._live(self._get_raw(key))
        return None if entry is None else entry["value"]

    def _keys(self, prefix: str) -> List[str]:
        """Stored keys (live or expired) that are prefix or below it."""
        below = self._client.internal_kv_keys(
            (prefix + "/").encode(), NAMESPACE, timeout=self.timeout
        )
        return [prefix] + [k.decode() for k in below]

    def _items(self, prefix: str) -> List[Tuple[str, str]]:
        keys = self._keys(prefix)
        got = self._client.internal_kv_multi_get(
            [k.encode() for k in keys], NAMESPACE, timeout=self.timeout
        )
        out = []
        for k, raw in got.items():
            entry = self._live(json.loads(raw))
            if entry is not None:
                out.append((k.decode(), entry["value"]))
        return out

    def _remove(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            with self._locked(key):
                n += self._live(self._get_raw(key)) is not None
                self._del_raw(key)
        return n

    def _clear(self, prefix: str) -> None:
        # Expired entries too: a cleared trial starts from an empty subtree.
        for key in self._keys(prefix):
            with self._locked(key):
                self._del_raw(key)

    def _remove_if_owned(self, key: str, token: object) -> None:
        with self._locked(key):
            entry = self._live(self._get_raw(key))
            if entry is not None and entry.get("owner") == token:
                self._del_raw(key)

    def _refresh(self, key: str, token: object, ttl: float) -> bool:
        with self._locked(key):
            entry = self._live(self._get_raw(key))
            if entry is None or entry.get("owner") != token:
                return False
            entry["expires_at"] = time.time() + ttl
            self._put_raw(key, entry, overwrite=True)
        return True
