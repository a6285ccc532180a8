"""Interruptible generation: a group of answers, each generated chunk by chunk.

Every member of a group is an independent ``n = 1`` sequence; the members still running go
to the server together.  For each round the manager picks a server (``/schedule_request``
for the round's ``n_sequences``; a continuation goes back to its previous server when that
server's weight version is unchanged) and the round is one batched SGLang ``/generate``
call: one prompt per member (the prompt plus its answer so far), each for at most
``new_tokens_per_chunk`` tokens with its own sampling seed.  A member whose chunk ends with
``length`` below its budget, or with ``abort`` (the manager paused the server for a weight
update), is in the next round with everything generated so far appended to its prompt;
tokens and logprobs of all its chunks are concatenated.  ``version_start`` is the version of
a member's first chunk's server, ``version_end`` that of its last one.  One call per round
rather than one per member is what keeps the manager's and the server's request handling
small beside the model's work (a group of 8 used to cost 8 schedules and 8 HTTP requests).

A server that cannot be reached, times out or answers 5xx is reported to the manager and the
round goes to another server (at most ``max_server_failures`` failures in a row per
rollout; a round that succeeds resets the count); a 4xx answer
is a bad request and fails the rollout at once with the server's message; a 503 with
``Retry-After`` (the server is at its ``max_concurrent_requests``) is asked again after the
pause, without counting as a failure.  While no server
is live at all (the only one died and is being restarted) a round waits up to
``no_server_wait_s`` for one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
from typing import Dict, Iterable, List, Optional, Tuple

import aiohttp

from realhf.api.core.gen_api import FinishType, parse_sglang_output
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration, ScheduleRequest
from realhf.base import logging, seeding
from realhf.system.rollout.manager.client import ManagerClient, UncappedSession
from realhf.system.rollout.manager.routing import NoServerAvailable

logger = logging.getLogger("partial_rollout", "system")

__all__ = ["GenerationFailed", "MemberResult", "PartialRolloutManager"]

# Consecutive chunks aborted before their first token that a member survives.
_MAX_EMPTY_ABORTS = 50


class GenerationFailed(RuntimeError):
    """A sequence could not be generated (bad request, or too many server failures)."""


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """What one ``/generate`` call produced."""

    output_ids: Tuple[int, ...]
    output_logprobs: Tuple[float, ...]
    end: FinishType


@dataclasses.dataclass
class MemberResult:
    """One generated sequence of a group."""

    output_ids: List[int]
    output_logprobs: List[float]
    no_eos: bool
    version_start: int
    version_end: int
    n_chunks: int = 0
    n_interrupted: int = 0


class PartialRolloutManager(UncappedSession):
    """Generate groups through the manager's routing (see the module docstring).

    Args:
        client: the manager's client (schedules chunks, receives failure reports).
        new_tokens_per_chunk: most tokens per ``/generate`` call.
        request_timeout_s: limit of one ``/generate`` call.
        stop_token_ids: stop tokens added to every request (EOS and pad of the tokenizer).
        max_server_failures: failed calls in a row one member may survive.
        no_server_wait_s: how long a chunk waits while no server is live.
        seed: when set, every chunk gets a sampling seed derived from
            ``(seed, qid, member, offset)``, so a replay with the same chunking samples the
            same tokens.
    """

    def __init__(
        self,
        client: ManagerClient,
        *,
        new_tokens_per_chunk: int = 1 << 30,
        request_timeout_s: float = 3600.0,
        stop_token_ids: Iterable[int] = (),
        max_server_failures: int = 3,
        no_server_wait_s: float = 180.0,
        seed: Optional[int] = None,
    ):
        if not isinstance(new_tokens_per_chunk, int) or new_tokens_per_chunk < 1:
            raise ValueError(
                f"new_tokens_per_chunk={new_tokens_per_chunk!r} must be an integer >= 1"
            )
        self.client = client
        self.chunk = new_tokens_per_chunk
        self.request_timeout_s = request_timeout_s
        self.stop_token_ids = tuple(sorted(set(int(t) for t in stop_token_ids)))
        self.max_server_failures = max_server_failures
        self.no_server_wait_s = no_server_wait_s
        self.seed = seed
        self.stats: collections.Counter = collections.Counter()

    async def generate_group(self, rollout_id: str, req: GenerateGroupRequest) -> GroupGeneration:
        """All ``req.gconfig.n`` members of a group, generated together (see :meth:`generate`)."""
        members = await self.generate(rollout_id, req, range(req.gconfig.n))
        return GroupGeneration(
            qid=req.qid,
            prompt_ids=req.prompt_ids,
            output_ids=tuple(tuple(m.output_ids) for m in members),
            output_logprobs=tuple(tuple(m.output_logprobs) for m in members),
            no_eos=tuple(m.no_eos for m in members),
            version_start=tuple(m.version_start for m in members),
            version_end=tuple(m.version_end for m in members),
        )

    async def generate_member(
        self, rollout_id: str, req: GenerateGroupRequest, member: int
    ) -> MemberResult:
        """Member ``member`` of the group alone (its own calls)."""
        return (await self.generate(rollout_id, req, [member]))[0]

    def _base_params(self, req: GenerateGroupRequest) -> dict:
        """The sampling fields every chunk of ``req``'s members shares."""
        sp = req.gconfig.to_sampling_params()
        return {
            "n": 1,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "stop_token_ids": sorted(set(sp.stop_token_ids) | set(self.stop_token_ids)),
        }

    def _sampling_params(
        self, base: dict, req: GenerateGroupRequest, member: int, done: int, max_new: int
    ) -> dict:
        params = dict(
            base,
            max_new_tokens=max_new,
            min_new_tokens=min(max_new, max(0, req.gconfig.min_new_tokens - done)),
        )
        if self.seed is not None:
            params["sampling_seed"] = seeding.derive_seed(self.seed, f"{req.qid}/{member}/{done}")
        return params

    async def generate(
        self, rollout_id: str, req: GenerateGroupRequest, members: Iterable[int]
    ) -> List[MemberResult]:
        """The sequences ``members`` of the group, chunk by chunk, resubmitted after
        interruptions and server failures.

        The unfinished members travel together: each round is one ``/schedule_request`` and
        one batched ``/generate`` call (one prompt per member, each with its answer so far and
        its own sampling seed), so a group of ``n`` costs the manager and the server one
        request per round rather than ``n``.  Each member's tokens are exactly those it would
        get alone with the same chunking; a member that finishes leaves the next round.
        """
        budget = req.gconfig.max_new_tokens
        base = self._base_params(req)
        done: Dict[int, MemberResult] = {}
        running = {j: MemberResult([], [], False, -1, 0) for j in members}
        order = list(running)
        prev: Tuple[str, int] = ("", -1)
        exclude: List[str] = []
        failures = empty_aborts = 0
        overloaded_s = 0.0
        while running:
            todo = list(running.items())
            remaining = [budget - len(m.output_ids) for _, m in todo]
            sched = await self._schedule(
                ScheduleRequest(
                    rollout_id,
                    sum(len(req.prompt_ids) + len(m.output_ids) for _, m in todo),
                    sum(remaining),
                    prev[0],
                    prev[1],
                    tuple(exclude),
                    n_sequences=len(todo),
                )
            )
            body = {
                "input_ids": [list(req.prompt_ids) + m.output_ids for _, m in todo],
                "sampling_params": [
                    self._sampling_params(base, req, j, len(m.output_ids), min(self.chunk, left))
                    for (j, m), left in zip(todo, remaining)
                ],
                "return_logprob": True,
                "stream": False,
            }
            if req.image_data:  # every member reads the prompt's images
                body["image_data"] = [list(req.image_data)] * len(todo)
            try:
                outs = await self._generate(sched.url, body, len(todo))
            except _Overloaded as e:
                # Refused before it was processed: not a failure; ask again after a pause.
                overloaded_s += e.retry_after
                self.stats["overloaded"] += 1
                if overloaded_s > self.no_server_wait_s:
                    raise GenerationFailed(
                        f"rollout {rollout_id} ({req.qid!r}): the servers refused it as "
                        f"overloaded for {overloaded_s:.0f}s "
                        f"(no_server_wait_s={self.no_server_wait_s:g}): {e}"
                    ) from None
                await asyncio.sleep(e.retry_after)
                continue
            except _ServerFailure as e:
                failures += 1
                self.stats["server_failures"] += 1
                logger.warning(
                    f"rollout {rollout_id}: {e}; rescheduling "
                    f"({failures}/{self.max_server_failures})"
                )
                await self.client.report_failure(sched.url, str(e))
                if failures > self.max_server_failures:
                    raise GenerationFailed(
                        f"rollout {rollout_id} ({req.qid!r}): {failures} generation calls "
                        f"failed in a row, the last on {sched.url}: {e}"
                    ) from None
                exclude.append(sched.url)
                prev = ("", -1)
                continue
            exclude.clear()
            failures = 0
            self.stats["calls"] += 1
            progressed = False
            for (j, m), out in zip(todo, outs):
                self.stats["chunks"] += 1
                m.n_chunks += 1
                if m.version_start < 0:
                    m.version_start = sched.version
                m.version_end = sched.version
                m.output_ids += out.output_ids
                m.output_logprobs += out.output_logprobs
                progressed |= bool(out.output_ids) or out.end is not FinishType.ABORT
                if out.end is FinishType.STOP or len(m.output_ids) >= budget:
                    m.no_eos = out.end is not FinishType.STOP
                    done[j] = running.pop(j)
                elif out.end is FinishType.ABORT:
                    m.n_interrupted += 1
                    self.stats["interrupted"] += 1
            prev = (sched.url, sched.version)
            # Aborted before the first token again and again: back off, and give up rather
            # than spin if the server never lets the rollout run.
            empty_aborts = 0 if progressed else empty_aborts + 1
            if empty_aborts > _MAX_EMPTY_ABORTS:
                raise GenerationFailed(
                    f"rollout {rollout_id} ({req.qid!r}): {empty_aborts} chunks in a row were "
                    f"aborted before generating a token (last server {sched.url})"
                )
            if empty_aborts:
                await asyncio.sleep(min(1.0, 0.01 * 2**empty_aborts))
        return [done[j] for j in order]

    async def _schedule(self, req: ScheduleRequest):
        """The manager's choice of server; waits (bounded) while no server is live."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.no_server_wait_s
        waited = False
        while True:
            try:
                sched = await self.client.schedule(req)
            except NoServerAvailable as e:
                if loop.time() >= deadline:
                    raise GenerationFailed(
                        f"rollout {req.rollout_id}: no live generation server for "
                        f"{self.no_server_wait_s:g}s (no_server_wait_s): {e}"
                    ) from None
                if not waited:
                    waited = True
                    self.stats["waited_for_server"] += 1
                    logger.warning(f"rollout {req.rollout_id}: {e}; waiting for a server")
                await asyncio.sleep(0.5)
                continue
            if waited:
                logger.info(f"rollout {req.rollout_id}: a generation server is back")
            return sched

    async def _generate(self, url: str, body: dict, n: int) -> List[_Chunk]:
        """One batched ``/generate`` call of ``n`` prompts: their chunks, in order."""
        try:
            async with self.session.post(
                url + "/generate",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            ) as r:
                status, text = r.status, await r.text()
                retry_after = r.headers.get("Retry-After")
        except asyncio.TimeoutError:
            raise _ServerFailure(
                f"{url}/generate did not answer within {self.request_timeout_s:g}s"
            ) from None
        except aiohttp.ClientError as e:
            raise _ServerFailure(f"{url}/generate failed: {e!r}") from None
        if status == 503 and retry_after is not None:
            try:
                wait = min(5.0, max(0.05, float(retry_after)))
            except ValueError:
                wait = 1.0
            raise _Overloaded(wait, f"{url}/generate: {text[:300]}")
        if status >= 500:
            raise _ServerFailure(f"{url}/generate answered HTTP {status}: {text[:300]}")
        if status != 200:
            raise GenerationFailed(
                f"{url}/generate rejected the request (HTTP {status}): {text[:1000]}"
            )
        data = json.loads(text)
        if not isinstance(data, list) or len(data) != n:
            got = len(data) if isinstance(data, list) else "not a list of"
            raise GenerationFailed(f"{url}/generate returned {got} outputs for {n} prompts")
        outs = [parse_sglang_output(d) for d in data]
        return [_Chunk(o.output_ids, o.output_logprobs, o.finish_reason.type) for o in outs]


class _Overloaded(Exception):
    """The server refused the call for load (503 with ``Retry-After``); it never ran it."""

    def __init__(self, retry_after: float, message: str):
        super().__init__(message)
        self.retry_after = retry_after


class _ServerFailure(Exception):
    """A generation call failed on the server's side (unreachable, timeout, 5xx)."""
