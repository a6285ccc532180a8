"""One sequence in the generation engine: its request, progress and result future."""

from __future__ import annotations

import concurrent.futures
import enum
import time
from typing import FrozenSet, List, Tuple

from realhf.api.core.gen_api import FinishReason, GenerateOutput, GenerateRequest


class SeqStatus(enum.Enum):
    """Lifecycle: WAITING (queued) -> RUNNING (holds a cache slot) -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def prompt_key(req: GenerateRequest) -> Tuple:
    """Equal for requests with the same prompt: its tokens and its image object."""
    return (tuple(req.input_ids), id(req.images))


class Sequence:
    """Engine-side state of one :class:`GenerateRequest`.

    Args:
        req: the request (``n == 1``).
        max_new_tokens: the resolved budget (``None`` in the request already
            replaced by the room left in the context).
        stop_ids: token ids that end this sequence (defaults + request's).
    """

    __slots__ = (
        "req",
        "max_new_tokens",
        "min_new_tokens",
        "stop_ids",
        "future",
        "status",
        "slot",
        "pages",
        "shared_tokens",
        "prompt_key",
        "output_ids",
        "output_logprobs",
        "submit_time",
        "rope_delta",
    )

    def __init__(self, req: GenerateRequest, max_new_tokens: int, stop_ids: FrozenSet[int]):
        self.req = req
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = req.sampling.min_new_tokens
        self.stop_ids = stop_ids
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.status = SeqStatus.WAITING
        #: its row among the running sequences (< max_running_requests), -1 when not running
        self.slot = -1
        #: its page table in the KV cache (see :mod:`.kv_cache`), empty when not running
        self.pages: List[int] = []
        #: leading prompt positions on pages shared with a group mate (written by the mate)
        self.shared_tokens = 0
        #: equal for requests whose prompts (tokens and image object) are the same
        self.prompt_key: Tuple = prompt_key(req)
        self.output_ids: List[int] = []
        self.output_logprobs: List[float] = []
        self.submit_time = time.monotonic()
        #: a prompt with images: decoding token ``L`` sits at RoPE position ``L + delta``
        self.rope_delta = 0

    @property
    def rid(self) -> str:
        """The request id."""
        return self.req.rid

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.req.input_ids)

    @property
    def n_out(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_ids)

    @property
    def length(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.req.input_ids) + len(self.output_ids)

    def finish(self, reason: FinishReason) -> GenerateOutput:
        """Mark finished and resolve the future with the output (first call wins)."""
        self.status = SeqStatus.FINISHED
        # Log-probs are always collected (sampling yields them for free) and dropped here
        # when the request did not ask for them.
        out = GenerateOutput(
            rid=self.rid,
            prompt_len=self.prompt_len,
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.output_logprobs) if self.req.return_logprob else (),
            finish_reason=reason,
            e2e_latency=time.monotonic() - self.submit_time,
        )
        # A caller that gave up may have cancelled the future already (asyncio.wait_for on
        # a wrapped future does); set_result on a done future would raise.
        if not self.future.done():
            self.future.set_result(out)
        return out

    def fail(self, exc: BaseException) -> None:
        """Mark finished and resolve the future with an exception."""
        self.status = SeqStatus.FINISHED
        if not self.future.done():
            self.future.set_exception(exc)
