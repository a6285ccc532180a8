"""The process grid of one model layout: ``d × p × m`` ranks and a group per axis.

Ranks are laid out row-major over (data, pipe, tensor), tensor varying fastest
(:class:`~realhf.base.distributed.topology.DataPipeTensorParallelTopology`): tensor-parallel
peers are adjacent ranks (one host on GPUs), and data-parallel replica ``k`` is the
contiguous block ``[k·p·m, (k+1)·p·m)``.  For ``d2p2m2``::

    rank  0 1 2 3 4 5 6 7
    data  0 0 0 0 1 1 1 1
    pipe  0 0 1 1 0 0 1 1
    tensor 0 1 0 1 0 1 0 1

Groups (torch.distributed), each holding this rank:

``data``   the ranks that differ only in ``data`` (gradient all-reduce);
``pipe``   the ranks that differ only in ``pipe`` (activations stage to stage);
``tensor`` the ranks that differ only in ``tensor`` (the collectives inside layers);
``model``  the ``p·m`` ranks of one data-parallel replica (grad norm, stats, data broadcast);
``embed``  the first and last pipeline stage of one (data, tensor) position, which both hold
           a tied embedding matrix (None unless ``p > 1``).

``dist.new_group`` must be called by every process of the world in the same order, so
:meth:`ParallelGrid.create` is called by every rank of the world, also ranks outside the grid
(``ranks`` maps grid ranks to world ranks) — those get no grid.  Without torch.distributed
(one process), a ``d1p1m1`` grid has no groups and every collective is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from realhf.api.core.allocation import ParallelismConfig
from realhf.base.distributed.topology import DataPipeTensorParallelTopology

__all__ = ["ParallelGrid", "AXES"]

AXES = ("data", "pipe", "tensor")


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity
class ParallelGrid:
    """This rank's coordinates in a model layout and its groups (see the module docstring).

    Attributes:
        layout: the parallel degrees.
        topo: rank <-> (data, pipe, tensor) coordinates, in grid ranks.
        grid_rank: this process's rank in the grid.
        world_ranks: world rank of each grid rank.
        groups: ``{"data"|"pipe"|"tensor"|"model": group}``; a group of one rank is None.
    """

    layout: ParallelismConfig
    topo: DataPipeTensorParallelTopology
    grid_rank: int
    world_ranks: tuple
    groups: Dict[str, Optional[object]]

    # ---- construction ----------------------------------------------------

    @classmethod
    def single(cls) -> "ParallelGrid":
        """The ``d1p1m1`` grid of a lone process (no groups)."""
        layout = ParallelismConfig()
        topo = DataPipeTensorParallelTopology(1, 1, 1)
        return cls(layout, topo, 0, (0,), {a: None for a in AXES + ("model", "embed")})

    @classmethod
    def create(
        cls,
        layout: ParallelismConfig,
        ranks: Optional[Sequence[int]] = None,
        backend: Optional[str] = None,
    ) -> Optional["ParallelGrid"]:
        """Build the groups of ``layout`` over world ranks ``ranks`` (default ``0..n-1``).

        Every process of the torch.distributed world must call this, with the same
        arguments; it returns None on a process outside ``ranks``.

        Raises:
            ValueError: ``ranks`` does not match the layout's world size, repeats a rank or
                names ranks outside the world.
        """
        n = layout.world_size
        ranks = tuple(range(n)) if ranks is None else tuple(int(r) for r in ranks)
        if len(ranks) != n or any(a >= b for a, b in zip(ranks, ranks[1:])):
            # Increasing, so that a group's ranks (torch orders them by world rank) are the
            # grid coordinates along its axis: all_gather returns shards in tensor-rank order.
            raise ValueError(
                f"layout {layout} needs {n} increasing world ranks, got {list(ranks)}; "
                "give one world rank per grid rank, in order"
            )
        if not (dist.is_available() and dist.is_initialized()):
            if n == 1 and ranks == (0,):
                return cls.single()
            raise RuntimeError(
                f"layout {layout} spans {n} processes: initialise torch.distributed first "
                "(realhf.system.transport.process_group.init_world on model workers)"
            )
        world = dist.get_world_size()
        if max(ranks) >= world or min(ranks) < 0:
            raise ValueError(f"ranks {list(ranks)} lie outside the world of {world} processes")
        topo = DataPipeTensorParallelTopology(layout.data, layout.pipe, layout.tensor)
        me = dist.get_rank()
        grid_rank = ranks.index(me) if me in ranks else None
        groups: Dict[str, Optional[object]] = {}
        lists = {a: topo.get_axis_comm_lists(a) for a in AXES}
        lists["model"] = [topo.filter_match(data=k) for k in range(layout.data)]
        lists["embed"] = [[g[0], g[-1]] for g in lists["pipe"]] if layout.pipe > 1 else []
        for name in AXES + ("model", "embed"):
            mine = None
            for members in lists[name]:
                # Singleton groups are skipped on every rank alike, so the calls stay aligned.
                if len(members) == 1:
                    continue
                g = dist.new_group([ranks[r] for r in members], backend=backend)
                if grid_rank in members:
                    mine = g
            groups[name] = mine
        if grid_rank is None:
            return None
        return cls(layout, topo, grid_rank, ranks, groups)

    # ---- coordinates -----------------------------------------------------

    @property
    def coord(self):
        """``ProcessCoord(data, pipe, tensor)`` of this rank."""
        return self.topo.get_coord(self.grid_rank)

    @property
    def dp_rank(self) -> int:
        return self.coord.data

    @property
    def pp_rank(self) -> int:
        return self.coord.pipe

    @property
    def tp_rank(self) -> int:
        return self.coord.tensor

    @property
    def dp_size(self) -> int:
        return self.layout.data

    @property
    def pp_size(self) -> int:
        return self.layout.pipe

    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def world_rank_of(self, **coord: int) -> int:
        """World rank at grid coordinates ``data=, pipe=, tensor=``."""
        return self.world_ranks[self.topo.get_rank(**coord)]

    def stage_rank(self, pipe: int) -> int:
        """World rank of the same (data, tensor) position at pipeline stage ``pipe``."""
        c = self.coord
        return self.world_rank_of(data=c.data, pipe=pipe, tensor=c.tensor)

    @property
    def prev_stage(self) -> Optional[int]:
        """World rank of the previous stage (None on the first stage)."""
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_stage(self) -> Optional[int]:
        """World rank of the next stage (None on the last stage)."""
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    def dp_head(self, data: int) -> int:
        """World rank of replica ``data``'s (pipe 0, tensor 0) rank: the one that owns the
        replica's data in the master's view."""
        return self.world_rank_of(data=data, pipe=0, tensor=0)

    def replica_ranks(self, data: Optional[int] = None) -> List[int]:
        """World ranks of data-parallel replica ``data`` (default: this rank's)."""
        k = self.dp_rank if data is None else data
        return [self.world_ranks[r] for r in self.topo.filter_match(data=k)]

    def __repr__(self) -> str:
        c = self.coord
        return (
            f"ParallelGrid({self.layout}, rank {self.grid_rank}: data {c.data}, "
            f"pipe {c.pipe}, tensor {c.tensor})"
        )
