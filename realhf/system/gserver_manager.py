"""The gserver manager: admits rollouts, routes generation requests, pushes new weights.

One per experiment.  :class:`GserverManager` is the logic (asyncio, dependencies passed in so
tests drive it against fakes of the trainer); :mod:`realhf.system.gserver_http` serves it over
HTTP; :class:`GserverManagerWorker` runs both as worker type ``gserver_manager`` and publishes
the address under ``names.gen_server_manager``.

Admission and hand-off follow :mod:`realhf.system.staleness` (exact per-sample bound).
Routing, health checks and weight updates of the servers live in
:mod:`realhf.system.server_pool`: when the trainer's version (``names.model_version``) grows,
every live server is paused, updated from ``constants.weight_publication_dir`` and continued,
each step with a timeout; a server that misses one fails the manager with a
:class:`WeightUpdateError` naming its URL (the controller then stops the run).  Admission uses
the version all live servers run, which is never ahead of what generates the tokens.

Leases: every running rollout belongs to one rollout-worker process (name + incarnation).
Its heartbeats renew all its leases; after ``lease_ttl_s`` without one, or when a new
incarnation of the same worker appears, its rollouts are released and their slots freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

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
from realhf.base.atomic_file import write_json_atomic
from realhf.system.server_pool import (
    NoServerAvailable,
    ServerPool,
    ServerState,
    WeightUpdateError,
    choose_server,
    parse_metrics,
)
from realhf.system.staleness import NameResolveProgress, StalenessController, TrainerProgress
from realhf.system.worker_base import PollResult, Worker, register_worker

if TYPE_CHECKING:  # gserver_http imports this module
    from realhf.system.gserver_http import ManagerService

logger = logging.getLogger("gserver_manager", "system")

__all__ = [
    "experiment_ended",
    "GserverManager",
    "GserverManagerWorker",
    # re-exported from realhf.system.server_pool
    "WeightUpdateError",
    "NoServerAvailable",
    "ServerState",
    "choose_server",
    "parse_metrics",
]

# Longest a /finish_rollout may be held by the manager, whatever the client asks.
MAX_FINISH_WAIT_S = 60.0
_EXPERIMENT_RUNNING = "RUNNING"


def experiment_ended(experiment_name: str, trial_name: str) -> bool:
    """Whether ``names.experiment_status`` says the run is over (absent: not over)."""
    try:
        status = name_resolve.get(names.experiment_status(experiment_name, trial_name))
    except name_resolve.NameEntryNotFoundError:
        return False
    return status != _EXPERIMENT_RUNNING


@dataclasses.dataclass
class _Owner:
    incarnation: str
    last_seen: float


class GserverManager:
    """Admission, hand-off, leases and routing; see the module docstring.

    Args:
        config: the manager's settings.
        progress: where the trainer stands (version, trained samples).
        discover: returns the URLs registered by generation servers.
        weight_dir: the HF directory holding weight version ``v``.
        clock: monotonic seconds for leases (tests pass a fake).

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
        self.clock = clock
        self.pool = ServerPool(config, discover, weight_dir)
        self.staleness = StalenessController(
            config.train_batch_size, config.max_head_offpolicyness, config.concurrency
        )
        self.trainer_version = 0
        self.trained_samples = 0
        self.owners: Dict[str, _Owner] = {}
        self._changed = asyncio.Event()
        self._warned_trained = False
        #: False until the trainer announced where it starts (see GserverManagerWorker);
        #: no rollout is admitted before, so indices never start from a guess.
        self.trainer_ready = True

    @property
    def version(self) -> int:
        """The weight version every live server runs (admission uses it)."""
        return self.pool.version

    @property
    def servers(self) -> Dict[str, ServerState]:
        return self.pool.servers

    # ---- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Wait for ``n_servers`` healthy servers and bring them to the trainer's version."""
        await self.pool.open()
        self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.server_wait_timeout_s
        while True:
            await self.pool.check()
            live = self.pool.live()
            if len(live) >= self.config.n_servers:
                break
            if loop.time() > deadline:
                raise TimeoutError(
                    f"gserver manager: {len(live)} of {self.config.n_servers} generation servers "
                    f"registered and healthy after {self.config.server_wait_timeout_s:g}s "
                    f"(live: {[s.url for s in live]}); check the generation_server logs"
                )
            await asyncio.sleep(0.1)
        await self.poll_trainer()
        logger.info(f"serving with {len(live)} generation servers at version {self.version}")

    async def close(self) -> None:
        await self.pool.close()

    async def run_background(self) -> None:
        """Weight watch, health checks and lease expiry until cancelled; a failure propagates."""
        await asyncio.gather(
            self._every(self.config.weight_poll_interval_s, self.poll_trainer),
            self._every(self.config.health_check_interval_s, self.pool.check),
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
        if not self.trainer_ready:
            return AllocateReply(False, reason="trainer_not_ready")
        if not self.pool.live():
            return AllocateReply(False, reason="no_server")
        adm = self.staleness.admit(self.version, f"{req.worker}#{req.incarnation}")
        if adm is None:
            return AllocateReply(False, reason=self.staleness.refusal(self.version) or "capacity")
        return AllocateReply(True, adm.rollout_id, adm.version, adm.deadline)

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        """The server for the next chunk of ``req.rollout_id``.

        A server in the middle of a weight update is paused anyway, so the answer waits for
        the update and reports the new version: a chunk is then recorded with the version
        that generates it.
        """
        for _ in range(8):
            self.staleness.get(req.rollout_id)  # raises RolloutNotRunning
            server = self.pool.pick(req)
            updating = server.updating
            if updating is None:
                self.pool.assign(server, req)
                return ScheduleReply(server.url, server.version)
            await asyncio.wait_for(
                asyncio.shield(updating.wait()), 3 * self.config.weight_update_timeout_s
            )
        raise NoServerAvailable(
            f"rollout {req.rollout_id}: the servers kept updating weights while scheduling"
        )

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
        if not await self.pool.healthy(s.url):
            self.pool.mark_dead(
                s, f"reported by a rollout worker ({report.error}) and failed a health check"
            )
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
            "servers": {u: s.summary() for u, s in self.servers.items()},
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
                logger.warning(
                    f"rollout worker {worker} restarted: released {len(released)} rollouts of its previous process"
                )
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

    # ---- the trainer ------------------------------------------------------------

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
            await self.pool.update_weights(self.trainer_version)

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

    # What _exit_hook touches, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way.
    manager: Optional[GserverManager] = None
    service: Optional[ManagerService] = None
    _key: Optional[str] = None

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
        # Admission starts once the trainer says where it starts (names.trainer_start):
        # a resumed trainer has trained samples already, and indices must continue there.
        manager.trainer_ready = False
        self.manager = manager
        self.state_path = config.state_path or os.path.join(
            constants.run_dir(), "gserver_manager_state.json"
        )
        self._trainer_deadline = time.monotonic() + config.server_wait_timeout_s
        host = config.host or network.gethostip()
        self.service = ManagerService(manager, host, config.port).start(
            config.server_wait_timeout_s + 60
        )
        self._key = names.gen_server_manager(exp, trial)
        name_resolve.add(
            self._key, self.service.address, keepalive_ttl=self.status_ttl, replace=True
        )
        self._next_save = time.monotonic() + config.state_save_interval_s
        self._next_status_check = 0.0
        self.logger.info(f"gserver manager at {self.service.url}")

    def _poll(self) -> PollResult:
        self.service.check()  # re-raises a failure of the background loops (e.g. a weight update)
        now = time.monotonic()
        if not self.manager.trainer_ready and now >= self._next_status_check:
            self._wait_for_trainer(now)
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

    def _wait_for_trainer(self, now: float) -> None:
        key = names.trainer_start(self.experiment_name, self.trial_name)
        try:
            start = json.loads(name_resolve.get(key))
        except name_resolve.NameEntryNotFoundError:
            if now > self._trainer_deadline:
                raise TimeoutError(
                    f"gserver manager: the trainer did not announce its start ({key!r}) within "
                    f"{self.config.server_wait_timeout_s:g}s; check the master_worker and "
                    "model_worker logs"
                ) from None
            return
        trained = int(start["trained_samples"])
        state = None
        # The saved counters belong to this run only when the trainer resumed it; a fresh
        # run (maybe with another batch size) starts them anew and overwrites the file.
        if start.get("checkpoint") and os.path.exists(self.state_path):
            with open(self.state_path) as f:
                state = json.load(f)

        def begin():
            m = self.manager
            if state is not None or trained > 0:
                m.load_state_dict(state or m.state_dict(), trained)
            m.trainer_ready = True

        self.service.call(begin)
        self.logger.info(
            f"the trainer starts at {trained} trained samples, version {start['version']}"
            + (f" (resumed from {start['checkpoint']})" if start.get("checkpoint") else "")
            + (f"; counters of {self.state_path} restored" if state else "")
            + "; admitting rollouts"
        )

    def _save_state(self) -> None:
        # Until the trainer's start is read the counters are fresh zeros, not this run's:
        # saving them would overwrite the file a resumed run is about to restore from
        # (a trainer that takes longer than one save interval to start is normal).
        if not self.manager.trainer_ready:
            return
        path = self.state_path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        state = self.service.call(self.manager.state_dict)
        write_json_atomic(path, state)

    def _exit_hook(self) -> None:
        # Each resource is None until built (class attributes above).
        if self.service is None:
            return
        try:
            self._save_state()
        finally:
            self.service.stop()
            if self._key is not None:
                try:
                    name_resolve.delete(self._key)
                except Exception:  # expired or cleared with the trial
                    pass
