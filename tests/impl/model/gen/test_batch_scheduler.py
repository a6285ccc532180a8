"""The continuous-batching scheduler: admission limits, release, abort, queue bound."""

import pytest
import torch

from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.impl.model.gen.batch_scheduler import QueueFullError, Scheduler
from realhf.impl.model.gen.kv_cache import SlotKVCache
from realhf.impl.model.gen.sequence import SeqStatus, Sequence


def _seq(plen, rid=None):
    req = GenerateRequest(
        input_ids=[1] * plen, sampling=SamplingParams(max_new_tokens=4), rid=rid or ""
    )
    return Sequence(req, 4, frozenset())


def _sched(slots=3, prefill=10, queue=100):
    cache = SlotKVCache(
        n_layers=1,
        n_kv_heads=1,
        head_dim=2,
        n_slots=slots,
        slot_len=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return Scheduler(cache, max_prefill_tokens=prefill, max_queued_requests=queue)


def test_admission_is_fcfs_and_bounded_by_slots_and_prefill_budget():
    s = _sched(slots=3, prefill=10)
    seqs = [_seq(4), _seq(4), _seq(4), _seq(1)]
    for q in seqs:
        s.add(q)
    first = s.admit()
    assert first == seqs[:2]  # the third would exceed 10 prompt tokens
    assert [q.slot for q in first] == [0, 1] and all(q.status == SeqStatus.RUNNING for q in first)
    assert s.admit() == seqs[2:3]  # one slot left
    assert s.admit() == [] and list(s.waiting) == seqs[3:]
    s.release([seqs[0]])
    assert seqs[0].slot == -1 and s.cache.n_free == 1
    assert s.admit() == seqs[3:] and seqs[3].slot == 0  # lowest free slot


def test_a_long_prompt_is_admitted_alone_rather_than_starved():
    s = _sched(slots=2, prefill=3)
    big = _seq(12)
    s.add(big)
    assert s.admit() == [big]


def test_used_tokens_find_remove_and_take_all():
    s = _sched(slots=2)
    a, b, c = _seq(3, "a"), _seq(5, "b"), _seq(2, "c")
    for q in (a, b, c):
        s.add(q)
    s.admit()
    a.output_ids += [9, 9]
    assert s.num_used_tokens == 5 + 5
    assert s.find("c") is c and s.find("zzz") is None
    s.remove(c)
    assert not s.waiting
    s.remove(a)
    assert s.running == [b] and s.cache.n_free == 1
    s.add(c)
    assert s.take_all() == [b, c] and s.idle and s.cache.n_free == 2


def test_queue_bound():
    s = _sched(queue=2)
    s.add(_seq(1))
    s.add(_seq(1))
    with pytest.raises(QueueFullError, match="max_queued_requests=2"):
        s.add(_seq(1))
