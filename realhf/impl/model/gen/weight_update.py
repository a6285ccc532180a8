"""The weight-update protocol: how a generation server moves to new weights, both sides of it.

There is one implementation, and every path goes through it: the gserver manager's
:class:`~realhf.system.rollout.manager.server_pool.ServerPool` and areal's
``RemoteInferenceEngine`` (which drives the same pool) call :func:`update_server`; the built-in
engine's HTTP app and the vLLM adapter answer ``/generate`` through a :class:`PauseGate`.

**The client's sequence** (:func:`update_server`), per server, each call bounded by
``timeout_s``::

    POST /pause_generation                      running requests end now, reason ``abort``,
                                                with the tokens they made (old weights)
    POST /update_weights_from_<mode> {...}      body {"success": bool, "message": str}
    POST /continue_generation

The load step depends on how the trainer publishes the weights (``weight_sync``,
:data:`LOAD_STEPS`): ``disk`` loads a HuggingFace directory (``{model_path}``), ``shm`` maps
a flat weight file in shared memory (``{path, weight_version}``;
:mod:`realhf.impl.model.conversion.flat_file`) and refuses one of another version, and
``broadcast`` pulls the version from the trainer's weight sender (``{sender,
weight_version}``: its ``host:port``; :mod:`realhf.impl.model.comm.weight_broadcast`).

and only then is the server recorded at the new version.  While a server is between the first
and the last step the pool schedules nothing on it: a chunk that asks for it waits for the
update and is told the new version, so a chunk is recorded with the version that generates it.
A step that cannot reach the server, or answers 5xx while the server also fails ``/health``,
means the server is gone (:class:`ServerGone`: its replacement joins at the current version);
any other failure is a :class:`WeightUpdateError` naming the server, the step and the version
(the server may hold the old weights, or half of the new ones: it is sent
``/continue_generation`` once, so that it is not left gated, and taken out of service until an
update to the current version succeeds on it).  One answer is no failure: with
``broadcast`` the trainer keeps only its latest version, and a server that asks for an older
one (the trainer staged another between the client's poll and the pull) gets 409 with
``superseded_by``; the server, unchanged, is sent ``/continue_generation`` and
:class:`UpdateSuperseded` tells the client to update to the newer version instead.

**The server's rules** (:class:`PauseGate`), which make the record exact even for a request
that raced the pause (scheduled under the old version, arriving just after the pause):

1. while paused, a request is not run: it is answered at once as aborted with no tokens, and
   the client sends it again after the update;
2. a request during which a pause began keeps its tokens only if that one pause aborted it
   (they were all made before it).  One that was queued across the pause, or ran across a
   whole update, is answered as aborted with no tokens: some of them came from new weights.

So every token a server returns was made by the weights of the version the client was given
when it scheduled the request — on the built-in engine and the vLLM adapter, which apply the
gate.  SGLang's own server has no gate: a request that races the pause there can run on the new
weights under the old version (rule 1's window: between a schedule and the pause).

**Who may ask.** The three steps are control routes: the client sends the run's token
(:func:`~realhf.base.net.http_server.auth_headers`) and a server answers 401 without it.  A
server loads only directories under its publication root (:func:`allowed_weight_path`; in a
run :func:`~realhf.base.constants.weight_publication_root`): even a holder of the token cannot
make it read, say, another user's checkpoint it happens to be able to read.  Flat files
(``shm``) likewise load only from under the run's directory in shared memory
(:func:`~realhf.base.constants.weight_shm_root`).  A pull (``broadcast``) needs no such
bound: the sender's answer and every bucket of weights carry MACs under the run's secret,
so a server takes weights from the run's trainer only.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Awaitable, Callable, Optional, Tuple

import aiohttp

from realhf.api.core.gen_api import (
    FinishReason,
    FinishType,
    GenerateOutput,
    InvalidRequestError,
)
from realhf.api.core.rollout_config import WeightSync
from realhf.base.net.http_server import auth_headers

__all__ = [
    "LOAD_STEPS",
    "update_steps",
    "WeightUpdateError",
    "UpdateSuperseded",
    "ServerGone",
    "WeightPathRefused",
    "update_server",
    "allowed_weight_path",
    "versioned_load_body",
    "PauseGate",
]

#: The load step's route for each ``weight_sync`` mode (how the trainer publishes).
LOAD_STEPS = {
    WeightSync.DISK: "update_weights_from_disk",
    WeightSync.SHM: "update_weights_from_shm",
    WeightSync.BROADCAST: "update_weights_from_broadcast",
}


def update_steps(mode: WeightSync | str = WeightSync.DISK):
    """The protocol's HTTP steps in order for ``mode``: (route, whether its JSON body
    reports ``success``)."""
    load = LOAD_STEPS[WeightSync(mode)]
    # The load step's body says {"success": bool, "message": ...}: a 200 alone is not trusted.
    return (("pause_generation", False), (load, True), ("continue_generation", False))


def _load_body(step: str, path: str, version: int) -> dict:
    if step == LOAD_STEPS[WeightSync.SHM]:
        return {"path": path, "weight_version": version}
    if step == LOAD_STEPS[WeightSync.BROADCAST]:
        return {"sender": path, "weight_version": version}
    if step == LOAD_STEPS[WeightSync.DISK]:
        return {"model_path": path}
    return {}


def versioned_load_body(body: object, field: str, example: str) -> Tuple[str, int]:
    """``body[field]`` (a string) and ``body["weight_version"]`` (an int) of a load request
    that must hold exactly these two; InvalidRequestError otherwise."""
    version = body.get("weight_version") if isinstance(body, dict) else None
    if (
        not isinstance(body, dict)
        or not isinstance(body.get(field), str)
        or not isinstance(version, int)
        or isinstance(version, bool)
    ):
        raise InvalidRequestError(f'send {{"{field}": "{example}", "weight_version": <int>}}')
    extra = set(body) - {field, "weight_version"}
    if extra:
        raise InvalidRequestError(f"unknown fields {sorted(extra)}")
    return body[field], version


class WeightUpdateError(RuntimeError):
    """A generation server failed (or timed out on) a step of a weight update."""

    def __init__(self, url: str, step: str, version: int, detail: str):
        self.url, self.step, self.version = url, step, version
        super().__init__(
            f"weight update to version {version} failed on generation server {url}: "
            f"POST /{step} {detail}"
        )


class UpdateSuperseded(Exception):
    """The trainer no longer holds ``version``, only ``newer``: the server's weights are
    unchanged (it serves again), and the update goes on to ``newer``."""

    def __init__(self, url: str, version: int, newer: int):
        self.url, self.version, self.newer = url, version, newer
        super().__init__(
            f"generation server {url}: weight version {version} was superseded by {newer} "
            "before the server pulled it"
        )


class ServerGone(Exception):
    """A server cannot be reached at all during an update (it died)."""


class WeightPathRefused(ValueError):
    """A weight update named a directory outside the server's publication root (HTTP 403)."""


