"""The gserver manager's logic: admits rollouts, routes generation requests, pushes new weights.

One per experiment.  :class:`GserverManager` is pure asyncio logic with its dependencies
passed in, so tests drive it against fakes of the trainer; :mod:`.service` serves it over HTTP
and :mod:`.worker` runs both as a worker.

Admission and hand-off follow :mod:`realhf.system.rollout.staleness` (exact per-sample bound).
Routing, health checks and weight updates of the servers live in :mod:`.server_pool`: when
the trainer's version (``names.model_version``) grows, every live server goes through the
weight-update protocol (:mod:`realhf.impl.model.gen.weight_update`) with the directory in
``constants.weight_publication_dir``; when no server is left live after one, the manager fails
with a ``WeightUpdateError`` naming each URL (the controller then stops the run).  Admission uses
the version all live servers run, which is never ahead of what generates the tokens.

Leases: every running rollout belongs to one rollout-worker process (name + incarnation).
Its heartbeats renew all its leases; after ``lease_ttl_s`` without one, or when a new
incarnation of the same worker appears, its rollouts are released and their slots freed.

Lost deliveries: an accepted index stays recorded with its owner until the trainer has
trained it.  When the trainer reports indices it keeps waiting for (``progress.missing()``)
and their owner is gone (released as above), the process died between taking the index and
delivering the trajectory: the index is reissued (:meth:`StalenessController.reissue`) and
the next accepted rollout fills it.  Should the original still arrive, the trainer keeps the
first copy and drops the other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Dict, List

from realhf.api.core.rollout_api import (
    AllocatedSlot,
    AllocateReply,
    AllocateRequest,
    FinishReply,
    FinishRequest,
    FinishStatus,
    HeartbeatReply,
    HeartbeatRequest,
    ScheduleReply,
    ScheduleRequest,
    ServerFailureReport,
)
from realhf.api.core.rollout_config import GserverManagerConfig
from realhf.base import logging
from realhf.system.rollout.manager.server_pool import ServerPool, ServerState
from realhf.system.rollout.staleness import StalenessController, TrainerProgress

logger = logging.getLogger("gserver_manager", "system")

__all__ = ["GserverManager", "RolloutOwner", "MAX_FINISH_WAIT_S"]

# Longest a /finish_rollout may be held by the manager, whatever the client asks.
MAX_FINISH_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class RolloutOwner:
    """Who a running rollout is leased to: one process (incarnation) of a rollout worker."""

    worker: str
    incarnation: str

    def __str__(self) -> str:
        return f"{self.worker}#{self.incarnation}"


@dataclasses.dataclass
class _Lease:
    """The latest incarnation seen of a rollout worker, and when its last message came."""

    owner: RolloutOwner
    last_seen: float


class GserverManager:
    """Admission, hand-off, leases and routing; see the module docstring.

    Args:
        config: the manager's settings.
        progress: where the trainer stands (version, trained samples).
        discover: returns the URLs registered by generation servers.
        weight_dir: where weight version ``v`` is published (see ``ServerPool``).
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
        #: worker name -> its current lease (one incarnation per worker at a time)
        self.owners: Dict[str, _Lease] = {}
        #: accepted index -> its owner, until the trainer has trained it
        self.delivering: Dict[int, RolloutOwner] = {}
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
        try:
            await self.pool.wait_for_servers(
                self.config.n_servers, self.config.server_wait_timeout_s
            )
        except TimeoutError as e:
            raise TimeoutError(f"gserver manager: {e}") from None
        await self.poll_trainer()
        logger.info(
            f"serving with {len(self.pool.live())} generation servers at version {self.version}"
        )

    async def close(self) -> None:
        await self.pool.close()

    async def run_background(self) -> None:
        """Weight watch, health checks and lease expiry until cancelled; a failure propagates."""
        await asyncio.gather(
            self._every(self.config.weight_poll_interval_s, self.poll_trainer),
            self._every(self.config.health_check_interval_s, self.pool.check),
            # A lease is released at most a quarter of its TTL (and at most 1 s) late.
            self._every(min(1.0, self.config.lease_ttl_s / 4), self._expire_async),
        )

    @staticmethod
    async def _every(interval: float, fn) -> None:
        while True:
            await fn()
            await asyncio.sleep(interval)

    # ---- rollout API ----------------------------------------------------------

    def allocate(self, req: AllocateRequest) -> AllocateReply:
        """Admit up to ``req.count`` rollouts, in order, while the concurrency cap and the
        staleness bound allow; the reply's reason says why the first refused one was."""
        self._touch(req.worker, req.incarnation)
        if not self.trainer_ready:
            return AllocateReply(False, reason="trainer_not_ready")
        if not self.pool.live():
            return AllocateReply(False, reason="no_server")
        owner = RolloutOwner(req.worker, req.incarnation)
        slots = []
        for _ in range(req.count):
            adm = self.staleness.admit(self.version, owner)
            if adm is None:
                break
            slots.append(AllocatedSlot(adm.rollout_id, adm.version, adm.deadline))
        reason = ""
        if len(slots) < req.count:
            reason = self.staleness.refusal(self.version) or "capacity"
        if not slots:
            return AllocateReply(False, reason=reason)
        first = slots[0]
        return AllocateReply(
            True, first.rollout_id, first.version, first.deadline, reason, tuple(slots[1:])
        )

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        """The server for the next chunk of ``req.rollout_id`` (waits out a weight update of
        it: see :meth:`ServerPool.schedule`); the rollout must still be running."""
        server = await self.pool.schedule(
            req,
            still_wanted=lambda: self.staleness.get(req.rollout_id),  # RolloutNotRunning
        )
        return ScheduleReply(server.url, server.version)

    async def finish(self, req: FinishRequest) -> FinishReply:
        """Release (``accepted=False``) or hand on a finished rollout, holding it if needed."""
        if not req.accepted:
            self.staleness.reject(req.rollout_id, "filtered")
            self._notify()
            return FinishReply(FinishStatus.REJECTED)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(req.wait_s, MAX_FINISH_WAIT_S))
        while True:
            # Take the event before trying: a change between the try and the wait then
            # still wakes this request instead of being missed.
            changed = self._changed
            owner = self.staleness.get(req.rollout_id).owner  # raises RolloutNotRunning
            index = self.staleness.accept(req.rollout_id)
            if index is not None:
                self.delivering[index] = owner
                self._notify()
                return FinishReply(FinishStatus.ACCEPTED, index)
            left = deadline - loop.time()
            if left <= 0:
                return FinishReply(FinishStatus.WAIT)
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def heartbeat(self, req: HeartbeatRequest) -> HeartbeatReply:
        self._touch(req.worker, req.incarnation)
        return HeartbeatReply(
            len(self.staleness.owned_by(RolloutOwner(req.worker, req.incarnation)))
        )

    async def report_failure(self, report: ServerFailureReport) -> Dict[str, bool]:
        """A client could not use ``report.url``: probe it now, drop it if it is gone."""
        return {"dead": await self.pool.report_failure(report.url, report.error)}

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
            "holes": st.holes,
            "capacity": st.capacity(self.version),
            "stats": dict(st.stats),
            "owners": {w: lease.owner.incarnation for w, lease in self.owners.items()},
            "servers": {u: s.summary() for u, s in self.servers.items()},
        }

    def _notify(self) -> None:
        # Wake every held /finish_rollout: the set of running rollouts changed.  Replaced
        # rather than cleared, so each waiter keeps the event it took (see finish()).
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- leases ---------------------------------------------------------------

    def _touch(self, worker: str, incarnation: str) -> None:
        owner = RolloutOwner(worker, incarnation)
        cur = self.owners.get(worker)
        if cur is not None and cur.owner != owner:
            # A new process of the same worker: the old one is gone, and so are its rollouts.
            released = self.staleness.release_owner(cur.owner)
            if released:
                logger.warning(
                    f"rollout worker {worker} restarted: released {len(released)} rollouts "
                    "of its previous process"
                )
                self._notify()
        self.owners[worker] = _Lease(owner, self.clock())

    def expire_leases(self) -> List[str]:
        """Release the rollouts of workers whose heartbeats stopped; returns their ids."""
        now, released = self.clock(), []
        for worker, lease in list(self.owners.items()):
            if now - lease.last_seen > self.config.lease_ttl_s:
                ids = self.staleness.release_owner(lease.owner, "expired")
                del self.owners[worker]
                logger.warning(
                    f"rollout worker {worker} sent no heartbeat for {now - lease.last_seen:.1f}s "
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
        missing = getattr(self.progress, "missing", None)
        if missing is not None:
            self.reissue_lost(await asyncio.to_thread(missing))
        if self.trainer_version > self.version:
            await self.pool.update_weights(self.trainer_version)

    def _owner_gone(self, owner: RolloutOwner) -> bool:
        lease = self.owners.get(owner.worker)
        return lease is None or lease.owner != owner

    def reissue_lost(self, missing: List[int]) -> List[int]:
        """Reissue the indices among ``missing`` whose owner is gone; returns them."""
        for k in [k for k in self.delivering if k < self.trained_samples]:
            del self.delivering[k]
        reissued = []
        for k in missing:
            owner = self.delivering.get(k)
            if owner is None or not self._owner_gone(owner):
                continue
            del self.delivering[k]
            if self.staleness.reissue(k):
                reissued.append(k)
        if reissued:
            logger.warning(
                f"the trainer waits for trajectories {reissued} whose rollout worker process "
                "is gone: their indices are reissued to the next accepted rollouts"
            )
            self._notify()
        return reissued

    # ---- recovery -------------------------------------------------------------

    def state_dict(self) -> Dict:
        return {"staleness": self.staleness.state_dict(), "version": self.version}

    def load_state_dict(self, state: Dict, trained_samples: int) -> None:
        """Resume counters at the trainer's ``trained_samples`` (see StalenessController)."""
        self.staleness.load_state_dict(state["staleness"], trained_samples)
