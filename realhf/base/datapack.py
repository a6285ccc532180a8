"""Packing of variable-length items into groups: balanced partitions and token budgets.

Two problems come up whenever packed sequences are distributed:

* `partition_balanced` cuts an ordered list of lengths into ``k`` contiguous groups so
  that the largest group sum is as small as possible (exact optimum). The master uses it
  to give data-parallel ranks equal token loads while keeping item order.
* `ffd_allocate` packs lengths into groups whose sums stay within a token budget,
  first-fit-decreasing, with at least ``min_groups`` groups. It cuts micro-batches.

The inner loops are compiled with numba; the public functions validate their input in
Python and raise errors that say what is wrong and how to fix it. This module imports
nothing from realhf (base layer).
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

__all__ = ["partition_balanced", "partition_cost", "ffd_allocate"]


def _as_lengths(lengths: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"{what}: lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{what}: lengths must be integers, got {arr[:8]}...")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{what}: lengths must be >= 0, item {i} has {arr[i]}")
    return arr


# ----------------------------------------------------------------------------------
# Balanced contiguous partition (min of max group sum)
# ----------------------------------------------------------------------------------


@numba.njit(cache=True)
def _reachable_table(prefix, k, min_size, cap):
    """reach[j, i] is True when items [0, i) split into j groups, each of at least
    min_size items and sum <= cap. O(k n) with a sliding window over prefix sums."""
    n = prefix.shape[0] - 1
    reach = np.zeros((k + 1, n + 1), dtype=np.bool_)
    reach[0, 0] = True
    count = np.zeros(n + 2, dtype=np.int64)  # prefix counts of reach[j-1]
    for j in range(1, k + 1):
        count[0] = 0
        for i in range(n + 1):
            count[i + 1] = count[i] + (1 if reach[j - 1, i] else 0)
        lo = 0
        for i in range(n + 1):
            # Smallest p whose group [p, i) fits under cap; monotone in i.
            while lo < i and prefix[i] - prefix[lo] > cap:
                lo += 1
            hi = i - min_size
            if hi >= lo and count[hi + 1] - count[lo] > 0:
                reach[j, i] = True
    return reach


@numba.njit(cache=True)
def _partition_balanced(lengths, k, min_size):
    n = lengths.shape[0]
    prefix = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        prefix[i + 1] = prefix[i] + lengths[i]
    # The answer lies in [longest item, total]: no group can be smaller than
    # its biggest item, and one group holding everything always fits.
    lo = 0
    for i in range(n):
        lo = max(lo, lengths[i])
    hi = prefix[n]
    # Binary search on the answer: the smallest cap for which a split exists.
    while lo < hi:
        mid = (lo + hi) // 2
        if _reachable_table(prefix, k, min_size, mid)[k, n]:
            hi = mid
        else:
            lo = mid + 1
    reach = _reachable_table(prefix, k, min_size, lo)
    bounds = np.zeros(k + 1, dtype=np.int64)
    bounds[k] = n
    i = n
    for j in range(k, 0, -1):
        # Walk back: the largest start p that leaves a reachable prefix.  Such a
        # p exists because reach[k, n] held for cap == lo, so the loop ends.
        p = i - min_size
        while not (reach[j - 1, p] and prefix[i] - prefix[p] <= lo):
            p -= 1
        bounds[j - 1] = p
        i = p
    return bounds


def partition_balanced(
    lengths: Sequence[int] | np.ndarray, k: int, min_size: int = 1
) -> list[tuple[int, int]]:
    """Cut ``lengths`` into ``k`` contiguous groups minimising the largest group sum.

    Args:
        lengths: non-negative integers, e.g. token counts of items in order.
        k: number of groups (>= 1).
        min_size: minimum number of items per group (>= 1); needs len(lengths) >= k*min_size.

    Returns:
        ``k`` half-open index ranges ``[(start, end), ...]`` covering ``0..n`` in order.
        The maximum of ``sum(lengths[s:e])`` over groups is the exact optimum.
    """
    arr = _as_lengths(lengths, "partition_balanced")
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"partition_balanced: k must be an integer >= 1, got {k!r}")
    if not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise ValueError(f"partition_balanced: min_size must be an integer >= 1, got {min_size!r}")
    if arr.size < k * min_size:
        raise ValueError(
            f"partition_balanced: cannot cut {arr.size} items into {k} groups of at "
            f"least {min_size} items; lower k or min_size, or provide more items"
        )
    b = _partition_balanced(arr, int(k), int(min_size))
    return [(int(b[j]), int(b[j + 1])) for j in range(k)]


def partition_cost(lengths: Sequence[int] | np.ndarray, groups) -> int:
    """The largest group sum of a partition given as index ranges or index lists."""
    arr = np.asarray(lengths, dtype=np.int64)
    sums = []
    for g in groups:
        if isinstance(g, tuple) and len(g) == 2 and not isinstance(g[0], (list, tuple)):
            sums.append(int(arr[g[0] : g[1]].sum()))
        else:
            sums.append(int(arr[list(g)].sum()))
    return max(sums) if sums else 0


# ----------------------------------------------------------------------------------
# First-fit-decreasing under a budget
# ----------------------------------------------------------------------------------


@numba.njit(cache=True)
def _ffd_allocate(lengths, capacity, min_groups):
    n = lengths.shape[0]
    # Stable descending order so equal lengths keep their input order.
    order = np.argsort(-lengths, kind="mergesort")
    group_of = np.empty(n, dtype=np.int64)
    sums = np.zeros(n, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    n_groups = 0
    for idx in order:
        x = lengths[idx]
        best = -1
        if n_groups >= min_groups:
            for g in range(n_groups):
                if sums[g] + x > capacity:
                    continue
                if (
                    best < 0
                    or counts[g] < counts[best]
                    or (counts[g] == counts[best] and sums[g] < sums[best])
                ):
                    best = g
        if best < 0:
            best = n_groups
            n_groups += 1
        group_of[idx] = best
        sums[best] += x
        counts[best] += 1
    return group_of, n_groups


def ffd_allocate(
    lengths: Sequence[int] | np.ndarray, capacity: int, min_groups: int = 1
) -> list[list[int]]:
    """Pack items into groups whose length sums stay within ``capacity``.

    First-fit-decreasing: items are visited longest first (ties in input order). A new
    group is opened while there are fewer than ``min_groups`` groups, or when the item
    fits in no open group; otherwise the item joins the fitting group with the fewest
    items (ties: the smaller sum, then the earlier group), which keeps micro-batches
    balanced when ``min_groups`` rather than the budget decides their number.

    Args:
        lengths: non-negative item sizes (e.g. tokens per item).
        capacity: the budget per group; every item must fit on its own.
        min_groups: at least this many groups when there are that many items.

    Returns:
        Groups as lists of item indices, each sorted ascending; groups are ordered by
        their smallest index. Every index appears exactly once.
    """
    arr = _as_lengths(lengths, "ffd_allocate")
    if not isinstance(min_groups, (int, np.integer)) or min_groups < 1:
        raise ValueError(f"ffd_allocate: min_groups must be an integer >= 1, got {min_groups!r}")
    if capacity < 1:
        raise ValueError(f"ffd_allocate: capacity must be >= 1, got {capacity!r}")
    if arr.size == 0:
        return []
    big = int(np.argmax(arr))
    if arr[big] > capacity:
        raise ValueError(
            f"ffd_allocate: item {big} has length {int(arr[big])}, more than the "
            f"capacity {capacity}; raise the capacity (max_tokens_per_mb) to at least "
            f"{int(arr[big])}"
        )
    # A Python int of any size may mean "no budget"; clamp it to an int64 with
    # headroom, so the conversion cannot fail and sums[g] + x cannot overflow.
    group_of, n_groups = _ffd_allocate(arr, np.int64(min(capacity, 2**62)), int(min_groups))
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for i, g in enumerate(group_of.tolist()):
        groups[g].append(i)
    groups.sort(key=lambda g: g[0])
    return groups
