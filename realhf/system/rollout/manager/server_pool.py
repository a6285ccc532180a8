"""The generation servers of a run: discovery, health, load, routing, weight updates.

:class:`ServerPool` keeps one :class:`ServerState` per server URL found by ``discover()``
(``names.gen_servers`` in a run; a fixed list for areal's ``RemoteInferenceEngine``).  A server
is *live* once it answered ``/health`` and runs the pool's version; it stops being live when
its registration expires or it fails ``max_health_failures`` health checks in a row (or a
client reports it and a probe fails).

Routing (:meth:`ServerPool.schedule`): :func:`~.routing.route` picks among the live servers;
a server in the middle of a weight update is paused anyway, so the request waits for the
update and is told the new version.

Weights (:meth:`ServerPool.update_weights`): every live server goes through the protocol of
:mod:`realhf.impl.model.gen.weight_update` (pause -> load -> continue, each step bounded by
``weight_update_timeout_s``).  A server that cannot be reached is dropped (so is one that
answers a step with a 5xx and then fails its health check); one that fails a step otherwise
is taken out of service (it may hold the old weights) and tried again at health checks every
:data:`REJOIN_RETRY_S` seconds — it rejoins once an update to the current version succeeds.
Only when no server is left live does the update raise
:class:`~realhf.impl.model.gen.weight_update.WeightUpdateError` naming each server's failure
(the run then stops).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from typing import Callable, Dict, List, Optional

import aiohttp

from realhf.api.core.rollout_api import ScheduleRequest
from realhf.api.core.rollout_config import GserverManagerConfig, SchedulePolicy, WeightSync
from realhf.base import logging
from realhf.impl.model.conversion.flat_file import retire
from realhf.impl.model.gen.weight_update import (
    ServerGone,
    UpdateSuperseded,
    WeightUpdateError,
    update_server,
)
from realhf.system.rollout.manager.routing import (
    NoServerAvailable,
    load_from_metrics,
    parse_metrics,
    route,
)

logger = logging.getLogger("server_pool", "system")

__all__ = ["REJOIN_RETRY_S", "ServerState", "ServerPool"]

#: seconds between attempts to bring a server that failed a weight update back
REJOIN_RETRY_S = 5.0

#: rounds of one weight update that may end superseded by a newer version (``broadcast``)
SUPERSEDED_ROUNDS = 4

#: weight updates one ``schedule`` call waits out before it gives up (see ServerPool.schedule)
MAX_UPDATES_WAITED = 8


@dataclasses.dataclass
class ServerState:
    """What the pool knows about one generation server."""

    url: str
    version: int = 0
    live: bool = True
    health_failures: int = 0
    metric_requests: float = 0.0  # running + queued requests at the last /metrics read
    metric_tokens: float = 0.0  # KV tokens in use at the last /metrics read
    assigned_requests: int = 0  # scheduled since that read
    assigned_tokens: float = 0.0
    n_scheduled: int = 0
    dead_reason: str = ""
    #: monotonic time before which a server out of service is not tried again
    retry_at: float = 0.0
    #: a weight update failed on it: it may hold half of a version, so it rejoins only
    #: through a successful update (never at version 0, whose weights it cannot reload)
    weights_unknown: bool = False
    #: set while a weight update of this server runs (requests to it wait)
    updating: Optional[asyncio.Event] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def request_load(self) -> float:
        return self.metric_requests + self.assigned_requests

    @property
    def token_load(self) -> float:
        return self.metric_tokens + self.assigned_tokens

    def summary(self) -> Dict:
        """JSON-friendly fields (for ``/status``)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "updating"
        }


