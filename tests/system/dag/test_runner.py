"""DagRunner's pure parts; the runner itself is exercised through the master in
test_master_worker.py (in-process) and test_dag_e2e.py (processes)."""

from __future__ import annotations

import pytest

from realhf.system.dag.runner import allocate_fetch


def test_allocate_fetch_is_even_and_respects_leftovers():
    assert allocate_fetch(8, [10, 10]) == [4, 4]
    assert allocate_fetch(7, [10, 10, 10]) == [3, 2, 2]
    assert allocate_fetch(6, [1, 10, 10]) == [1, 3, 2]
    assert allocate_fetch(3, [0, 2, 5]) == [0, 2, 1]
    assert allocate_fetch(0, [3, 3]) == [0, 0]


@pytest.mark.parametrize("remaining", [[5, 0, 3], [1, 1, 1, 9], [4]])
def test_allocate_fetch_takes_exactly_what_is_asked_within_each_shard(remaining):
    for need in range(sum(remaining) + 1):
        alloc = allocate_fetch(need, remaining)
        assert sum(alloc) == need
        assert all(0 <= a <= r for a, r in zip(alloc, remaining))
        # Shards that could give more never give 2+ fewer than another shard.
        for a, r in zip(alloc, remaining):
            if a < r:
                assert all(b <= a + 1 for b in alloc), (need, alloc)


def test_allocate_fetch_refuses_more_than_is_left():
    with pytest.raises(ValueError, match="cannot fetch 5 items"):
        allocate_fetch(5, [2, 2])
