"""The data-parallel split (:mod:`realhf.system.dag.dp_split`): contiguity, balance, errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from realhf.system.dag.dp_split import partition_for_dp


def test_partition_by_count_is_contiguous_and_even():
    ids = [f"i{j}" for j in range(7)]
    parts = partition_for_dp(ids, [100, 1, 1, 1, 1, 1, 1], 3, by_count=True)
    assert parts == [["i0", "i1", "i2"], ["i3", "i4"], ["i5", "i6"]]


@pytest.mark.parametrize("seed", range(5))
def test_partition_by_tokens_is_the_optimal_contiguous_split(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (7,), generator=g).tolist()
    ids = [f"i{j}" for j in range(7)]
    parts = partition_for_dp(ids, tokens, 3, by_count=False)
    assert [i for p in parts for i in p] == ids and all(parts)
    cost = max(sum(tokens[int(i[1:])] for i in p) for p in parts)
    best = min(
        max(sum(tokens[:a]), sum(tokens[a:b]), sum(tokens[b:]))
        for a, b in itertools.combinations(range(1, 7), 2)
    )
    assert cost == best


def test_partition_needs_an_item_per_rank():
    with pytest.raises(ValueError, match="2 items cannot be split over 3 data-parallel ranks"):
        partition_for_dp(["a", "b"], [1, 1], 3, by_count=True)
    with pytest.raises(ValueError, match="3 token counts for 2 ids"):
        partition_for_dp(["a", "b"], [1, 1, 1], 1, by_count=False)
