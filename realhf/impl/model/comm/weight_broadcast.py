"""New weights from the trainer to the generation servers over a process group
(``weight_sync=broadcast``).

The trainer's writing rank runs one :class:`WeightSender`; each generation server's engine a
:class:`WeightReceiver`.  After a training step the trainer *stages* the new version: one copy
of its single-device flat buffer (a sharded layout gathers it first, as ``save_hf`` does;
the buckets carry no MAC, see below).  Each server then *pulls* it, as the load step of the
weight-update protocol (:mod:`realhf.impl.model.gen.weight_update`), while it is paused:

1. it asks the sender for version ``v`` over a ZMQ request that carries the run's MAC
   (:mod:`realhf.base.net.auth`), naming its layout (a digest), its size and its *pair*;
2. the sender answers, MAC'd too, with the dtype, the bucket size, where its rendezvous store
   is and a fresh nonce, or refuses (another layout, a version not staged yet, or an older
   one: the trainer has moved on, :class:`WeightsSuperseded` names the newer version, and the
   caller asks for that one instead): then nothing is received;
3. both join (or reuse) their pair — a two-rank gloo group (nccl when the buffers are on CUDA)
   made through the sender's store under a random name — and each proves to the other that it
   holds the run's secret: the server sends an HMAC of the pair, the nonce and the version,
   the sender checks it before it sends a byte, and its header carries its own HMAC, which
   the server checks before a byte lands in its weights;
4. the sender broadcasts the flat buffer in buckets of ``bucket_bytes`` and a trailer.  Each
   bucket lands in place in the server's flat buffer (or in a staging bucket that is converted,
   when the dtypes differ).

Why a pair per server, not one group of the trainer and every server: a collective stalls
every member when one of them dies or hangs, and re-forming a group needs all its members.  A
pair fails alone (every wait is bounded by ``timeout``; the sender aborts the pair and the
other servers' transfers go on), and a replacement server makes its own pair without touching
the others; the pair of a server that pulled none of the last ``STALE_PAIR_VERSIONS`` versions
(replaced, or out of service) is dropped when the next version is staged.  gloo broadcasts
from one root by sending to each rank in turn anyway; with nccl a single group could use a
ring, which matters only for many servers per trainer.

Why pull, from a staged copy: a server can fetch the current version whenever it needs it (a
replacement that joins mid-run, a retry), and the trainer never waits for a server: staging
copies into the buffer of the last version, or into a new one while a transfer still reads the
old.  The copy costs one version of the weights in the trainer's memory (as the ``shm`` file).

Who is trusted: the rendezvous store is a plain ``TCPStore`` (anyone who reaches its port can
read its keys and race for a pair), so the pair's two ends authenticate each other (step 3)
and a stranger that took either place gets nothing and gives nothing.  The bytes after the
handshake are not MAC'd: a MAC of every bucket cost more than the transfer itself (HMAC-SHA256
runs at ~2 GB/s per core, the pair at ~3 GB/s), and tampering with an established TCP stream
takes an attacker on the path, which the run's other channels do not stop either (its HTTP
tokens travel in clear).

What makes a half-received update impossible to serve: the receiver raises
:class:`WeightSyncError` with ``partial=True`` once any byte has landed in the model's buffer
and the update did not complete (a dead or hung sender, a wrong trailer); the engine then
refuses to serve until an update succeeds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import hmac
import json
import secrets
import threading
import time
import traceback
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import zmq

from realhf.base import logging
from realhf.base.distributed.dist_util import master_store
from realhf.base.net import auth, network
from realhf.impl.model.nn.flat_param import ParamSpec

logger = logging.getLogger("weight_broadcast")

__all__ = [
    "BUCKET_BYTES",
    "WeightSyncError",
    "WeightsSuperseded",
    "WeightSender",
    "WeightReceiver",
    "layout_digest",
]

#: bytes per broadcast: large enough that per-call costs vanish, small enough to convert
#: through a staging buffer of this size when dtypes differ
BUCKET_BYTES = 64 << 20
KIND = b"weight-sync"  # the auth channel of the requests, answers and handshakes
_MAGIC = 0x7265616C6866  # "realhf": the first word of every header and trailer
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


#: a pair that pulled none of this many latest versions is dropped (its server is gone)
STALE_PAIR_VERSIONS = 3


class WeightSyncError(RuntimeError):
    """A pull that failed.  ``partial``: bytes of it landed in the receiver's buffer (its
    weights are neither the old nor the new version until an update succeeds)."""

    def __init__(self, message: str, partial: bool = False):
        super().__init__(message)
        self.partial = partial


class WeightsSuperseded(WeightSyncError):
    """The version asked for is gone: the trainer staged ``newer`` since (nothing was
    received).  Not a failure of the server: the update goes on to ``newer``."""

    def __init__(self, message: str, newer: int):
        super().__init__(message)
        self.newer = newer


def layout_digest(param_spec: Dict[str, ParamSpec]) -> str:
    """A digest of a flat buffer's layout (every parameter's name, offset and shape): sender
    and receiver must agree on it byte for byte."""
    rows = [[n, s.offset, list(s.shape)] for n, s in sorted(param_spec.items(), key=lambda x: x[1])]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _proof(side: bytes, pair: str, nonce: str, version: int, numel: int) -> torch.Tensor:
    """What one end of a pair sends to prove it holds the run's secret, for this pull only
    (the sender's nonce is fresh per pull, so a recorded proof is worth nothing)."""
    msg = b"%s\0%s\0%s\0%d\0%d" % (side, pair.encode(), nonce.encode(), version, numel)
    return torch.frombuffer(bytearray(auth.mac(KIND, msg)), dtype=torch.uint8)


def _buckets(numel: int, per: int) -> List[Tuple[int, int]]:
    return [(a, min(a + per, numel)) for a in range(0, numel, per)] or [(0, 0)]


def _pair_group(store, name: str, rank: int, host: str, timeout: float, backend: str):
    """The two-rank group ``name`` through ``store``; this side listens on ``host``."""
    prefixed = dist.PrefixStore(f"weight-pair/{name}", store)
    td = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = td
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def _bcast(group, tensor: torch.Tensor, timeout: float, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout))


