"""The rollout workers' client of the gserver manager's HTTP endpoints.

Every call has a timeout; its errors name the manager's URL and the endpoint.  The
endpoints and their messages are listed in :mod:`realhf.system.rollout.manager.service`.
A call the manager refused for load (503 with ``Retry-After``: it was not processed) is sent
again after a growing, jittered pause until the call's timeout, then fails as
:class:`ManagerUnavailable`.  Every request carries the run's token (the manager's routes and
the generation servers' want it; see :func:`~realhf.base.net.http_server.auth_headers`).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Dict, Optional, Tuple, Type, TypeVar

import aiohttp

from realhf.api.core.rollout_api import (
    AllocateReply,
    AllocateRequest,
    FinishReply,
    FinishRequest,
    HeartbeatReply,
    HeartbeatRequest,
    MessageError,
    ScheduleReply,
    ScheduleRequest,
    ServerFailureReport,
    parse_message,
)
from realhf.base.net.http_server import CLIENT_KEEPALIVE_S, auth_headers
from realhf.system.rollout.manager.routing import NoServerAvailable
from realhf.system.rollout.staleness import RolloutNotRunning

__all__ = ["ManagerUnavailable", "UncappedSession", "ManagerClient"]


class ManagerUnavailable(ConnectionError):
    """The gserver manager did not answer (in time), or stayed overloaded for the call's timeout."""


# Pauses between the tries of a call the manager refused for load: 50 ms doubling to 1 s.
_BUSY_FIRST_PAUSE_S = 0.05
_BUSY_MAX_PAUSE_S = 1.0


R = TypeVar("R")


class UncappedSession:
    """A lazily created aiohttp session with no connection cap, closed by :meth:`close`.

    No cap because requests may be held open on purpose (held /finish_rollout calls,
    one generate request per running group member) and must never queue behind each other.
    Its requests carry the run's token: the manager wants it, and so do the generation
    routes of a server that listens beyond loopback.
    """

    _session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=auth_headers())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class ManagerClient(UncappedSession):
    """Async client of the manager's endpoints (one aiohttp session; close it when done).

    Args:
        url: ``http://host:port`` of the manager.
        timeout_s: limit of each call (a held ``/finish_rollout`` gets its ``wait_s`` on top).
    """

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _call(
        self, path: str, msg: Any, reply_cls: Optional[Type[R]], timeout: Optional[float] = None
    ) -> R:
        t = timeout or self.timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        pause = _BUSY_FIRST_PAUSE_S
        while True:
            status, text, overloaded = await self._send(
                path, msg, max(0.001, deadline - loop.time()), t
            )
            if not overloaded:
                break
            left = deadline - loop.time()
            if left <= pause:
                raise ManagerUnavailable(
                    f"gserver manager at {self.url} refused {path} as overloaded for {t:g}s: "
                    f"{text[:300]}"
                )
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # jitter spreads the herd
            pause = min(_BUSY_MAX_PAUSE_S, 2 * pause)
        try:
            body = json.loads(text)
        except ValueError:
            body = {"error": {"message": text}}
        if status != 200:
            message = body.get("error", {}).get("message", text) if isinstance(body, dict) else text
            if status == 409:
                raise RolloutNotRunning(message)
            if status == 503:
                raise NoServerAvailable(message)
            if status == 401:
                raise PermissionError(
                    f"gserver manager at {self.url} refused {path}: {message}; this process "
                    "does not hold the run's secret (started outside the launcher?)"
                )
            raise RuntimeError(
                f"gserver manager at {self.url}: {path} answered HTTP {status}: {message}"
            )
        if reply_cls is None:
            return body
        try:
            return parse_message(reply_cls, body)
        except MessageError as e:
            raise RuntimeError(
                f"gserver manager at {self.url}: {path} answered a malformed reply: {e}"
            ) from None

    async def _send(self, path: str, msg: Any, left: float, t: float) -> Tuple[int, str, bool]:
        """One try: (status, body text, whether it was refused for load)."""
        timeout = aiohttp.ClientTimeout(total=left)
        try:
            req = (
                self.session.post(self.url + path, json=msg.to_json(), timeout=timeout)
                if msg is not None
                else self.session.get(self.url + path, timeout=timeout)
            )
            async with req as r:
                status, text = r.status, await r.text()
                overloaded = status == 503 and "Retry-After" in r.headers
        except asyncio.TimeoutError:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} did not answer {path} within {t:g}s"
            ) from None
        except aiohttp.ClientError as e:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} could not be reached for {path}: {e!r}"
            ) from None
        return status, text, overloaded

    async def allocate(
        self, worker: str, incarnation: str, qid: str = "", count: int = 1
    ) -> AllocateReply:
        return await self._call(
            "/allocate_rollout", AllocateRequest(worker, incarnation, qid, count), AllocateReply
        )

    async def schedule(self, req: ScheduleRequest) -> ScheduleReply:
        return await self._call("/schedule_request", req, ScheduleReply)

    async def finish(self, rollout_id: str, accepted: bool, wait_s: float = 10.0) -> FinishReply:
        return await self._call(
            "/finish_rollout",
            FinishRequest(rollout_id, accepted, float(wait_s)),
            FinishReply,
            timeout=self.timeout_s + wait_s,
        )

    async def heartbeat(self, worker: str, incarnation: str) -> HeartbeatReply:
        return await self._call("/heartbeat", HeartbeatRequest(worker, incarnation), HeartbeatReply)

    async def report_failure(self, url: str, error: str) -> Dict[str, bool]:
        return await self._call(
            "/report_server_failure", ServerFailureReport(url, error[:1000]), None
        )

    async def status(self) -> Dict[str, Any]:
        return await self._call("/status", None, None)