def allowed_weight_path(model_path: str, root: Optional[str]) -> str:
    """``model_path`` with every symlink resolved, if it lies under ``root``; else
    :class:`WeightPathRefused` naming the root.

    Both sides are resolved first, so neither ``..`` nor a symlink inside the root that
    points elsewhere gets out; the caller loads the resolved path, so a link swapped after
    the check changes nothing.  ``root`` None: the server takes no weight updates at all.
    """
    if not root:
        raise WeightPathRefused(
            "this server takes no weight updates: it was started without a publication "
            "directory (GenerationServerConfig.weights_root, `realhf.apps.serve --weights-root`)"
        )
    if "\0" in model_path:  # realpath would raise ValueError on it
        raise WeightPathRefused(f"model_path {model_path!r} is no path: it holds a NUL byte")
    real_root = os.path.realpath(root)
    real = os.path.realpath(model_path) if model_path else ""
    if not real or os.path.commonpath([real, real_root]) != real_root:
        raise WeightPathRefused(
            f"model_path {model_path!r} is outside this server's publication directory "
            f"{real_root!r} (after resolving symlinks: {real!r}); publish the weights under "
            "it (in a run: constants.weight_publication_dir)"
        )
    return real


async def update_server(
    session: aiohttp.ClientSession,
    url: str,
    version: int,
    path: str,
    timeout_s: float,
    healthy: Callable[[str], Awaitable[bool]],
    mode: WeightSync | str = WeightSync.DISK,
) -> None:
    """Pause -> load ``path`` -> continue on the server at ``url`` (see the module docstring);
    ``path`` is what ``mode`` publishes (a HF directory, a flat file).

    ``healthy(url)`` probes ``/health``: it tells a dead server (:class:`ServerGone`) from
    one that refused a step (:class:`WeightUpdateError`).  A server that fails a step after
    it paused is sent ``/continue_generation`` once, best effort, before the error is raised:
    its weights are unknown, so its pool takes it out of service, but it must not stay gated
    (every ``/generate`` refused) when it rejoins.
    """
    paused = False
    try:
        for step, reports_success in update_steps(mode):
            await _step(session, url, version, path, timeout_s, healthy, step, reports_success)
            paused = True
    except (WeightUpdateError, UpdateSuperseded):
        if paused:
            await _continue_quietly(session, url, timeout_s)
        raise


