"""Faults a worker injects into itself, for reliability tests: named per worker in
``$REALHF_FAULTS``.

The fault matrix (``benchmark/fault_matrix.py``, ``tests/reliability/``) starts a real run with
this variable set; the launcher passes the environment to every worker, and a worker looks
up its own faults by name.  Unset (the normal case), nothing here is active and nothing is
wrapped.

Format: comma-separated ``worker_name:fault=value`` items, e.g.::

    REALHF_FAULTS="generation_server/0:slow_generate=2.5,generation_server/1:fail_update=2"

Faults of a generation server's HTTP app (:func:`wrap_asgi`):

``slow_generate=S``   every ``/generate`` answer is delayed by ``S`` seconds
``drop_generate=N``   every ``N``-th ``/generate`` call is cut off mid-response: the
                      status line goes out, then the connection is closed without a body
``fail_update=N``     the first ``N`` weight loads (``/update_weights_from_disk``,
                      ``_shm`` or ``_broadcast``) answer 500 ``{"success": false}`` and
                      leave the weights as they were
``slow_update=S``     every weight load waits ``S`` seconds before it runs (a slow receiver;
                      the server logs ``injected fault: update N delayed``, which a harness
                      can strike on: the server is then paused, mid-update)

Faults of the master worker:

``slow_checkpoint=S`` every recover checkpoint stays ``S`` seconds in its ``.tmp`` state
                      (written, not committed), so a harness can strike "during a checkpoint"
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Awaitable, Callable, Dict

from realhf.base import logging

logger = logging.getLogger("faults")

__all__ = ["ENV", "KNOWN", "parse", "faults_of", "wrap_asgi", "InjectedDisconnect"]

ENV = "REALHF_FAULTS"
#: fault name -> what it does (for messages)
KNOWN = {
    "slow_generate": "delay each /generate answer by this many seconds",
    "drop_generate": "cut off every N-th /generate answer mid-response",
    "fail_update": "fail the first N weight loads (/update_weights_from_*) with HTTP 500",
    "slow_update": "delay each weight load (/update_weights_from_*) by this many seconds",
    "slow_checkpoint": "hold each recover checkpoint this many seconds before committing it",
}


def parse(spec: str) -> Dict[str, Dict[str, float]]:
    """``"w:fault=v,..."`` -> ``{worker: {fault: value}}``; raises ValueError naming a bad item."""
    out: Dict[str, Dict[str, float]] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        worker, sep, rest = item.rpartition(":")
        name, eq, value = rest.partition("=")
        if not sep or not eq or not worker:
            raise ValueError(f"{ENV}: {item!r} is not of the form 'worker_type/index:fault=value'")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown fault {name!r} in {item!r}; known: {sorted(KNOWN)}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"{ENV}: {item!r}: {value!r} is not a number") from None
        if v < 0 or (not name.startswith("slow_") and v != int(v)):
            raise ValueError(f"{ENV}: {item!r}: use a number >= 0 (a count for {name})")
        out.setdefault(worker, {})[name] = v
    return out


def faults_of(worker_name: str) -> Dict[str, float]:
    """The faults ``$REALHF_FAULTS`` gives ``worker_name`` (empty when unset)."""
    spec = os.environ.get(ENV, "")
    return parse(spec).get(worker_name, {}) if spec else {}


class InjectedDisconnect(ConnectionError):
    """Raised inside the app's send to cut a response off (the server closes the socket)."""


#: the weight-update protocol's load steps (realhf.impl.model.gen.weight_update.LOAD_STEPS)
_LOAD_ROUTES = (
    "/update_weights_from_disk",
    "/update_weights_from_shm",
    "/update_weights_from_broadcast",
)

ASGIApp = Callable[[Dict, Callable[[], Awaitable[Dict]], Callable[[Dict], Awaitable[None]]], Any]


def wrap_asgi(app: ASGIApp, faults: Dict[str, float], who: str = "server") -> ASGIApp:
    """``app`` with ``faults`` (see the module docstring); ``app`` itself when there are none."""
    if not faults:
        return app
    logger.warning(f"{who}: injecting faults {faults} ({ENV})")
    counts = {"generate": 0, "update": 0}

    async def wrapped(scope, receive, send):
        path = scope.get("path", "") if scope.get("type") == "http" else ""
        if path in _LOAD_ROUTES:
            counts["update"] += 1
            if counts["update"] <= faults.get("fail_update", 0):
                await _answer_500(send, f"injected fault: update {counts['update']} fails")
                return
            delay = faults.get("slow_update", 0.0)
            if delay:
                logger.warning(
                    f"{who}: injected fault: update {counts['update']} delayed {delay:g}s"
                )
                await asyncio.sleep(delay)
        if path != "/generate":
            await app(scope, receive, send)
            return
        counts["generate"] += 1
        drop_every = int(faults.get("drop_generate", 0))
        drop = drop_every > 0 and counts["generate"] % drop_every == 0
        delay = faults.get("slow_generate", 0.0)

        async def faulty_send(message):
            if message["type"] == "http.response.start" and delay:
                await asyncio.sleep(delay)
            await send(message)
            if message["type"] == "http.response.start" and drop:
                raise InjectedDisconnect(f"{who}: injected fault: response cut off")

        await app(scope, receive, faulty_send)

    return wrapped


async def _answer_500(send, message: str) -> None:
    body = json.dumps({"success": False, "message": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})
