"""The rollout workers' client of the gserver manager's HTTP endpoints.

Every call has a timeout; its errors name the manager's URL and the endpoint.  The
endpoints and their messages are listed in :mod:`realhf.system.rollout.manager_service`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, Optional, Type, TypeVar

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
from realhf.base.http_server import CLIENT_KEEPALIVE_S
from realhf.system.rollout.server_pool import NoServerAvailable
from realhf.system.rollout.staleness import RolloutNotRunning

__all__ = ["ManagerUnavailable", "UncappedSession", "ManagerClient"]


class ManagerUnavailable(ConnectionError):
    """The gserver manager did not answer (in time)."""


R = TypeVar("R")


class UncappedSession:
    """A lazily created aiohttp session with no connection cap, closed by :meth:`close`.

    No cap because requests may be held open on purpose (held /finish_rollout calls,
    one generate request per running group member) and must never queue behind each other.
    """

    _session: Optional[aiohttp.ClientSession] = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
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
        try:
            req = (
                self.session.post(
                    self.url + path, json=msg.to_json(), timeout=aiohttp.ClientTimeout(total=t)
                )
                if msg is not None
                else self.session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=t))
            )
            async with req as r:
                status, text = r.status, await r.text()
        except asyncio.TimeoutError:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} did not answer {path} within {t:g}s"
            ) from None
        except aiohttp.ClientError as e:
            raise ManagerUnavailable(
                f"gserver manager at {self.url} could not be reached for {path}: {e!r}"
            ) from None
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

    async def allocate(self, worker: str, incarnation: str, qid: str = "") -> AllocateReply:
        return await self._call(
            "/allocate_rollout", AllocateRequest(worker, incarnation, qid), AllocateReply
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
