"""The remote inference engine: generation servers over HTTP, driven by realhf's own pieces.

Nothing here is a second copy of a mechanism of the worker system:

- generation goes through :class:`~realhf.system.rollout.partial_rollout.PartialRolloutManager`
  (chunks of ``new_tokens_per_chunk`` tokens, a chunk cut by a weight update resumed with
  everything generated so far, log-probs and the weight version of each chunk);
- routing, health checks and weight updates are the gserver manager's
  :class:`~realhf.system.rollout.manager.server_pool.ServerPool`, over a fixed list of URLs:
  the same routing policies (:mod:`realhf.system.rollout.manager.routing`) and the same
  weight-update protocol (:mod:`realhf.impl.model.gen.weight_update`).

So a weight update (:meth:`RemoteInferenceEngine.update_weights`) pauses every server, loads
the new directory and continues it, each step bounded by ``weight_update_timeout_s``; a chunk
scheduled meanwhile waits for its server's update and is recorded with the new version; a
server that fails a step is taken out of service (and rejoins at the current version), one that
cannot be reached is dropped, and the update raises
:class:`~realhf.impl.model.gen.weight_update.WeightUpdateError` only when no server is left.

The pool lives on an event loop of its own, in a daemon thread: :meth:`agenerate` runs on the
caller's loop (a ``WorkflowExecutor``'s) and :meth:`update_weights` on the training thread, and
both reach the pool through that one loop, as asyncio objects must.  The servers speak the
SGLang-compatible protocol (our built-in engine's, the vLLM adapter's, or SGLang's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import Any, Coroutine, Dict, Optional, Sequence, TypeVar

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from realhf.api.core.rollout_api import (
    GenerateGroupRequest,
    GroupGeneration,
    ScheduleReply,
    ScheduleRequest,
)
from realhf.api.core.rollout_config import GserverManagerConfig, SchedulePolicy, WeightSync
from realhf.base import logging
from realhf.system.rollout.manager.server_pool import ServerPool
from realhf.system.rollout.partial_rollout import PartialRolloutManager

__all__ = ["RemoteInferenceEngine"]

logger = logging.getLogger("remote_engine")

T = TypeVar("T")


class RemoteInferenceEngine(InferenceEngine):
    """See the module docstring.

    Args:
        urls: ``http://host:port`` of each generation server.
        new_tokens_per_chunk: tokens per generate call.
        request_timeout_s: limit of each generate call.
        seed: sampling seeds derive from it (None: unseeded).
        stop_token_ids: stop tokens added to every request (EOS and pad).
        schedule_policy: ``round_robin``, ``least_requests`` or ``least_token_usage``.
        weight_update_timeout_s: limit of each server call of a weight update.
        server_wait_timeout_s: how long to wait for every server to answer ``/health``.
        health_check_interval_s: how often the servers are checked (a dead one is dropped).
    """

    def __init__(
        self,
        urls: Sequence[str],
        new_tokens_per_chunk: int = 1024,
        request_timeout_s: float = 600.0,
        seed=None,
        stop_token_ids=(),
        *,
        schedule_policy: SchedulePolicy | str = SchedulePolicy.LEAST_REQUESTS,
        weight_update_timeout_s: float = 300.0,
        server_wait_timeout_s: float = 120.0,
        health_check_interval_s: float = 1.0,
        weight_sync: WeightSync | str = WeightSync.DISK,
    ):
        urls = list(urls)
        if not urls:
            raise ValueError("RemoteInferenceEngine needs at least one server URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"RemoteInferenceEngine: a server URL is listed twice: {urls}")
        self.config = GserverManagerConfig(
            n_servers=len(urls),
            schedule_policy=schedule_policy,
            weight_update_timeout_s=weight_update_timeout_s,
            server_wait_timeout_s=server_wait_timeout_s,
            health_check_interval_s=health_check_interval_s,
            keep_weight_versions=None,  # the caller owns its weight directories
            weight_sync=weight_sync,
        )
        # Built (and its arguments checked) before anything starts.
        self.partial = PartialRolloutManager(
            self,  # schedule() and report_failure() below stand in for the manager's client
            new_tokens_per_chunk=new_tokens_per_chunk,
            request_timeout_s=request_timeout_s,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )
        self._rids = itertools.count(1)
        #: version -> the directory it was loaded from (a server that rejoins loads it)
        self._paths: Dict[int, str] = {}
        self.pool = ServerPool(self.config, lambda: list(urls), self._paths.__getitem__)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="remote-engine-pool", daemon=True
        )
        self._thread.start()
        self._watch: Optional[asyncio.Task] = None
        try:
            self._call(self._open(), server_wait_timeout_s + 30, "the servers to answer /health")
        except BaseException:
            self.close()  # the pool's HTTP session and loop thread end with the failed start
            raise

    @classmethod
    def from_config(
        cls, urls: Sequence[str], config: InferenceEngineConfig, **kwargs: Any
    ) -> "RemoteInferenceEngine":
        """An engine whose generate calls follow ``config`` (``new_tokens_per_chunk``,
        ``request_timeout_s``; its other fields are the ``WorkflowExecutor``'s); ``kwargs``
        as in the constructor.  A script passes its config here, so that no setting of it
        is dropped on the way (``request_timeout_s`` once was)."""
        kwargs.setdefault("weight_sync", config.weight_sync)
        return cls(
            urls,
            new_tokens_per_chunk=config.new_tokens_per_chunk,
            request_timeout_s=config.request_timeout_s,
            **kwargs,
        )

    @property
    def weight_sync(self) -> WeightSync:
        """How :meth:`update_weights` expects its ``path``: a HF directory (``disk``), a
        flat weight file in shared memory (``shm``) or the ``host:port`` of the trainer's
        weight sender (``broadcast``)."""
        return self.config.weight_sync

    @property
    def version(self) -> int:
        """The weight version every live server runs."""
        return self.pool.version

    async def agenerate(self, req: GenerateGroupRequest) -> GroupGeneration:
        return await self.partial.generate_group(f"lite-{next(self._rids)}", req)

    def update_weights(self, path: str, version: int) -> None:
        """Pause, load ``path`` (see :attr:`weight_sync`), continue every live server; they
        then run ``version``."""
        if version <= self.version:
            raise ValueError(
                f"update_weights: version {version} is not newer than the servers' "
                f"{self.version}; pass the trainer's step count (TrainEngine.version)"
            )
        self._paths[version] = path
        # Three bounded steps per server, all servers at once, after a rejoin that may hold
        # the pool's lock (one more update). On time-out the update is not cancelled: cut
        # between its steps it would leave servers paused; it finishes on its own.
        limit = 4 * self.config.weight_update_timeout_s + 30
        self._call(
            self.pool.update_weights(version), limit, f"the weight update to {version}", False
        )

    async def aclose(self) -> None:
        """Close what belongs to the calling loop (the generation requests' HTTP session);
        the engine stays usable from another loop.  :meth:`close` ends the engine."""
        await self.partial.close()

    def close(self) -> None:
        """Stop the health checks and the pool's loop; calls in flight fail with
        CancelledError and later ones at once (idempotent)."""
        if self._loop.is_running():
            try:
                self._call(self._shutdown(), 30, "the server pool to close")
            finally:
                self._stop_loop()

    # ---- what PartialRolloutManager asks of the gserver manager ------------------

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        async def pick() -> ScheduleReply:
            s = await self.pool.schedule(req)
            return ScheduleReply(s.url, s.version)  # read on the pool's loop: consistent

        return await asyncio.wrap_future(self._submit(pick()))

    async def report_failure(self, url: str, error: str) -> Dict[str, bool]:
        return {
            "dead": await asyncio.wrap_future(self._submit(self.pool.report_failure(url, error)))
        }

    # ---- the pool's loop -----------------------------------------------------------

    async def _open(self) -> None:
        await self.pool.open()
        await self.pool.wait_for_servers(self.config.n_servers, self.config.server_wait_timeout_s)
        self._watch = asyncio.get_running_loop().create_task(self._check_forever())

    async def _check_forever(self) -> None:
        # One failed round (a server answering garbage) must not end the health checks for
        # the engine's lifetime: log it and check again next interval.
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.pool.check()
            except Exception:
                logger.exception("RemoteInferenceEngine: a health check of the servers failed")

    async def _shutdown(self) -> None:
        # Cancel everything still running on the pool's loop (health checks, schedules
        # waiting for an update): their callers on other loops then fail instead of waiting
        # on a loop that will never run them.
        me = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not me:
                task.cancel()
        await self.pool.close()

    def _call(
        self, coro: Coroutine[None, None, T], timeout: float, what: str, cancel: bool = True
    ) -> T:
        fut = self._submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine's own TimeoutError (it names what it waited for)
                raise
            if cancel:
                fut.cancel()
            raise TimeoutError(f"RemoteInferenceEngine: waited {timeout:g}s for {what}") from None

    def _submit(self, coro: Coroutine[None, None, T]) -> "concurrent.futures.Future[T]":
        """Run ``coro`` on the pool's loop; RuntimeError once the engine is closed."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("RemoteInferenceEngine is closed (close() was called)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