async def _continue_quietly(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    try:
        async with session.post(
            f"{url}/continue_generation",
            json={},
            headers=auth_headers(),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        pass  # the error being raised says what went wrong; this was only a courtesy


async def _step(
    session: aiohttp.ClientSession,
    url: str,
    version: int,
    path: str,
    timeout_s: float,
    healthy: Callable[[str], Awaitable[bool]],
    step: str,
    reports_success: bool,
) -> None:
    """One POST of the protocol; raises WeightUpdateError or ServerGone."""
    body = _load_body(step, path, version)
    try:
        async with session.post(
            f"{url}/{step}",
            json=body,
            headers=auth_headers(),  # control routes answer 401 without the run's token
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            status, text = r.status, await r.text()
    except asyncio.TimeoutError:
        why = f"did not answer within {timeout_s:g}s (weight_update_timeout_s)"
        raise WeightUpdateError(url, step, version, why) from None
    except aiohttp.ClientConnectionError as e:
        if not await healthy(url):
            raise ServerGone(url) from e
        raise WeightUpdateError(url, step, version, f"failed: {e!r}") from e
    except aiohttp.ClientError as e:  # e.g. a reply cut off mid-body
        raise WeightUpdateError(url, step, version, f"failed: {e!r}") from e
    ok = status == 200
    if reports_success and status in (200, 409):
        try:
            answer = json.loads(text)
            ok = ok and bool(answer.get("success", True))
            newer = answer.get("superseded_by")
        except (ValueError, AttributeError):
            newer = None
        if status == 409 and isinstance(newer, int) and newer > version:
            raise UpdateSuperseded(url, version, newer)
    if not ok:
        # A server in front of an engine that died (the vLLM adapter) still answers,
        # with an error; if it also fails its health check it is gone, as a server
        # that cannot be reached is: its replacement joins at the current version.
        if status >= 500 and not await healthy(url):
            raise ServerGone(url)
        raise WeightUpdateError(url, step, version, f"answered HTTP {status}: {text[:500]}")


class PauseGate:
    """A server's side of the protocol: which ``/generate`` answers may keep their tokens.

    Use on the server's event loop::

        ticket = gate.ticket()          # None while paused: answer gate.refused(...)
        out = ...run the request...
        out = gate.checked(ticket, out)  # emptied if a pause overlapped it (rule 2)

    and call :meth:`pause` before the engine pauses, :meth:`resume` once it serves again.
    """

    def __init__(self):
        self.paused = False
        #: pauses so far; a ticket is this count when the request was admitted
        self.pauses = 0
        #: answers emptied by rule 2 (exported for tests and metrics)
        self.discarded = 0

    def pause(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume(self) -> None:
        self.paused = False

    def ticket(self) -> Optional[int]:
        """The admission ticket of a new request, or None while paused (rule 1)."""
        return None if self.paused else self.pauses

    def keeps(self, ticket: int, finish: FinishType | str) -> bool:
        """Whether a request admitted with ``ticket`` that ended with ``finish`` keeps its
        tokens (rule 2)."""
        seen = self.pauses - ticket
        return seen == 0 or (seen == 1 and finish == FinishType.ABORT)

    def checked(self, ticket: int, out: GenerateOutput) -> GenerateOutput:
        """``out``, or the same request answered as aborted with no tokens (rule 2)."""
        if self.keeps(ticket, out.finish_reason.type):
            return out
        self.discarded += 1
        return self.refused(out.rid, out.prompt_len, "overlapped a weight update; tokens discarded")

    @staticmethod
    def refused(
        rid: str, prompt_len: int, why: str = "the server is paused for a weight update"
    ) -> GenerateOutput:
        """An aborted answer with no tokens (the client sends the request again)."""
        return GenerateOutput(
            rid=rid,
            prompt_len=prompt_len,
            output_ids=(),
            output_logprobs=(),
            finish_reason=FinishReason("abort", message=why),
        )