def _drop(group) -> None:
    """Abort ``group``'s pending work.  With nccl the peer's pending op then fails at once.
    A gloo group (torch 2.13) closes its connections only when it is destroyed (its
    ``abort`` and ``shutdown`` close none: the peer would wait out its timeout), so the
    caller lets go of its last reference right after (see :meth:`WeightReceiver.receive`)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 — dropping a broken pair is best effort
        pass


@dataclasses.dataclass
class _Snapshot:
    version: int
    flat: torch.Tensor
    layout: str
    bucket_elems: int
    busy: int = 0  # transfers reading ``flat`` now


class WeightSender:
    """The trainer's side: stages versions, answers pulls, sends (see the module docstring).

    ``address`` (``host:port``) is what servers are given to pull from.  ``timeout`` bounds
    every wait of a transfer (joining a pair, each bucket); a transfer that exceeds it is
    dropped, its pair aborted, and the failure logged naming the server.
    """

    def __init__(
        self,
        host: Optional[str] = None,
        timeout: float = 60.0,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        self.host = host or network.gethostip()
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._store = master_store(self.host, timeout)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{self.host}:*")
        port = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.address = f"{self.host}:{port}"
        self._lock = threading.Condition()  # also notified when a transfer ends
        self._snap: Optional[_Snapshot] = None
        self._staging: Optional[int] = None  # the version being copied in, if any
        self._pairs: Dict[str, object] = {}
        #: per pair: the last version it pulled; the transfers answered on it and not yet
        #: ended (a pull's sender side may still be ending when the next pull is answered),
        #: and the lock that runs them one at a time
        self._pulled: Dict[str, int] = {}
        self._busy_pairs: Dict[str, int] = {}
        self._pair_locks: Dict[str, threading.Lock] = {}
        #: transfers finished / failed so far, and the last failure (for logs and tests)
        self.sent = 0
        self.failed = 0
        self.last_failure: Optional[str] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="weight-send")
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-sender", daemon=True)
        self._thread.start()
        logger.info(f"weight sender at {self.address} (store port {self._store.port})")

    # ---- staging ------------------------------------------------------------------

    @property
    def version(self) -> Optional[int]:
        """The version servers can pull now (None before the first :meth:`stage`)."""
        snap = self._snap
        return None if snap is None else snap.version

    def stage(self, flat: torch.Tensor, param_spec: Dict[str, ParamSpec], version: int) -> None:
        """Make ``flat`` (a single-device model's buffer laid out by ``param_spec``) version
        ``version``, the one servers pull from now on.  Never waits for a transfer: one still
        reading the last version keeps its buffer, and this one gets a new buffer."""
        flat = flat.detach().reshape(-1)
        if str(flat.dtype).removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"cannot send a flat buffer of dtype {flat.dtype}")
        with self._lock:
            old, self._snap = self._snap, None  # nothing is sent from a half-copied buffer
            self._staging = int(version)
        if (
            old is not None
            and old.busy == 0
            and old.flat.shape == flat.shape
            and old.flat.dtype == flat.dtype
            and old.flat.device == flat.device
        ):
            buf = old.flat
        else:
            buf = torch.empty_like(flat)
        with torch.no_grad():
            buf.copy_(flat)
        per = max(1, self.bucket_bytes // flat.element_size())
        snap = _Snapshot(int(version), buf, layout_digest(param_spec), per)
        with self._lock:
            self._snap, self._staging = snap, None
            self._lock.notify_all()  # pulls that arrived during the copy go on
            # A server that pulled none of the last versions is gone (replaced, or out of
            # service): its pair's sockets go.  Should it come back, it makes a new pair
            # at its next pull, as after a failed transfer.
            stale = [
                name
                for name, last in self._pulled.items()
                if last < version - STALE_PAIR_VERSIONS and name not in self._busy_pairs
            ]
            groups = [self._pairs.pop(name, None) for name in stale]
            for name in stale:
                del self._pulled[name]
                self._pair_locks.pop(name, None)
        for name, group in zip(stale, groups):
            if group is not None:
                _drop(group)
                logger.info(
                    f"dropped pair {name[:8]}...: it pulled none of the versions after "
                    f"{version - STALE_PAIR_VERSIONS - 1}"
                )

    # ---- serving ------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                if not self._sock.poll(200):
                    continue
                got = auth.recv(self._sock, KIND, "the weight sender's socket", n_prefix=1)
            except zmq.ZMQError:
                if self._closing.is_set():
                    return
                raise
            if got is None:  # no MAC of this run: dropped (and counted) by auth.recv
                continue
            (ident,), body = got
            try:
                req = json.loads(bytes(body))
                answer, snap = self._answer(req)
            except Exception as e:  # noqa: BLE001 — a bad request is answered, not fatal
                answer, snap = {"ok": False, "error": f"bad request: {e!r}"}, None
            auth.send(self._sock, KIND, json.dumps(answer).encode(), prefix=[ident])
            if snap is not None:
                self._pool.submit(self._transfer, snap, req, answer["nonce"])

    def _answer(self, req: dict) -> Tuple[dict, Optional[_Snapshot]]:
        who = f"server {req.get('server')!r}"
        if not req["new"] and req["pair"] not in self._pairs:
            # The receiver kept a pair this side dropped (after a failed transfer): a
            # rendezvous under the old name would meet stale keys in the store.
            return {"ok": False, "new_pair": True, "error": f"{who}: pair unknown here"}, None
        with self._lock:
            if self._snap is None and self._staging is not None:
                # A version is being copied in (one memcpy; CI 2026-11-29: a pull of the
                # version before it was refused here, and the run failed).  The pull waits
                # for the copy and is then answered as any other: the new version, or
                # superseded by it.
                self._lock.wait_for(
                    lambda: self._snap is not None or self._closing.is_set(), self.timeout
                )
            snap = self._snap
            if snap is None:
                why = (
                    "the trainer has staged no version yet"
                    if self._staging is None
                    else f"the trainer is staging weight version {self._staging} now"
                )
                return {"ok": False, "error": why}, None
            if req["version"] != snap.version:
                answer = {
                    "ok": False,
                    "error": f"the trainer holds weight version {snap.version}, "
                    f"not the {req['version']} asked for",
                }
                if req["version"] < snap.version:  # only the latest is kept: ask for it
                    answer["superseded"] = snap.version
                return answer, None
            if req["layout"] != snap.layout or req["numel"] != snap.flat.numel():
                return {
                    "ok": False,
                    "error": f"{who} has another layout than the trainer ({req['numel']} "
                    f"elements, layout {req['layout'][:12]}; the trainer: "
                    f"{snap.flat.numel()}, {snap.layout[:12]}): they must load the same "
                    "architecture",
                }, None
            snap.busy += 1
            # Marked here, under the lock that staging takes: a version staged before the
            # transfer starts must not drop this pair as stale.
            pair = req["pair"]
            self._busy_pairs[pair] = self._busy_pairs.get(pair, 0) + 1
            self._pair_locks.setdefault(pair, threading.Lock())
            self._pulled[pair] = snap.version
        answer = {
            "ok": True,
            "version": snap.version,
            "numel": snap.flat.numel(),
            "dtype": str(snap.flat.dtype).removeprefix("torch."),
            "bucket_elems": snap.bucket_elems,
            "nonce": secrets.token_hex(16),
            "store": [self.host, self._store.port],
            "backend": "nccl" if snap.flat.device.type == "cuda" else "gloo",
        }
        return answer, snap

    def _transfer(self, snap: _Snapshot, req: dict, nonce: str) -> None:
        name = req["pair"]
        try:
            with self._pair_locks[name]:  # after the pair's previous transfer has ended
                self._transfer_on_pair(snap, req, nonce)
        finally:
            with self._lock:
                snap.busy -= 1
                self._busy_pairs[name] -= 1
                if not self._busy_pairs[name]:
                    del self._busy_pairs[name]
                    if name not in self._pairs:  # (failed: the pair is gone)
                        self._pair_locks.pop(name, None)
                self._lock.notify_all()

    def _transfer_on_pair(self, snap: _Snapshot, req: dict, nonce: str) -> None:
        name, who = req["pair"], f"server {req.get('server')!r}"
        t0 = time.monotonic()
        group = None
        try:
            group = self._pairs.get(name)
            if group is None:
                backend = "nccl" if snap.flat.device.type == "cuda" else "gloo"
                group = _pair_group(self._store, name, 0, self.host, self.timeout, backend)
                self._pairs[name] = group
            dev, n = snap.flat.device, snap.flat.numel()
            theirs = torch.zeros(32, dtype=torch.uint8, device=dev)
            _bcast(group, theirs, self.timeout, root=1)
            expected = _proof(b"server", name, nonce, snap.version, n)
            if not hmac.compare_digest(theirs.cpu().numpy().tobytes(), expected.numpy().tobytes()):
                raise PermissionError(
                    f"the peer of pair {name[:8]}... does not hold this run's secret; "
                    "nothing was sent"
                )
            head = torch.tensor(
                [_MAGIC, snap.version, n, len(_buckets(n, snap.bucket_elems))], device=dev
            )
            _bcast(group, head, self.timeout)
            _bcast(group, _proof(b"trainer", name, nonce, snap.version, n).to(dev), self.timeout)
            self._send_data(group, snap)
            _bcast(group, head, self.timeout)  # the trailer
            with self._lock:
                self.sent += 1
            logger.debug(f"sent version {snap.version} to {who} in {time.monotonic() - t0:.2f}s")
        except Exception as e:  # noqa: BLE001 — one server's failure is its own
            why = (
                f"sending weight version {snap.version} to {who} failed after "
                f"{time.monotonic() - t0:.1f}s (timeout {self.timeout:g}s): {e}"
            )
            with self._lock:  # counted before the pair goes, which is what the server sees
                self._pairs.pop(name, None)
                self._pulled.pop(name, None)
                self.failed += 1
                self.last_failure = why
            if group is not None:
                _drop(group)
            logger.warning(why + "; its pair is dropped, the other servers go on")

    def wait_transfers(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no transfer is running; False if one still
        is.  (A receiver returns once the last bucket arrived; the sender's side of that
        transfer ends, and is counted in :attr:`sent`, a moment later.)"""
        with self._lock:
            return self._lock.wait_for(lambda: not self._busy_pairs, timeout)

    def _send_data(self, group, snap: _Snapshot) -> None:
        """The weights themselves, bucket by bucket."""
        for a, b in _buckets(snap.flat.numel(), snap.bucket_elems):
            _bcast(group, snap.flat[a:b], self.timeout)

    def close(self) -> None:
        """Stop serving; transfers in flight are aborted."""
        self._closing.set()
        self._thread.join(timeout=5)
        for g in list(self._pairs.values()):
            _drop(g)
        self._pairs.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close(0)
        self._ctx.term()


class WeightReceiver:
    """A generation server's side: pulls a version into its model's flat buffer.

    ``name`` says who pulls (in the sender's logs); ``host`` is the address this side
    listens on for its pairs (the one the sender can reach).  Keeps one pair per sender.
    """

    def __init__(self, name: str = "server", host: Optional[str] = None):
        self.name = name
        self.host = host or network.gethostip()
        self._ctx = zmq.Context()
        self._pairs: Dict[str, Tuple[str, object]] = {}

    def receive(
        self,
        sender: str,
        version: int,
        flat: torch.Tensor,
        param_spec: Union[Dict[str, ParamSpec], str],
        timeout: float = 60.0,
    ) -> int:
        """Pull ``version`` from the sender at ``sender`` (``host:port``) into ``flat`` (this
        model's buffer, laid out by ``param_spec``, or its :func:`layout_digest`; any float
        dtype: a different one is converted); returns the bytes received.

        Raises :class:`WeightSyncError`: ``partial=False`` when refused before anything was
        received (``flat`` is unchanged), ``partial=True`` after.  Every wait is bounded by
        ``timeout`` seconds."""
        pair = self._pairs.get(sender)
        req = {
            "version": int(version),
            "layout": param_spec if isinstance(param_spec, str) else layout_digest(param_spec),
            "numel": flat.numel(),
            "pair": pair[0] if pair is not None else secrets.token_hex(16),
            "new": pair is None,
            "server": self.name,
        }
        ans = self._ask(sender, req, timeout)
        if pair is not None and ans.get("new_pair"):
            # The sender dropped our pair (a transfer it saw fail): make a new one.
            self._pairs.pop(sender, None)
            _drop(pair[1])
            pair = None
            req.update(pair=secrets.token_hex(16), new=True)
            ans = self._ask(sender, req, timeout)
        name = req["pair"]
        if not ans.get("ok"):
            why = f"the weight sender at {sender} refused: {ans.get('error')}"
            if isinstance(ans.get("superseded"), int):
                raise WeightsSuperseded(why, ans["superseded"])
            raise WeightSyncError(why)
        src_dtype = _DTYPES[ans["dtype"]]
        if ans["backend"] == "nccl" and flat.device.type != "cuda":
            raise WeightSyncError(
                f"the weight sender at {sender} sends over nccl (its weights are on a GPU), "
                "and this server's are on the CPU; use weight_sync=disk or shm"
            )
        try:
            if pair is None:
                host, port = ans["store"]
                store = dist.TCPStore(
                    host, int(port), None, False, datetime.timedelta(seconds=timeout)
                )
                group = _pair_group(store, name, 1, self.host, timeout, ans["backend"])
                self._pairs[sender] = (name, group)
            else:
                group = pair[1]
        except Exception as e:
            raise WeightSyncError(f"joining the weight sender at {sender} failed: {e}") from e
        try:
            return self._receive(group, ans, name, src_dtype, version, flat, timeout)
        except BaseException as e:
            self._pairs.pop(sender, None)
            _drop(group)
            # The raised error's frames would keep the group, and so its sockets, alive
            # while the caller holds the error: the sender would wait out its timeout.
            # Without them (and these names) the group goes now and the sender learns at once.
            traceback.clear_frames(e.__traceback__)
            del group, pair
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(
                f"receiving weight version {version} from {sender} failed: {e}", partial=True
            ) from e

    def _receive(self, group, ans, name, src_dtype, version, flat, timeout) -> int:
        flat, dev = flat.reshape(-1), flat.device
        n = flat.numel()
        spans = _buckets(n, ans["bucket_elems"])
        want = [_MAGIC, int(version), n, len(spans)]
        head = torch.zeros(4, dtype=torch.int64, device=dev)
        theirs = torch.zeros(32, dtype=torch.uint8, device=dev)
        # The handshake: nothing has landed yet, so a failure here leaves the weights as
        # they were (partial=False).
        try:
            _bcast(group, _proof(b"server", name, ans["nonce"], version, n).to(dev), timeout, 1)
            _bcast(group, head, timeout)
            _bcast(group, theirs, timeout)
        except Exception as e:
            raise WeightSyncError(f"the handshake with the weight sender failed: {e}") from e
        expected = _proof(b"trainer", name, ans["nonce"], version, n)
        if not hmac.compare_digest(theirs.cpu().numpy().tobytes(), expected.numpy().tobytes()):
            raise WeightSyncError(
                f"the peer of pair {name[:8]}... does not hold this run's secret; "
                "nothing was received"
            )
        if head.tolist() != want:
            raise WeightSyncError(f"bad header {head.tolist()}, expected {want}")
        in_place = src_dtype == flat.dtype
        staging = (
            None if in_place else torch.empty(ans["bucket_elems"], dtype=src_dtype, device=dev)
        )
        received = 0
        try:
            for a, b in spans:
                buf = flat[a:b] if in_place else staging[: b - a]
                _bcast(group, buf, timeout)
                received += buf.numel() * buf.element_size()
                if not in_place:
                    with torch.no_grad():
                        flat[a:b].copy_(buf)
            _bcast(group, head, timeout)
        except Exception as e:
            raise WeightSyncError(f"{e} (after {received} bytes)", partial=True) from e
        if head.tolist() != want:
            raise WeightSyncError(f"bad trailer {head.tolist()}, expected {want}", partial=True)
        return received

    def _ask(self, sender: str, req: dict, timeout: float) -> dict:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{sender}")
            auth.send(sock, KIND, json.dumps(req).encode())
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise WeightSyncError(
                        f"the weight sender at {sender} did not answer within {timeout:g}s "
                        "(is the trainer running, and has it published a version?)"
                    )
                got = auth.recv(sock, KIND, f"{self.name}'s socket to the weight sender")
                if got is not None:  # else: not MAC'd by this run, dropped; keep waiting
                    return json.loads(bytes(got[1]))
        finally:
            sock.close(0)

    def close(self) -> None:
        for _, g in self._pairs.values():
            _drop(g)
        self._pairs.clear()
        self._ctx.term()
