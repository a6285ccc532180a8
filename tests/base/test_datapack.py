import itertools

import numpy as np
import pytest

from realhf.base.datapack import ffd_allocate, partition_balanced, partition_cost


def _brute_partition_cost(lengths, k, min_size):
    """Optimal max group sum over all contiguous cuts (exhaustive)."""
    n = len(lengths)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        if any(bounds[j + 1] - bounds[j] < min_size for j in range(k)):
            continue
        cost = max(sum(lengths[bounds[j] : bounds[j + 1]]) for j in range(k))
        best = cost if best is None else min(best, cost)
    return best


def _brute_min_bins(lengths, capacity):
    """Fewest bins holding all items within capacity (exhaustive, small inputs)."""
    items = sorted(lengths, reverse=True)
    best = [len(items)]

    def place(i, bins):
        if len(bins) >= best[0]:
            return
        if i == len(items):
            best[0] = len(bins)
            return
        seen = set()
        for b in range(len(bins)):
            if bins[b] + items[i] <= capacity and bins[b] not in seen:
                seen.add(bins[b])
                bins[b] += items[i]
                place(i + 1, bins)
                bins[b] -= items[i]
        bins.append(items[i])
        place(i + 1, bins)
        bins.pop()

    place(0, [])
    return best[0]


def _check_cover(groups, n):
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(n))


# ----------------------------------------------------------------------------- balanced


def test_partition_balanced_hand_made():
    assert partition_balanced([5, 1, 5, 2, 2, 9, 1], 3) == [(0, 2), (2, 5), (5, 7)]
    assert partition_balanced([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition_balanced([10, 1, 1, 1], 2) == [(0, 1), (1, 4)]
    assert partition_balanced([3], 1) == [(0, 1)]
    # min_size forces two items per group even though [100] alone would be cheaper.
    assert partition_balanced([100, 1, 1, 1], 2, min_size=2) == [(0, 2), (2, 4)]
    # Zeros are legal lengths.
    assert partition_cost([0, 0, 0], partition_balanced([0, 0, 0], 3)) == 0


@pytest.mark.parametrize("seed", range(40))
def test_partition_balanced_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    lengths = rng.integers(0, 50, size=n).tolist()
    k = int(rng.integers(1, n + 1))
    min_size = int(rng.integers(1, n // k + 1))
    parts = partition_balanced(lengths, k, min_size)
    assert len(parts) == k
    assert parts[0][0] == 0 and parts[-1][1] == n
    for (_, e), (s2, _) in zip(parts, parts[1:]):
        assert e == s2
    assert all(e - s >= min_size for s, e in parts)
    assert partition_cost(lengths, parts) == _brute_partition_cost(lengths, k, min_size)


def test_partition_balanced_large_is_near_average():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1000, size=5000)
    parts = partition_balanced(lengths, 16)
    # The optimum is within one item of the average load.
    assert partition_cost(lengths, parts) <= lengths.sum() / 16 + lengths.max()


def test_partition_balanced_errors_name_the_problem():
    with pytest.raises(ValueError, match="cannot cut 3 items into 2 groups of at least 2"):
        partition_balanced([1, 2, 3], 2, min_size=2)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        partition_balanced([1, 2, 3], 0)
    with pytest.raises(ValueError, match="item 1 has -2"):
        partition_balanced([1, -2, 3], 1)
    with pytest.raises(ValueError, match="1-D"):
        partition_balanced([[1, 2]], 1)


# ----------------------------------------------------------------------------- ffd


def test_ffd_hand_made():
    # Walk-through: 9 | 5+5 | 2+2+1, then the last 1 joins the group with fewest items.
    assert ffd_allocate([5, 1, 5, 2, 2, 9, 1], 10) == [[0, 2], [1, 5], [3, 4, 6]]
    # Budget large: exactly min_groups groups, balanced by item count then sum.
    assert ffd_allocate([5, 1, 5, 2, 2, 9, 1], 100, min_groups=3) == [
        [0, 3, 6],
        [1, 5],
        [2, 4],
    ]
    assert ffd_allocate([4, 4, 4], 4) == [[0], [1], [2]]
    assert ffd_allocate([4, 4, 4], 12) == [[0, 1, 2]]
    assert ffd_allocate([], 5) == []
    # Fewer items than min_groups: one group per item.
    assert ffd_allocate([1, 2], 10, min_groups=4) == [[0], [1]]


@pytest.mark.parametrize("seed", range(40))
def test_ffd_within_budget_and_near_optimal(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    capacity = int(rng.integers(10, 40))
    lengths = rng.integers(0, capacity + 1, size=n).tolist()
    min_groups = int(rng.integers(1, 4))
    groups = ffd_allocate(lengths, capacity, min_groups)
    _check_cover(groups, n)
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    assert len(groups) >= min(min_groups, n)
    # A new group opens only when nothing fits (beyond min_groups), so at most one
    # group is half empty: never worse than twice the optimum.
    opt = _brute_min_bins(lengths, capacity)
    assert len(groups) <= max(min_groups, 2 * opt)
    if min_groups == 1:
        # Decreasing order makes it far better than the bound in practice.
        assert len(groups) <= opt + 1


def test_ffd_large_random_batch():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 4096, size=4000)
    groups = ffd_allocate(lengths, 16384)
    _check_cover(groups, len(lengths))
    sums = [int(lengths[g].sum()) for g in groups]
    assert max(sums) <= 16384
    assert len(groups) <= int(np.ceil(lengths.sum() / 16384)) + 2


def test_ffd_errors_name_the_item_and_fix():
    with pytest.raises(ValueError, match=r"item 1 has length 50.*max_tokens_per_mb"):
        ffd_allocate([3, 50, 4], 10)
    with pytest.raises(ValueError, match="min_groups must be an integer >= 1"):
        ffd_allocate([3], 10, min_groups=0)
