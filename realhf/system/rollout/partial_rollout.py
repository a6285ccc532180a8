"""Interruptible generation: a group of answers, each generated chunk by chunk.

Every member of a group is an independent ``n = 1`` sequence.  For each chunk the manager
picks a server (``/schedule_request``; a continuation goes back to its previous server when
that server's weight version is unchanged) and the chunk is one SGLang ``/generate`` call
for at most ``new_tokens_per_chunk`` tokens.  A chunk that ends with ``length`` below the
member's budget, or with ``abort`` (the manager paused the server for a weight update), is
resubmitted with everything generated so far appended to the prompt; tokens and logprobs of
all chunks are concatenated.  ``version_start`` is the version of the first chunk's server,
``version_end`` that of the last one.

A server that cannot be reached, times out or answers 5xx is reported to the manager and the
chunk goes to another server (at most ``max_server_failures`` failures in a row per member;
a chunk that succeeds resets the count); a 4xx answer
is a bad request and fails the rollout at once with the server's message; a 503 with
``Retry-After`` (the server is at its ``max_concurrent_requests``) is asked again after the
pause, without counting as a failure.  While no server
is live at all (the only one died and is being restarted) a chunk waits up to
``no_server_wait_s`` for one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
from typing import Iterable, List, Optional, Tuple

import aiohttp

from realhf.api.core.gen_api import FinishType, parse_sglang_output
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration, ScheduleRequest
from realhf.base import logging, seeding
from realhf.system.rollout.manager_client import ManagerClient, UncappedSession
from realhf.system.rollout.server_pool import NoServerAvailable

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
        """All ``req.gconfig.n`` members of a group, generated concurrently."""
        members = await asyncio.gather(
            *(self.generate_member(rollout_id, req, j) for j in range(req.gconfig.n))
        )
        return GroupGeneration(
            qid=req.qid,
            prompt_ids=req.prompt_ids,
            output_ids=tuple(tuple(m.output_ids) for m in members),
            output_logprobs=tuple(tuple(m.output_logprobs) for m in members),
            no_eos=tuple(m.no_eos for m in members),
            version_start=tuple(m.version_start for m in members),
            version_end=tuple(m.version_end for m in members),
        )

    def _sampling_params(
        self, req: GenerateGroupRequest, member: int, done: int, max_new: int
    ) -> dict:
        g = req.gconfig
        sp = g.to_sampling_params()
        params = {
            "n": 1,
            "max_new_tokens": max_new,
            "min_new_tokens": min(max_new, max(0, g.min_new_tokens - done)),
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "stop_token_ids": sorted(set(sp.stop_token_ids) | set(self.stop_token_ids)),
        }
        if self.seed is not None:
            params["sampling_seed"] = seeding.derive_seed(self.seed, f"{req.qid}/{member}/{done}")
        return params

    async def generate_member(
        self, rollout_id: str, req: GenerateGroupRequest, member: int
    ) -> MemberResult:
        """One sequence, chunk by chunk, resubmitted after interruptions and server failures."""
        budget = req.gconfig.max_new_tokens
        out_ids: List[int] = []
        out_lps: List[float] = []
        version_start: Optional[int] = None
        version_end = 0
        prev: Tuple[str, int] = ("", -1)
        exclude: List[str] = []
        failures = chunks = interrupted = empty_aborts = 0
        overloaded_s = 0.0
        while True:
            remaining = budget - len(out_ids)
            sched = await self._schedule(
                ScheduleRequest(
                    rollout_id,
                    len(req.prompt_ids) + len(out_ids),
                    remaining,
                    prev[0],
                    prev[1],
                    tuple(exclude),
                )
            )
            if version_start is None:
                version_start = sched.version
            max_new = min(self.chunk, remaining)
            body = {
                "input_ids": list(req.prompt_ids) + out_ids,
                "sampling_params": self._sampling_params(req, member, len(out_ids), max_new),
                "return_logprob": True,
                "stream": False,
            }
            try:
                out = await self._generate(sched.url, body)
            except _Overloaded as e:
                # Refused before it was processed: not a failure; ask again after a pause.
                overloaded_s += e.retry_after
                self.stats["overloaded"] += 1
                if overloaded_s > self.no_server_wait_s:
                    raise GenerationFailed(
                        f"rollout {rollout_id} ({req.qid!r}) member {member}: the servers "
                        f"refused it as overloaded for {overloaded_s:.0f}s "
                        f"(no_server_wait_s={self.no_server_wait_s:g}): {e}"
                    ) from None
                await asyncio.sleep(e.retry_after)
                continue
            except _ServerFailure as e:
                failures += 1
                self.stats["server_failures"] += 1
                logger.warning(
                    f"rollout {rollout_id} member {member}: {e}; rescheduling "
                    f"({failures}/{self.max_server_failures})"
                )
                await self.client.report_failure(sched.url, str(e))
                if failures > self.max_server_failures:
                    raise GenerationFailed(
                        f"rollout {rollout_id} ({req.qid!r}) member {member}: {failures} "
                        f"generation calls failed, the last on {sched.url}: {e}"
                    ) from None
                exclude.append(sched.url)
                prev = ("", -1)
                continue
            exclude.clear()
            failures = 0
            chunks += 1
            self.stats["chunks"] += 1
            out_ids += out.output_ids
            out_lps += out.output_logprobs
            version_end = sched.version
            if out.end is FinishType.STOP:
                return MemberResult(
                    out_ids, out_lps, False, version_start, version_end, chunks, interrupted
                )
            if len(out_ids) >= budget:
                return MemberResult(
                    out_ids, out_lps, True, version_start, version_end, chunks, interrupted
                )
            if out.end is FinishType.ABORT:
                interrupted += 1
                self.stats["interrupted"] += 1
                # Aborted before its first token again and again: back off, and give up
                # rather than spin if the server never lets it run.
                empty_aborts = empty_aborts + 1 if not out.output_ids else 0
                if empty_aborts > _MAX_EMPTY_ABORTS:
                    raise GenerationFailed(
                        f"rollout {rollout_id} ({req.qid!r}) member {member}: {empty_aborts} "
                        "chunks in a row were aborted before generating a token "
                        f"(last server {sched.url})"
                    )
                if empty_aborts:
                    await asyncio.sleep(min(1.0, 0.01 * 2**empty_aborts))
            prev = (sched.url, sched.version)

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

    async def _generate(self, url: str, body: dict) -> _Chunk:
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
        if isinstance(data, list):
            if len(data) != 1:
                raise GenerationFailed(
                    f"{url}/generate returned {len(data)} outputs for one n=1 request"
                )
            data = data[0]
        out = parse_sglang_output(data)
        return _Chunk(out.output_ids, out.output_logprobs, out.finish_reason.type)


class _Overloaded(Exception):
    """The server refused the call for load (503 with ``Retry-After``); it never ran it."""

    def __init__(self, retry_after: float, message: str):
        super().__init__(message)
        self.retry_after = retry_after


class _ServerFailure(Exception):
    """A generation call failed on the server's side (unreachable, timeout, 5xx)."""
