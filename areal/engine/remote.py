"""The remote inference engine: generation servers over HTTP, through realhf's client.

Generation goes through :class:`~realhf.system.rollout.partial_rollout.PartialRolloutManager`
exactly as in the worker system (chunks of ``new_tokens_per_chunk`` tokens, a chunk cut by a
weight update resumed with everything generated so far, logprobs and the weight version of
each chunk), with :class:`StaticServers` standing in for the gserver manager: it picks the
least-loaded of a fixed list of servers and reports their current weight version.  The
servers speak the SGLang-compatible protocol (our built-in engine's, or SGLang's).

A weight update (:meth:`RemoteInferenceEngine.update_weights`) pauses every server (running
requests are aborted and resume in their next chunk), loads the new directory
(``/update_weights_from_disk``), sets the version, and continues.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import requests

from areal.api.engine_api import InferenceEngine
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration, ScheduleReply
from realhf.system.rollout.partial_rollout import PartialRolloutManager

__all__ = ["RemoteInferenceEngine", "StaticServers"]


class StaticServers:
    """The gserver manager's ``schedule`` / ``report_failure`` over a fixed server list."""

    def __init__(self, urls: Sequence[str]):
        if not urls:
            raise ValueError("RemoteInferenceEngine needs at least one server URL")
        self.urls = list(urls)
        self.version = 0
        self.load: collections.Counter = collections.Counter()

    async def schedule(self, req) -> ScheduleReply:
        url = min(self.urls, key=lambda u: self.load[u])
        self.load[url] += 1
        return ScheduleReply(url=url, version=self.version)

    async def report_failure(self, url: str, error: str) -> dict:
        raise RuntimeError(f"generation server {url} failed: {error}")


class RemoteInferenceEngine(InferenceEngine):
    """See the module docstring.

    Args:
        urls: ``http://host:port`` of each generation server.
        new_tokens_per_chunk: tokens per generate call.
        request_timeout_s: limit of each generate call.
        seed: sampling seeds derive from it (None: unseeded).
    """

    def __init__(
        self,
        urls: Sequence[str],
        new_tokens_per_chunk: int = 1024,
        request_timeout_s: float = 600.0,
        seed=None,
        stop_token_ids=(),
    ):
        self.servers = StaticServers(urls)
        self.partial = PartialRolloutManager(
            self.servers,
            new_tokens_per_chunk=new_tokens_per_chunk,
            request_timeout_s=request_timeout_s,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )
        self.request_timeout_s = request_timeout_s
        self._rid = 0
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.servers.version

    async def agenerate(self, req: GenerateGroupRequest) -> GroupGeneration:
        with self._lock:
            self._rid += 1
            rid = f"lite-{self._rid}"
        return await self.partial.generate_group(rid, req)

    def update_weights(self, path: str, version: int) -> None:
        """Pause, load ``path``, set ``version``, continue (every server)."""
        t = self.request_timeout_s
        for u in self.servers.urls:
            requests.post(f"{u}/pause_generation", timeout=t).raise_for_status()
        try:
            for u in self.servers.urls:
                r = requests.post(
                    f"{u}/update_weights_from_disk", json={"model_path": path}, timeout=t
                )
                if r.status_code != 200 or not r.json().get("success"):
                    raise RuntimeError(f"{u} could not load {path}: {r.text[:500]}")
            self.servers.version = version
        finally:
            for u in self.servers.urls:
                requests.post(f"{u}/continue_generation", timeout=t).raise_for_status()

    async def aclose(self) -> None:
        await self.partial.close()
