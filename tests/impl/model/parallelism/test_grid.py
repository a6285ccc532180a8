"""ParallelGrid: row-major (data, pipe, tensor) coordinates and the ranks they name.

The groups themselves are exercised by the multi-rank tensor-parallel and pipeline tests."""

from __future__ import annotations

import pytest

from realhf.api.core.allocation import ParallelismConfig
from realhf.base.distributed.topology import DataPipeTensorParallelTopology
from realhf.impl.model.parallelism.grid import ParallelGrid


def _grid(rank: int, d=2, p=2, m=2, world_ranks=None) -> ParallelGrid:
    layout = ParallelismConfig(data=d, pipe=p, tensor=m)
    ranks = tuple(world_ranks or range(layout.world_size))
    topo = DataPipeTensorParallelTopology(d, p, m)
    return ParallelGrid(layout, topo, rank, ranks, {})


def test_ranks_are_row_major_over_data_pipe_tensor():
    coords = [tuple(_grid(r).coord) for r in range(8)]
    assert coords == [(d, p, t) for d in range(2) for p in range(2) for t in range(2)]
    g = _grid(5)  # data 1, pipe 0, tensor 1
    assert (g.dp_rank, g.pp_rank, g.tp_rank) == (1, 0, 1)
    assert g.is_first_stage and not g.is_last_stage
    assert (g.prev_stage, g.next_stage) == (None, 7)
    assert g.replica_ranks() == [4, 5, 6, 7] and g.dp_head(0) == 0 and g.dp_head(1) == 4


def test_world_ranks_map_grid_ranks():
    g = _grid(3, d=1, p=2, m=2, world_ranks=(2, 3, 5, 6))
    assert (g.pp_rank, g.tp_rank) == (1, 1)
    assert g.prev_stage == 3 and g.next_stage is None
    assert g.replica_ranks() == [2, 3, 5, 6]


def test_without_distributed_only_one_rank_works():
    g = ParallelGrid.create(ParallelismConfig())
    assert (g.dp_size, g.pp_size, g.tp_size, g.groups["tensor"]) == (1, 1, 1, None)
    with pytest.raises(RuntimeError, match="initialise torch.distributed"):
        ParallelGrid.create(ParallelismConfig(tensor=2))


@pytest.mark.parametrize("ranks", [(1, 0), (0, 0), (0, 1, 2)])
def test_ranks_must_be_increasing_and_one_per_grid_rank(ranks):
    # Increasing: torch orders a group by world rank, which must be the axis order.
    with pytest.raises(ValueError, match="increasing world ranks"):
        ParallelGrid.create(ParallelismConfig(tensor=2), ranks=ranks)
