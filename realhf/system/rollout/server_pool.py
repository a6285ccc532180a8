"""The generation servers a gserver manager drives: discovery, health, load, routing, weights.

:class:`ServerPool` keeps one :class:`ServerState` per server URL found by ``discover()``
(``names.gen_servers`` in a run).  A server is *live* once it answered ``/health`` and runs
the pool's version; it stops being live when its registration expires or it fails
``max_health_failures`` health checks in a row (or a client reports it and a probe fails).

Routing (:meth:`ServerPool.pick`): a continuation returns to its previous server when that
server's version is unchanged (cached prefix); otherwise :func:`choose_server` applies the
policy — ``round_robin``, ``least_requests`` or ``least_token_usage`` (the last two read
``/metrics`` at every health check and add what was scheduled since).

Weights (:meth:`ServerPool.update_weights`): every live server gets ``/pause_generation`` ->
``/update_weights_from_disk`` -> ``/continue_generation``, each bounded by
``weight_update_timeout_s``.  A server that cannot be reached is dropped (so is one that
answers a step with a 5xx and then fails its health check); one that fails a step otherwise
is taken out of service (it may hold the old weights) and tried again at health checks every
:data:`REJOIN_RETRY_S` seconds — it rejoins once an update to the current version succeeds.
Only when no server is left live does the update raise :class:`WeightUpdateError` naming
each server's failure (the run then stops).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import time
from typing import Callable, Dict, List, Optional, Sequence

import aiohttp

from realhf.api.core.rollout_api import GserverManagerConfig, SchedulePolicy, ScheduleRequest
from realhf.base import logging

logger = logging.getLogger("server_pool", "system")

__all__ = [
    "WeightUpdateError",
    "NoServerAvailable",
    "ServerState",
    "choose_server",
    "parse_metrics",
    "ServerPool",
]


class WeightUpdateError(RuntimeError):
    """A generation server failed (or timed out on) a step of a weight update."""

    def __init__(self, url: str, step: str, version: int, detail: str):
        self.url, self.step, self.version = url, step, version
        super().__init__(
            f"weight update to version {version} failed on generation server {url}: "
            f"POST /{step} {detail}"
        )


#: seconds between attempts to bring a server that failed a weight update back
REJOIN_RETRY_S = 5.0


class NoServerAvailable(RuntimeError):
    """No live generation server can take a request."""


class _ServerGone(Exception):
    """A server cannot be reached at all (it died)."""


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


#: Each policy picks from a non-empty, stably ordered list; ``min`` keeps the first of ties.
_POLICIES: Dict[SchedulePolicy, Callable[[Sequence[ServerState], int], ServerState]] = {
    SchedulePolicy.ROUND_ROBIN: lambda servers, rr: servers[rr % len(servers)],
    SchedulePolicy.LEAST_REQUESTS: lambda servers, rr: min(servers, key=lambda s: s.request_load),
    SchedulePolicy.LEAST_TOKEN_USAGE: lambda servers, rr: min(servers, key=lambda s: s.token_load),
}


def choose_server(
    servers: Sequence[ServerState], policy: SchedulePolicy | str, rr_counter: int
) -> ServerState:
    """Pick a server for a new chunk (``servers`` non-empty, in a stable order).

    ``round_robin`` takes ``servers[rr_counter % len]``; ``least_requests`` /
    ``least_token_usage`` the smallest estimated load (ties: the first).
    """
    if not servers:
        raise NoServerAvailable("choose_server: no server to choose from")
    try:
        pick = _POLICIES[SchedulePolicy(policy)]
    except ValueError:
        raise ValueError(f"unknown schedule_policy {policy!r}") from None
    return pick(servers, rr_counter)


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text -> ``{metric_name: value}`` (labels dropped, last sample wins)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        try:
            out[name_part.split("{", 1)[0]] = float(value)
        except ValueError:
            continue
    return out


class ServerPool:
    """See the module docstring.  Use on one event loop, between :meth:`open` and :meth:`close`.

    Args:
        config: the manager's settings (policy, timeouts, health limits).
        discover: returns the URLs servers registered.
        weight_dir: the HF directory holding weight version ``v``.
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

    async def open(self) -> None:
        self._session = aiohttp.ClientSession()
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def live(self) -> List[ServerState]:
        return sorted((s for s in self.servers.values() if s.live), key=lambda s: s.url)

    # ---- routing --------------------------------------------------------------

    def pick(self, req: ScheduleRequest) -> ServerState:
        """The server for ``req`` (continuation first, else the policy); raises NoServerAvailable.

        ``req.exclude`` (servers that just failed this sequence) is a preference: when every
        live server is excluded, they are used anyway — a server that failed a health check
        after the client's report is dead already, so a live one only had a transient error
        (the client's ``max_server_failures`` bounds the retries).
        """
        all_live = self.live()
        live = [s for s in all_live if s.url not in req.exclude] or all_live
        if not live:
            dead = {u: s.dead_reason for u, s in self.servers.items() if not s.live}
            raise NoServerAvailable(
                f"no live generation server for rollout {req.rollout_id}: "
                f"excluded {list(req.exclude)}, dead {dead}"
            )
        prev = self.servers.get(req.previous_server_url)
        if prev is not None and prev in live and prev.version == req.previous_version:
            return prev
        server = choose_server(live, self.config.schedule_policy, self._rr)
        self._rr += 1
        return server

    def assign(self, s: ServerState, req: ScheduleRequest) -> None:
        """Count ``req`` (``n_sequences`` requests) against ``s`` until the next metrics read."""
        s.assigned_requests += req.n_sequences
        s.assigned_tokens += (
            req.prompt_len + self.config.token_usage_budget_ratio * req.new_token_budget
        )
        s.n_scheduled += 1

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
            if self.version > 0:  # a server starts from the initial weights
                try:
                    await self._update_server(s, self.version, self.weight_dir(self.version))
                except (WeightUpdateError, _ServerGone) as e:
                    old = self.servers.get(url)
                    if old is None:
                        self.servers[url] = old = ServerState(url, live=False)
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
                m = parse_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return  # the health check decides whether it is dead
        s.metric_requests = m.get("sglang:num_running_reqs", 0.0) + m.get(
            "sglang:num_queue_reqs", 0.0
        )
        s.metric_tokens = m.get("sglang:num_used_tokens", 0.0)
        s.assigned_requests, s.assigned_tokens = 0, 0.0

    # ---- weights --------------------------------------------------------------

    async def update_weights(self, version: int) -> None:
        """Bring every live server to ``version`` (pause, update, continue)."""
        path = self.weight_dir(version)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"the trainer published weight version {version} but {path!r} is not a "
                "directory; the trainer and the manager must share the file root "
                "(constants.weight_publication_dir)"
            )
        async with self._lock:
            t0 = time.monotonic()
            targets = self.live()
            results = await asyncio.gather(
                *(self._update_server(s, version, path) for s in targets), return_exceptions=True
            )
            failed = []
            for s, r in zip(targets, results):
                if isinstance(r, _ServerGone):
                    self.mark_dead(s, f"unreachable during the weight update to version {version}")
                elif isinstance(r, WeightUpdateError):
                    failed.append(r)
                    self.mark_dead(s, str(r))
                    s.retry_at = time.monotonic() + REJOIN_RETRY_S
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
            self.version = version
        logger.info(
            f"weights of version {version} on {len(targets)} servers "
            f"in {time.monotonic() - t0:.2f}s"
        )
        self._prune(version)

    async def _update_server(self, s: ServerState, version: int, path: str) -> None:
        s.updating = asyncio.Event()
        try:
            await self._update_steps(s, version, path)
        finally:
            s.updating.set()
            s.updating = None

    async def _update_steps(self, s: ServerState, version: int, path: str) -> None:
        t = self.config.weight_update_timeout_s
        for step, body, reports_success in (
            ("pause_generation", {}, False),
            # Its body says {"success": bool, "message": ...}: a 200 alone is not trusted.
            ("update_weights_from_disk", {"model_path": path}, True),
            ("continue_generation", {}, False),
        ):
            try:
                async with self._session.post(
                    f"{s.url}/{step}", json=body, timeout=aiohttp.ClientTimeout(total=t)
                ) as r:
                    status, text = r.status, await r.text()
            except asyncio.TimeoutError:
                raise WeightUpdateError(
                    s.url, step, version, f"did not answer within {t:g}s (weight_update_timeout_s)"
                ) from None
            except aiohttp.ClientConnectionError as e:
                if not await self.healthy(s.url):
                    raise _ServerGone(s.url) from e
                raise WeightUpdateError(s.url, step, version, f"failed: {e!r}") from e
            ok = status == 200
            if ok and reports_success:
                try:
                    ok = bool(json.loads(text).get("success", True))
                except ValueError:
                    pass
            if not ok:
                # A server in front of an engine that died (the vLLM adapter) still answers,
                # with an error; if it also fails its health check it is gone, as a server
                # that cannot be reached is: its replacement joins at the current version.
                if status >= 500 and not await self.healthy(s.url):
                    raise _ServerGone(s.url)
                raise WeightUpdateError(
                    s.url, step, version, f"answered HTTP {status}: {text[:500]}"
                )
        s.version = version

    def _prune(self, version: int) -> None:
        keep = self.config.keep_weight_versions
        if keep is None:
            return
        # Only the last few old versions are looked at: each update prunes, so older ones
        # are gone already; the margin covers versions the trainer published between two
        # polls (never pushed, so never pruned by their own update).
        for v in range(max(0, version - keep - 8), version - keep + 1):
            path = self.weight_dir(v)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
