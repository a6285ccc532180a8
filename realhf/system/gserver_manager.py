"""The gserver manager: admits rollouts, routes generation requests, pushes new weights.

One per experiment.  :class:`GserverManager` is the logic (asyncio, dependencies passed in so
tests drive it against fakes of the trainer); :mod:`realhf.system.gserver_http` serves it over
HTTP; :class:`GserverManagerWorker` runs both as worker type ``gserver_manager`` and publishes
the address under ``names.gen_server_manager``.

Admission and hand-off follow :mod:`realhf.system.staleness` (exact per-sample bound).
Routing picks a server per chunk: a continuation returns to its previous server when that
server's weight version is unchanged; otherwise ``round_robin``, ``least_requests`` or
``least_token_usage`` (the last two read the servers' ``/metrics`` every health check and add
what was scheduled since).  Servers come from ``names.gen_servers``; one whose registration
expires or that fails ``max_health_failures`` health checks in a row gets no more requests.

Weight updates: when the trainer's version grows, every live server gets
``/pause_generation`` -> ``/update_weights_from_disk`` -> ``/continue_generation``, each
bounded by ``weight_update_timeout_s``.  A server that misses a step fails the manager with
a :class:`WeightUpdateError` naming its URL (the controller then stops the run); a server
that cannot be reached at all is dropped as dead.  Admission uses the version all live
servers run, which is never ahead of what generates the tokens.

Leases: every running rollout belongs to one rollout-worker process (name + incarnation).
Its heartbeats renew all its leases; after ``lease_ttl_s`` without one, or when a new
incarnation of the same worker appears, its rollouts are released and their slots freed.
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

from realhf.api.core.rollout_api import (
    AllocateReply,
    AllocateRequest,
    FinishReply,
    FinishRequest,
    GserverManagerConfig,
    HeartbeatReply,
    HeartbeatRequest,
    ScheduleReply,
    ScheduleRequest,
    ServerFailureReport,
)
from realhf.base import constants, logging, name_resolve, names
from realhf.system.staleness import NameResolveProgress, RolloutNotRunning, StalenessController, TrainerProgress
from realhf.system.worker_base import PollResult, Worker, register_worker

logger = logging.getLogger("gserver_manager", "system")

__all__ = [
    "WeightUpdateError",
    "NoServerAvailable",
    "ServerState",
    "choose_server",
    "parse_metrics",
    "experiment_ended",
    "GserverManager",
    "GserverManagerWorker",
]

# Longest a /finish_rollout may be held by the manager, whatever the client asks.
MAX_FINISH_WAIT_S = 60.0
_EXPERIMENT_RUNNING = "RUNNING"


class WeightUpdateError(RuntimeError):
    """A generation server failed (or timed out on) a step of a weight update."""

    def __init__(self, url: str, step: str, version: int, detail: str):
        self.url, self.step, self.version = url, step, version
        super().__init__(
            f"weight update to version {version} failed on generation server {url}: "
            f"POST /{step} {detail}"
        )


class NoServerAvailable(RuntimeError):
    """No live generation server can take a request."""


class _ServerGone(Exception):
    """A server cannot be reached at all (it died)."""


def experiment_ended(experiment_name: str, trial_name: str) -> bool:
    """Whether ``names.experiment_status`` says the run is over (absent: not over)."""
    try:
        status = name_resolve.get(names.experiment_status(experiment_name, trial_name))
    except name_resolve.NameEntryNotFoundError:
        return False
    return status != _EXPERIMENT_RUNNING


@dataclasses.dataclass
class ServerState:
    """What the manager knows about one generation server."""

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
    #: set while a weight update of this server runs (requests wait for it)
    updating: Optional[asyncio.Event] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def request_load(self) -> float:
        return self.metric_requests + self.assigned_requests

    @property
    def token_load(self) -> float:
        return self.metric_tokens + self.assigned_tokens


def choose_server(servers: Sequence[ServerState], policy: str, rr_counter: int) -> ServerState:
    """Pick a server for a new chunk (``servers`` non-empty, in a stable order).

    ``round_robin`` takes ``servers[rr_counter % len]``; ``least_requests`` /
    ``least_token_usage`` the smallest estimated load (ties: the first).
    """
    if not servers:
        raise NoServerAvailable("choose_server: no server to choose from")
    if policy == "round_robin":
        return servers[rr_counter % len(servers)]
    if policy == "least_requests":
        return min(servers, key=lambda s: s.request_load)
    if policy == "least_token_usage":
        return min(servers, key=lambda s: s.token_load)
    raise ValueError(f"unknown schedule_policy {policy!r}")


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text -> ``{metric_name: value}`` (labels dropped, last sample wins)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


@dataclasses.dataclass
class _Owner:
    incarnation: str
    last_seen: float


class GserverManager:
    """Admission, routing, leases and weight updates; see the module docstring.

    Args:
        config: the manager's settings.
        progress: where the trainer stands (version, trained samples).
        discover: returns the URLs registered by generation servers.
        weight_dir: the HF directory holding weight version ``v``.
        clock: monotonic seconds (tests pass a fake).

    All methods run on one event loop: :meth:`start`, then the HTTP handlers and
    :meth:`run_background` concurrently, then :meth:`close`.
    """

    def __init__(
        self,
        config: GserverManagerConfig,
        progress: TrainerProgress,
        discover: Callable[[], List[str]],
        weight_dir: Callable[[int], str],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.progress = progress
        self.discover = discover
        self.weight_dir = weight_dir
        self.clock = clock
        self.staleness = StalenessController(
            config.train_batch_size, config.max_head_offpolicyness, config.concurrency
        )
        self.servers: Dict[str, ServerState] = {}
        self.version = 0  # the version every live server runs
        self.trainer_version = 0
        self.trained_samples = 0
        self.owners: Dict[str, _Owner] = {}
        self._rr = 0
        self._changed = asyncio.Event()
        self._update_lock: Optional[asyncio.Lock] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._warned_trained = False

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Wait for ``n_servers`` healthy servers and bring them to the trainer's version."""
        self._session = aiohttp.ClientSession()
        self._update_lock = asyncio.Lock()
        self._changed = asyncio.Event()
        deadline = self.clock() + self.config.server_wait_timeout_s
        while True:
            await self.check_servers()
            live = [s for s in self.servers.values() if s.live]
            if len(live) >= self.config.n_servers:
                break
            if self.clock() > deadline:
                raise TimeoutError(
                    f"gserver manager: {len(live)} of {self.config.n_servers} generation servers "
                    f"registered and healthy after {self.config.server_wait_timeout_s:g}s "
                    f"(live: {[s.url for s in live]}); check the generation_server logs"
                )
            await asyncio.sleep(0.1)
        await self.poll_trainer()
        logger.info(f"serving with {len(live)} generation servers at version {self.version}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def run_background(self) -> None:
        """Weight watch, health checks and lease expiry until cancelled; a failure propagates."""
        await asyncio.gather(
            self._every(self.config.weight_poll_interval_s, self.poll_trainer),
            self._every(self.config.health_check_interval_s, self.check_servers),
            self._every(min(1.0, self.config.lease_ttl_s / 4), self._expire_async),
        )

    @staticmethod
    async def _every(interval: float, fn) -> None:
        while True:
            await fn()
            await asyncio.sleep(interval)

    # ---- rollout API ----------------------------------------------------------

    def allocate(self, req: AllocateRequest) -> AllocateReply:
        """Admit a rollout if the concurrency cap and the staleness bound allow it."""
        self._touch(req.worker, req.incarnation)
        if not any(s.live for s in self.servers.values()):
            return AllocateReply(False, reason="no_server")
        adm = self.staleness.admit(self.version, f"{req.worker}#{req.incarnation}")
        if adm is None:
            return AllocateReply(False, reason=self.staleness.refusal(self.version) or "capacity")
        return AllocateReply(True, adm.rollout_id, adm.version, adm.deadline)

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        """The server for the next chunk of ``req.rollout_id`` (see the module docstring).

        A server in the middle of a weight update is paused anyway, so the answer waits for
        the update and reports the new version: the version a chunk is recorded with is then
        the one that generates it.
        """
        for _ in range(8):
            self.staleness.get(req.rollout_id)  # raises RolloutNotRunning
            server = self._pick(req)
            if server.updating is None:
                server.assigned_requests += 1
                server.assigned_tokens += req.prompt_len + self.config.token_usage_budget_ratio * req.new_token_budget
                server.n_scheduled += 1
                return ScheduleReply(server.url, server.version)
            await asyncio.wait_for(asyncio.shield(server.updating.wait()), 3 * self.config.weight_update_timeout_s)
        raise NoServerAvailable(f"rollout {req.rollout_id}: the servers kept updating weights while scheduling")

    def _pick(self, req: ScheduleRequest) -> ServerState:
        live = sorted((s for s in self.servers.values() if s.live and s.url not in req.exclude), key=lambda s: s.url)
        if not live:
            dead = {u: s.dead_reason for u, s in self.servers.items() if not s.live}
            raise NoServerAvailable(
                f"no live generation server for rollout {req.rollout_id}: excluded {list(req.exclude)}, "
                f"dead {dead}"
            )
        prev = self.servers.get(req.previous_server_url)
        if prev is not None and prev in live and prev.version == req.previous_version:
            return prev
        server = choose_server(live, self.config.schedule_policy, self._rr)
        self._rr += 1
        return server

    async def finish(self, req: FinishRequest) -> FinishReply:
        """Release (``accepted=False``) or hand on a finished rollout, holding it if needed."""
        if not req.accepted:
            self.staleness.reject(req.rollout_id, "filtered")
            self._notify()
            return FinishReply("rejected")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(req.wait_s, MAX_FINISH_WAIT_S))
        while True:
            changed = self._changed
            index = self.staleness.accept(req.rollout_id)  # raises RolloutNotRunning
            if index is not None:
                self._notify()
                return FinishReply("accepted", index)
            left = deadline - loop.time()
            if left <= 0:
                return FinishReply("wait")
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def heartbeat(self, req: HeartbeatRequest) -> HeartbeatReply:
        self._touch(req.worker, req.incarnation)
        return HeartbeatReply(len(self.staleness.owned_by(f"{req.worker}#{req.incarnation}")))

    async def report_failure(self, report: ServerFailureReport) -> Dict[str, bool]:
        """A client could not use ``report.url``: probe it now, drop it if it is gone."""
        s = self.servers.get(report.url)
        if s is None or not s.live:
            return {"dead": True}
        if not await self._healthy(s.url):
            self._mark_dead(s, f"reported by a rollout worker ({report.error}) and failed a health check")
        return {"dead": not s.live}

    def status(self) -> Dict:
        """Counters and servers, for monitoring and tests."""
        st = self.staleness
        return {
            "version": self.version,
            "trainer_version": self.trainer_version,
            "trained_samples": self.trained_samples,
            "accepted_total": st.accepted_total,
            "accepted_pending": max(0, st.accepted_total - self.trained_samples),
            "running": st.running,
            "capacity": st.capacity(self.version),
            "stats": dict(st.stats),
            "owners": {w: o.incarnation for w, o in self.owners.items()},
            "servers": {
                u: {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "updating"}
                for u, s in self.servers.items()
            },
        }

    def _notify(self) -> None:
        # Wake every held /finish_rollout: the set of running rollouts changed.
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- leases ---------------------------------------------------------------

    def _touch(self, worker: str, incarnation: str) -> None:
        cur = self.owners.get(worker)
        if cur is not None and cur.incarnation != incarnation:
            released = self.staleness.release_owner(f"{worker}#{cur.incarnation}")
            if released:
                logger.warning(f"rollout worker {worker} restarted: released {len(released)} rollouts of its previous process")
                self._notify()
        self.owners[worker] = _Owner(incarnation, self.clock())

    def expire_leases(self) -> List[str]:
        """Release the rollouts of workers whose heartbeats stopped; returns their ids."""
        now, released = self.clock(), []
        for worker, o in list(self.owners.items()):
            if now - o.last_seen > self.config.lease_ttl_s:
                ids = self.staleness.release_owner(f"{worker}#{o.incarnation}", "expired")
                del self.owners[worker]
                logger.warning(
                    f"rollout worker {worker} sent no heartbeat for {now - o.last_seen:.1f}s "
                    f"(lease_ttl_s={self.config.lease_ttl_s:g}): released {len(ids)} rollouts"
                )
                released += ids
        if released:
            self._notify()
        return released

    async def _expire_async(self) -> None:
        self.expire_leases()

    # ---- servers --------------------------------------------------------------

    async def _healthy(self, url: str) -> bool:
        try:
            async with self._session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            ) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def _mark_dead(self, s: ServerState, reason: str) -> None:
        if s.live:
            s.live, s.dead_reason = False, reason
            left = [u for u, x in self.servers.items() if x.live]
            logger.error(f"generation server {s.url} is out of service: {reason}; {len(left)} left: {left}")

    async def check_servers(self) -> None:
        """Discover new servers, health-check live ones, refresh load metrics."""
        registered = set(await asyncio.to_thread(self.discover))
        new = [u for u in registered if u not in self.servers or not self.servers[u].live]
        live = [s for s in self.servers.values() if s.live]
        for s in live:
            if s.url not in registered:
                self._mark_dead(s, "its registration in name_resolve expired")
        live = [s for s in live if s.live]
        ok = await asyncio.gather(*(self._healthy(u) for u in new + [s.url for s in live]))
        for url, healthy in zip(new, ok[: len(new)]):
            if healthy:
                await self._add_server(url)
        for s, healthy in zip(live, ok[len(new):]):
            s.health_failures = 0 if healthy else s.health_failures + 1
            if s.health_failures >= self.config.max_health_failures:
                self._mark_dead(s, f"failed {s.health_failures} health checks in a row")
        if self.config.schedule_policy != "round_robin":
            await asyncio.gather(*(self._read_metrics(s) for s in self.servers.values() if s.live))

    async def _add_server(self, url: str) -> None:
        async with self._update_lock:
            s = ServerState(url)
            if self.version > 0:  # a server starts from the initial weights
                await self._update_server(s, self.version, self.weight_dir(self.version))
            self.servers[url] = s
        logger.info(f"generation server {url} joined at version {s.version}")

    async def _read_metrics(self, s: ServerState) -> None:
        try:
            async with self._session.get(
                s.url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            ) as r:
                m = parse_metrics(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return  # the health check decides whether it is dead
        s.metric_requests = m.get("sglang:num_running_reqs", 0.0) + m.get("sglang:num_queue_reqs", 0.0)
        s.metric_tokens = m.get("sglang:num_used_tokens", 0.0)
        s.assigned_requests, s.assigned_tokens = 0, 0.0

    # ---- weights --------------------------------------------------------------

    async def poll_trainer(self) -> None:
        """Read the trainer's progress; push a newer version to every server."""
        self.trainer_version = await asyncio.to_thread(self.progress.version)
        self.trained_samples = await asyncio.to_thread(self.progress.trained_samples)
        if self.trained_samples > self.staleness.accepted_total and not self._warned_trained:
            self._warned_trained = True
            logger.warning(
                f"the trainer reports {self.trained_samples} trained samples but this manager "
                f"accepted only {self.staleness.accepted_total}: trajectories come from elsewhere "
                "(another manager, or a resumed run without its state), so staleness is not exact"
            )
        if self.trainer_version > self.version:
            await self.update_weights(self.trainer_version)

    async def update_weights(self, version: int) -> None:
        """Bring every live server to ``version`` (pause, update, continue)."""
        path = self.weight_dir(version)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"the trainer published weight version {version} but {path!r} is not a directory; "
                "the trainer and the manager must share the file root (constants.weight_publication_dir)"
            )
        async with self._update_lock:
            t0 = time.monotonic()
            targets = [s for s in self.servers.values() if s.live]
            results = await asyncio.gather(
                *(self._update_server(s, version, path) for s in targets), return_exceptions=True
            )
            for s, r in zip(targets, results):
                if isinstance(r, _ServerGone):
                    self._mark_dead(s, f"unreachable during the weight update to version {version}")
                elif isinstance(r, BaseException):
                    raise r
            self.version = version
        logger.info(f"weights of version {version} on {len(targets)} servers in {time.monotonic() - t0:.2f}s")
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
        for step, body in (
            ("pause_generation", {}),
            ("update_weights_from_disk", {"model_path": path}),
            ("continue_generation", {}),
        ):
            try:
                async with self._session.post(
                    f"{s.url}/{step}", json=body, timeout=aiohttp.ClientTimeout(total=t)
                ) as r:
                    text = await r.text()
            except asyncio.TimeoutError:
                raise WeightUpdateError(s.url, step, version, f"did not answer within {t:g}s (weight_update_timeout_s)") from None
            except aiohttp.ClientConnectionError as e:
                if not await self._healthy(s.url):
                    raise _ServerGone(s.url) from e
                raise WeightUpdateError(s.url, step, version, f"failed: {e!r}") from e
            ok = r.status == 200
            if ok and step == "update_weights_from_disk":
                try:
                    ok = bool(json.loads(text).get("success", True))
                except ValueError:
                    pass
            if not ok:
                raise WeightUpdateError(s.url, step, version, f"answered HTTP {r.status}: {text[:500]}")
        s.version = version

    def _prune(self, version: int) -> None:
        keep = self.config.keep_weight_versions
        if keep is None:
            return
        for v in range(max(0, version - keep - 8), version - keep + 1):
            path = self.weight_dir(v)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)

    # ---- recovery -------------------------------------------------------------

    def state_dict(self) -> Dict:
        return {"staleness": self.staleness.state_dict(), "version": self.version}

    def load_state_dict(self, state: Dict, trained_samples: int) -> None:
        """Resume counters at the trainer's ``trained_samples`` (see StalenessController)."""
        self.staleness.load_state_dict(state["staleness"], trained_samples)