class ServerPool:
    """See the module docstring.  Use on one event loop, between :meth:`open` and :meth:`close`.

    Args:
        config: the manager's settings (policy, timeouts, health limits).
        discover: returns the URLs servers registered.
        weight_dir: where weight version ``v`` is published (a HF directory, a flat file
            in shared memory with ``config.weight_sync=shm``, the trainer's weight sender's
            address with ``broadcast``).
    """

    def __init__(
        self,
        config: GserverManagerConfig,
        discover: Callable[[], List[str]],
        weight_dir: Callable[[int], str],
    ):
        self.config = config
        self.discover = discover
        self.weight_dir = weight_dir
        self.servers: Dict[str, ServerState] = {}
        self.version = 0  # the version every live server runs
        self._rr = 0
        # Serialises weight updates and joins: a server that joins during an update waits
        # and is then brought to the new version instead of staying at the old one.
        self._lock: Optional[asyncio.Lock] = None
        self._session: Optional[aiohttp.ClientSession] = None
        #: servers whose /metrics could not be read last time (each is logged once)
        self._unreadable_metrics: set = set()

    async def open(self) -> None:
        self._session = aiohttp.ClientSession()
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_for_servers(self, n: int, timeout_s: float) -> None:
        """Check until ``n`` servers are live; TimeoutError (naming the live ones) after
        ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.check()
            live = self.live()
            if len(live) >= n:
                return
            if loop.time() > deadline:
                raise TimeoutError(
                    f"{len(live)} of {n} generation servers registered and healthy after "
                    f"{timeout_s:g}s (live: {[s.url for s in live]}); check the generation "
                    "servers' logs"
                )
            await asyncio.sleep(0.1)

    def live(self) -> List[ServerState]:
        return sorted((s for s in self.servers.values() if s.live), key=lambda s: s.url)

    # ---- routing --------------------------------------------------------------

    def pick(self, req: ScheduleRequest) -> ServerState:
        """The server for ``req`` (see :func:`~.routing.route`); raises NoServerAvailable."""
        dead = {u: s.dead_reason for u, s in self.servers.items() if not s.live}
        server, by_policy = route(
            self.live(),
            req,
            self.config.schedule_policy,
            self._rr,
            self.servers.get(req.previous_server_url),
            dead,
        )
        self._rr += by_policy
        return server

    def assign(self, s: ServerState, req: ScheduleRequest) -> None:
        """Count ``req`` (``n_sequences`` requests) against ``s`` until the next metrics read."""
        s.assigned_requests += req.n_sequences
        s.assigned_tokens += (
            req.prompt_len + self.config.token_usage_budget_ratio * req.new_token_budget
        )
        s.n_scheduled += 1

    async def schedule(
        self, req: ScheduleRequest, still_wanted: Callable[[], object] = lambda: None
    ) -> ServerState:
        """The server for the next chunk of ``req``, counted against its load.

        A server in the middle of a weight update is paused anyway, so this waits for the
        update and then answers with the server at its new version: the chunk is recorded
        with the version that generates it.  ``still_wanted()`` runs before every pass and
        may raise (the manager's check that the rollout still runs).
        """
        # Each pass waits out one weight update (pause, load, continue: each step bounded by
        # weight_update_timeout_s, hence 3x); more than a few updates in a row while one
        # chunk waits means the servers never settle.
        for _ in range(MAX_UPDATES_WAITED):
            still_wanted()
            server = self.pick(req)
            updating = server.updating
            if updating is None:
                self.assign(server, req)
                return server
            # shield: a cancelled request must not cancel the event others wait on
            await asyncio.wait_for(
                asyncio.shield(updating.wait()), 3 * self.config.weight_update_timeout_s
            )
        raise NoServerAvailable(
            f"rollout {req.rollout_id}: the servers kept updating weights while scheduling"
        )

    async def report_failure(self, url: str, error: str) -> bool:
        """A client could not use ``url``: probe it now, drop it if it is gone; True if dead."""
        s = self.servers.get(url)
        if s is None or not s.live:
            return True
        if not await self.healthy(s.url):
            self.mark_dead(s, f"reported by a client ({error}) and failed a health check")
        return not s.live

    # ---- health ---------------------------------------------------------------

    async def healthy(self, url: str) -> bool:
        try:
            async with self._session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def mark_dead(self, s: ServerState, reason: str) -> None:
        if s.live:
            s.live, s.dead_reason = False, reason
            left = [x.url for x in self.live()]
            logger.error(
                f"generation server {s.url} is out of service: {reason}; {len(left)} left: {left}"
            )

    async def check(self) -> None:
        """Discover new servers, health-check live ones, refresh load metrics."""
        registered = set(await asyncio.to_thread(self.discover))
        now = time.monotonic()
        new = sorted(
            u
            for u in registered
            if u not in self.servers
            or (not self.servers[u].live and self.servers[u].retry_at <= now)
        )
        for s in self.live():
            if s.url not in registered:
                self.mark_dead(s, "its registration in name_resolve expired")
        live = self.live()
        ok = await asyncio.gather(*(self.healthy(u) for u in new + [s.url for s in live]))
        for url, healthy in zip(new, ok[: len(new)]):
            if healthy:
                await self._add(url)
        for s, healthy in zip(live, ok[len(new) :]):
            s.health_failures = 0 if healthy else s.health_failures + 1
            if s.health_failures >= self.config.max_health_failures:
                self.mark_dead(s, f"failed {s.health_failures} health checks in a row")
        # Only the load-based policies need /metrics; round robin skips the extra requests.
        if self.config.schedule_policy != SchedulePolicy.ROUND_ROBIN:
            await asyncio.gather(*(self._read_metrics(s) for s in self.live()))

    async def _add(self, url: str) -> None:
        async with self._lock:
            s = ServerState(url)
            old = self.servers.get(url)
            if self.version == 0 and old is not None and old.weights_unknown:
                old.dead_reason = (
                    "a weight update failed on it, so its weights are unknown; it rejoins with "
                    "the next published version"
                )
                old.retry_at = time.monotonic() + REJOIN_RETRY_S
                return
            if self.version > 0:  # a server starts from the initial weights
                try:
                    await self._update_server(s, self.version, self.weight_dir(self.version))
                except (WeightUpdateError, ServerGone, UpdateSuperseded) as e:
                    # (superseded: the pool is about to move on; join at its next version)
                    if old is None:
                        self.servers[url] = old = ServerState(url, live=False)
                    old.weights_unknown = old.weights_unknown or isinstance(e, WeightUpdateError)
                    old.dead_reason = f"could not join: {e}"
                    old.retry_at = time.monotonic() + REJOIN_RETRY_S
                    logger.warning(
                        f"generation server {url} cannot join yet ({e}); "
                        f"trying again in {REJOIN_RETRY_S:g}s"
                    )
                    return
            self.servers[url] = s
        logger.info(f"generation server {url} joined at version {s.version}")

    async def _read_metrics(self, s: ServerState) -> None:
        try:
            async with self._session.get(
                s.url + "/metrics",
                timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s),
            ) as r:
                text = await r.text()
                if r.status != 200:
                    raise ValueError(f"/metrics answered HTTP {r.status}: {text[:200]!r}")
                m = parse_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return  # the health check decides whether it is dead
        except ValueError as e:
            # Its estimate stays (the last reading plus what was scheduled since): reading
            # an error page as "no load" would send it every request.
            if s.url not in self._unreadable_metrics:
                self._unreadable_metrics.add(s.url)
                logger.warning(
                    f"generation server {s.url}: {e}; its load is estimated from the requests "
                    "scheduled on it until /metrics is readable again"
                )
            return
        self._unreadable_metrics.discard(s.url)
        s.metric_requests, s.metric_tokens = load_from_metrics(m)
        s.assigned_requests, s.assigned_tokens = 0, 0.0

    # ---- weights --------------------------------------------------------------

    async def update_weights(self, version: int) -> None:
        """Bring every live server to ``version`` (pause, update, continue), or to a newer
        one if the trainer staged it meanwhile (``broadcast`` keeps only the latest: a server
        that asked for ``version`` was told so, :class:`UpdateSuperseded`, and kept its
        weights).  After :data:`SUPERSEDED_ROUNDS` such rounds the pool stays at its version
        and the next poll tries again (each server is recorded at what it holds)."""
        for _ in range(SUPERSEDED_ROUNDS):
            newer = await self._update_all(version)
            if newer is None:
                return
            logger.info(
                f"weight version {version} was superseded by {newer} before every server "
                f"pulled it: updating to {newer}"
            )
            version = newer
        logger.warning(
            f"the trainer staged new weights faster than {SUPERSEDED_ROUNDS} updates could "
            f"finish; the servers stay at version {self.version} until the next poll"
        )

    async def _update_all(self, version: int) -> Optional[int]:
        """One round of :meth:`update_weights`; the newer version if any server's pull of
        ``version`` was superseded (the pool's version then stays), else None."""
        path = self.weight_dir(version)
        shm = self.config.weight_sync == WeightSync.SHM
        pulled = self.config.weight_sync == WeightSync.BROADCAST  # path: the sender's address
        if not pulled and not (os.path.isfile(path) if shm else os.path.isdir(path)):
            raise FileNotFoundError(
                f"weight version {version} was published but {path!r} is not a "
                + (
                    "file; with weight_sync=shm the trainer and the servers must run on one "
                    "host (in a run: constants.weight_shm_path)"
                    if shm
                    else "directory; the trainer and the servers must share that file system "
                    "(in a run: constants.weight_publication_dir)"
                )
            )
        async with self._lock:
            t0 = time.monotonic()
            targets = self.live()
            results = await asyncio.gather(
                *(self._update_server(s, version, path) for s in targets), return_exceptions=True
            )
            failed, newer = [], None
            for s, r in zip(targets, results):
                if isinstance(r, UpdateSuperseded):
                    newer = r.newer if newer is None else max(newer, r.newer)
                elif isinstance(r, ServerGone):
                    self.mark_dead(s, f"unreachable during the weight update to version {version}")
                elif isinstance(r, WeightUpdateError):
                    failed.append(r)
                    self.mark_dead(s, str(r))
                    s.retry_at = time.monotonic() + REJOIN_RETRY_S
                    s.weights_unknown = True
                elif isinstance(r, BaseException):
                    raise r
            if failed and not self.live():
                if len(failed) == 1:
                    raise failed[0]
                raise WeightUpdateError(
                    ", ".join(f.url for f in failed),
                    failed[0].step,
                    version,
                    "on every server: " + "; ".join(str(f) for f in failed),
                )
            if newer is not None:
                return newer
            self.version = version
        logger.info(
            f"weights of version {version} on {len(targets)} servers "
            f"in {time.monotonic() - t0:.2f}s (weight_sync={self.config.weight_sync})"
        )
        self._prune(version)
        return None

    async def _update_server(self, s: ServerState, version: int, path: str) -> None:
        s.updating = asyncio.Event()
        try:
            await update_server(
                self._session,
                s.url,
                version,
                path,
                self.config.weight_update_timeout_s,
                self.healthy,
                self.config.weight_sync,
            )
            s.version = version
        finally:
            s.updating.set()
            s.updating = None

    def _prune(self, version: int) -> None:
        keep = self.config.keep_weight_versions
        if keep is None or self.config.weight_sync == WeightSync.BROADCAST:
            return  # nothing is published to a file
        # Only the last few old versions are looked at: each update prunes, so older ones
        # are gone already; the margin covers versions the trainer published between two
        # polls (never pushed, so never pruned by their own update).
        for v in range(max(0, version - keep - 8), version - keep + 1):
            path = self.weight_dir(v)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.isfile(path):
                # A flat file in shared memory: the trainer's next write reuses its pages.
                retire(path)
