"""The continuous-batching scheduler: admission limits, release, abort, queue bound."""

import pytest
import torch

from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.impl.model.gen.batch_scheduler import QueueFullError, Scheduler
from realhf.impl.model.gen.kv_cache import PagedKVCache
from realhf.impl.model.gen.sequence import SeqStatus, Sequence


def _seq(plen, rid=None, new=4, prompt=None):
    req = GenerateRequest(
        input_ids=prompt or [1] * plen, sampling=SamplingParams(max_new_tokens=new), rid=rid or ""
    )
    return Sequence(req, new, frozenset())


def _sched(rows=3, prefill=10, queue=100, tokens=64, page=4):
    cache = PagedKVCache(
        n_layers=1,
        n_kv_heads=1,
        head_dim=2,
        n_tokens=tokens,
        page_size=page,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return Scheduler(cache, max_running=rows, max_prefill_tokens=prefill, max_queued_requests=queue)


def test_admission_is_fcfs_and_bounded_by_rows_and_prefill_budget():
    s = _sched(rows=3, prefill=10)
    seqs = [_seq(4, prompt=[i] * 4) for i in range(3)] + [_seq(1)]
    for q in seqs:
        s.add(q)
    first = s.admit()
    assert first == seqs[:2]  # the third would exceed 10 prompt tokens
    assert [q.slot for q in first] == [0, 1] and all(q.status == SeqStatus.RUNNING for q in first)
    assert [q.pages for q in first] == [[0, 1], [2, 3]]  # 4 + 4 tokens: two pages each
    assert s.admit() == seqs[2:3]  # one row left
    assert s.admit() == [] and list(s.waiting) == seqs[3:]
    s.release([seqs[0]])
    assert seqs[0].slot == -1 and seqs[0].pages == [] and s.cache.n_free == 16 - 4
    assert s.admit() == seqs[3:] and seqs[3].slot == 0  # lowest free row
    assert seqs[3].pages == [0, 1]  # lowest free pages


def test_admission_waits_for_pages_for_the_whole_answer():
    s = _sched(rows=8, prefill=100, tokens=32, page=4)  # 8 pages
    a, b, c = _seq(6, new=14, prompt=[1] * 6), _seq(2, new=13), _seq(1, new=1)
    for q in (a, b, c):
        s.add(q)
    # a takes 5 pages (20 tokens); b needs 4 of the 3 left; c would fit but is behind b
    assert s.admit() == [a]
    assert s.num_used_tokens == 20 and list(s.waiting) == [b, c]
    s.release([a])
    assert s.admit() == [b, c] and s.cache.n_free == 8 - 5


def test_a_group_shares_its_prompts_full_pages_and_copies_the_last():
    s = _sched(rows=8, prefill=100, tokens=64, page=4)
    prompt = list(range(10))  # 2 full pages and 2 tokens on a third
    group = [_seq(10, rid=str(i), new=5, prompt=prompt) for i in range(3)]
    for q in group:
        s.add(q)
    assert s.admit() == group
    # first: ceil(15 / 4) = 4 pages; each mate: 2 shared + 2 of its own
    assert group[0].pages == [0, 1, 2, 3] and group[0].shared_tokens == 0
    assert group[1].pages == [0, 1, 4, 5] and group[1].shared_tokens == 8
    assert group[2].pages == [0, 1, 6, 7] and group[2].shared_tokens == 8
    assert s.cache.n_free == 16 - 8  # against 12 pages unshared
    s.release([group[0], group[1]])
    assert s.cache.n_free == 16 - 4  # pages 0 and 1 stay with the third
    s.release([group[2]])
    assert s.cache.n_free == 16


def test_a_group_mate_that_does_not_fit_waits_and_later_takes_its_own_pages():
    s = _sched(rows=8, prefill=100, tokens=24, page=4)  # 6 pages
    prompt = list(range(8))
    group = [_seq(8, rid=str(i), new=8, prompt=prompt) for i in range(3)]
    for q in group:
        s.add(q)
    # 4 pages for the first, 2 for the second (its first 2 shared), none left for the third
    assert s.admit() == group[:2] and s.cache.n_free == 0
    s.release(group[:2])
    assert s.admit() == group[2:] and group[2].pages == [0, 1, 2, 3]
    assert group[2].shared_tokens == 0  # its mates are gone: it prefills its prompt alone


def test_a_long_prompt_is_admitted_alone_rather_than_starved():
    s = _sched(rows=2, prefill=3)
    big = _seq(12)
    s.add(big)
    assert s.admit() == [big]


def test_used_tokens_find_remove_and_take_all():
    s = _sched(rows=2)
    a, b, c = _seq(3, "a"), _seq(5, "b"), _seq(2, "c")
    for q in (a, b, c):
        s.add(q)
    s.admit()
    a.output_ids += [9, 9]
    assert s.num_used_tokens == 4 * (2 + 3)  # pages for 3 + 4 and 5 + 4 tokens
    assert s.find("c") is c and s.find("zzz") is None
    s.remove(c)
    assert not s.waiting
    s.remove(a)
    assert s.running == [b] and s.cache.n_free == 16 - 3
    s.add(c)
    assert s.take_all() == [b, c] and s.idle and s.cache.n_free == 16


def test_queue_bound():
    s = _sched(queue=2)
    s.add(_seq(1))
    s.add(_seq(1))
    with pytest.raises(QueueFullError, match="max_queued_requests=2"):
        s.add(_seq(1))