@register_worker("gserver_manager")
class GserverManagerWorker(Worker):
    """Runs a :class:`GserverManager` behind HTTP in a service thread (see the module docstring)."""

    config_class = GserverManagerConfig

    def _configure(self, config: GserverManagerConfig) -> None:
        from realhf.base import network
        from realhf.system.gserver_http import ManagerService

        exp, trial, role = self.experiment_name, self.trial_name, config.model_role
        progress = NameResolveProgress(exp, trial, role)
        manager = GserverManager(
            config,
            progress,
            discover=lambda: name_resolve.get_subtree(names.gen_servers(exp, trial)),
            weight_dir=lambda v: constants.weight_publication_dir(role, v, exp, trial),
        )
        if config.state_path and os.path.exists(config.state_path):
            with open(config.state_path) as f:
                manager.load_state_dict(json.load(f), progress.trained_samples())
            self.logger.info(f"resumed counters from {config.state_path}")
        self.manager = manager
        host = config.host or network.gethostip()
        self.service = ManagerService(manager, host, config.port).start(config.server_wait_timeout_s + 60)
        self._key = names.gen_server_manager(exp, trial)
        name_resolve.add(self._key, self.service.address, keepalive_ttl=self.status_ttl, replace=True)
        self._next_save = time.monotonic() + config.state_save_interval_s
        self._next_status_check = 0.0
        self.logger.info(f"gserver manager at {self.service.url}")

    def _poll(self) -> PollResult:
        self.service.check()  # re-raises a failure of the background loops (e.g. a weight update)
        now = time.monotonic()
        if now >= self._next_save:
            self._save_state()
            self._next_save = now + self.config.state_save_interval_s
        if now >= self._next_status_check:
            self._next_status_check = now + 1.0
            if experiment_ended(self.experiment_name, self.trial_name):
                self.logger.info("the experiment ended; the manager stops")
                return PollResult(completed=True)
        time.sleep(0.05)
        return PollResult()

    def _save_state(self) -> None:
        path = self.config.state_path
        if not path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = self.service.call(self.manager.state_dict)
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def _exit_hook(self) -> None:
        service = getattr(self, "service", None)
        if service is None:
            return
        try:
            self._save_state()
        finally:
            service.stop()
            try:
                name_resolve.delete(self._key)
            except Exception:  # expired or cleared with the trial
                pass
