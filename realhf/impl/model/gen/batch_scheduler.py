"""Continuous-batching scheduler: a FCFS waiting queue and the running set.

At every engine step the running sequences decode one token together; the
scheduler then admits waiting sequences while a running row and KV pages for
their whole length are free (at most ``max_prefill_tokens`` prompt tokens per
step, but always at least one sequence so that a long prompt cannot starve).
Sequences admitted in one step with the same prompt share its full pages
(:mod:`.kv_cache`). A finished sequence leaves the running set and gives its
pages back immediately.
"""

from __future__ import annotations

import collections
import heapq
from typing import Deque, Dict, Iterable, List, Optional

from realhf.impl.model.gen.kv_cache import PagedKVCache, pages_to_admit
from realhf.impl.model.gen.sequence import SeqStatus, Sequence


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queued_requests``; the server answers 503."""


class Scheduler:
    """Decides which sequences run; owns the waiting queue and the running list.

    Args:
        cache: the paged cache whose free pages bound what runs.
        max_running: most sequences decoded together (rows; ``max_running_requests``).
        max_prefill_tokens: prompt tokens admitted per step (soft: the first
            admitted prompt may exceed it).
        max_queued_requests: bound of the waiting queue.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        *,
        max_running: int,
        max_prefill_tokens: int,
        max_queued_requests: int,
    ):
        self.cache = cache
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued_requests = max_queued_requests
        self.waiting: Deque[Sequence] = collections.deque()
        self.running: List[Sequence] = []
        # Rows lowest-first, like pages: the engine's per-row buffers stay compact.
        self._rows: List[int] = list(range(max_running))

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.running

    @property
    def num_used_tokens(self) -> int:
        """Cache positions taken by running sequences: their pages, reserved for whole
        answers when admitted (a group's shared prompt pages once)."""
        return (self.cache.n_pages - self.cache.n_free) * self.cache.page_size

    def pages_needed(self, seq: Sequence, mate: Optional[Sequence] = None) -> int:
        """Pages ``seq`` takes when admitted; with a ``mate`` of the same prompt already
        admitted, its prompt's full pages are shared."""
        return pages_to_admit(
            seq.prompt_len, seq.max_new_tokens, mate is not None, self.cache.page_size
        )

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (FCFS)."""
        self.add_all([seq])

    def add_all(self, seqs: Iterable[Sequence]) -> None:
        """Queue sequences (FCFS), all or none."""
        seqs = list(seqs)
        if len(self.waiting) + len(seqs) > self.max_queued_requests:
            raise QueueFullError(
                f"{len(self.waiting)} requests are already queued and {len(seqs)} more came "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )
        self.waiting.extend(seqs)

    def admit(self) -> List[Sequence]:
        """Move waiting sequences into the running set; returns the ones to prefill."""
        admitted: List[Sequence] = []
        budget = self.max_prefill_tokens
        owners: Dict[tuple, Sequence] = {}  # prompt -> the first admitted with it
        P = self.cache.page_size
        while self.waiting and self._rows:
            seq = self.waiting[0]
            mate = owners.get(seq.prompt_key)
            # Stop at the head rather than admit shorter prompts behind it: strict FCFS, so
            # a long prompt waits at most one step instead of being overtaken indefinitely.
            # (A group mate's prompt is computed once: it costs no prefill budget.)
            if admitted and mate is None and seq.prompt_len > budget:
                break
            need = self.pages_needed(seq, mate)
            if need > self.cache.n_free:
                break
            self.waiting.popleft()
            if mate is None:
                seq.pages = self.cache.alloc(need)
                seq.shared_tokens = 0
                owners[seq.prompt_key] = seq
                budget -= seq.prompt_len
            else:
                shared = mate.pages[: seq.prompt_len // P]
                self.cache.share(shared)
                seq.pages = shared + self.cache.alloc(need)
                seq.shared_tokens = len(shared) * P
            seq.slot = heapq.heappop(self._rows)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def release(self, seqs: List[Sequence]) -> None:
        """Remove finished sequences from the running set and free their pages."""
        if not seqs:
            return
        gone = set(id(s) for s in seqs)
        self.running = [s for s in self.running if id(s) not in gone]
        for s in seqs:
            if s.slot >= 0:
                self.cache.free(s.pages)
                heapq.heappush(self._rows, s.slot)
                s.slot, s.pages, s.shared_tokens = -1, [], 0

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
        """Remove every sequence, running first, freeing all pages (pause/abort-all)."""
        out = list(self.running) + list(self.waiting)
        self.release(list(self.running))
        self.waiting.clear()
        return out
