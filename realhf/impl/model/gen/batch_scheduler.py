"""Continuous-batching scheduler: a FCFS waiting queue and the running set.

At every engine step the running sequences decode one token together; the
scheduler then admits waiting sequences into the slots that finished sequences
freed (at most ``max_prefill_tokens`` prompt tokens per step, but always at
least one sequence so that a long prompt cannot starve). A finished sequence
leaves the running set and frees its cache slot immediately.
"""

from __future__ import annotations

import collections
from typing import Deque, List, Optional

from realhf.impl.model.gen.kv_cache import SlotKVCache
from realhf.impl.model.gen.sequence import SeqStatus, Sequence


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queued_requests``; the server answers 503."""


class Scheduler:
    """Decides which sequences run; owns the waiting queue and the running list.

    Args:
        cache: the slot cache whose free slots bound the running set.
        max_prefill_tokens: prompt tokens admitted per step (soft: the first
            admitted prompt may exceed it).
        max_queued_requests: bound of the waiting queue.
    """

    def __init__(self, cache: SlotKVCache, *, max_prefill_tokens: int, max_queued_requests: int):
        self.cache = cache
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        self.waiting: Deque[Sequence] = collections.deque()
        self.running: List[Sequence] = []

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.running

    @property
    def num_used_tokens(self) -> int:
        """Tokens held in the cache by running sequences."""
        return sum(s.length for s in self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (FCFS)."""
        if len(self.waiting) >= self.max_queued_requests:
            raise QueueFullError(
                f"{len(self.waiting)} requests are already queued "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )
        self.waiting.append(seq)

    def admit(self) -> List[Sequence]:
        """Move waiting sequences into free slots; returns the ones to prefill."""
        admitted: List[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and self.cache.n_free > 0:
            seq = self.waiting[0]
            # Stop at the head rather than admit shorter prompts behind it: strict FCFS, so
            # a long prompt waits at most one step instead of being overtaken indefinitely.
            if admitted and seq.prompt_len > budget:
                break
            self.waiting.popleft()
            seq.slot = self.cache.alloc()
            seq.status = SeqStatus.RUNNING
            budget -= seq.prompt_len
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def release(self, seqs: List[Sequence]) -> None:
        """Remove finished sequences from the running set and free their slots."""
        if not seqs:
            return
        gone = set(id(s) for s in seqs)
        self.running = [s for s in self.running if id(s) not in gone]
        for s in seqs:
            if s.slot >= 0:
                self.cache.free(s.slot)
                s.slot = -1

    def find(self, rid: str) -> Optional[Sequence]:
        """The waiting or running sequence with this request id, if any."""
        for s in self.running:
            if s.rid == rid:
                return s
        for s in self.waiting:
            if s.rid == rid:
                return s
        return None

    def remove(self, seq: Sequence) -> None:
        """Take one sequence out, wherever it is (abort)."""
        if seq.status == SeqStatus.RUNNING:
            self.release([seq])
        else:
            self.waiting.remove(seq)

    def take_all(self) -> List[Sequence]:
        """Remove every sequence, running first, freeing all slots (pause/abort-all)."""
        out = list(self.running) + list(self.waiting)
        self.release(list(self.running))
        self.waiting.clear()
        return out
