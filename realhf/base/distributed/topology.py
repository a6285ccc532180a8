"""Process topologies: mapping ranks to coordinates on named parallel axes.

A :class:`ProcessTopology` with ``axes=["pipe", "data", "tensor"]`` and
``dims=[2, 2, 2]`` lays ranks out row-major, the *last* axis varying fastest:
rank 0 = (pipe 0, data 0, tensor 0), rank 1 = (0, 0, 1), rank 2 = (0, 1, 0) …
Training uses (pipe, data, tensor) and inference (data, pipe, tensor), so
tensor-parallel peers are always adjacent ranks (same host on GPUs).
"""

from __future__ import annotations

import collections
import itertools
from typing import Dict, List, Sequence, Tuple

__all__ = [
    "ProcessTopology",
    "PipeDataTensorParallelTopology",
    "DataPipeTensorParallelTopology",
]


class ProcessTopology:
    """Row-major map between ranks and named coordinates.

    Args:
        axes: axis names, outermost first, e.g. ``["pipe", "data", "tensor"]``.
        dims: size of each axis; the world size is their product.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(
                f"ProcessTopology needs one dim per axis, got axes={axes} and dims={dims}."
            )
        if not axes:
            raise ValueError("ProcessTopology needs at least one axis.")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology axes must be distinct, got {axes}.")
        for a in axes:
            if not isinstance(a, str) or not a.isidentifier():
                raise ValueError(f"ProcessTopology axis name {a!r} must be a Python identifier.")
        for a, d in zip(axes, dims):
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise ValueError(
                    f"ProcessTopology dim of axis {a!r} must be an int >= 1, got {d!r}."
                )
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = collections.namedtuple("ProcessCoord", axes)
        # itertools.product varies its last iterable fastest, which is exactly the
        # row-major order promised above.  Both directions are tabulated: one
        # entry per rank is small, and lookups happen often.
        self._coord_of: List[Tuple[int, ...]] = list(itertools.product(*(range(d) for d in dims)))
        self._rank_of: Dict[Tuple[int, ...], int] = {c: r for r, c in enumerate(self._coord_of)}

    def __repr__(self) -> str:
        shape = ", ".join(f"{a}={d}" for a, d in zip(self.axes, self.dims))
        return f"{type(self).__name__}({shape})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessTopology) and (self.axes, self.dims) == (
            other.axes,
            other.dims,
        )

    def __hash__(self) -> int:
        return hash((tuple(self.axes), tuple(self.dims)))

    def world_size(self) -> int:
        """Number of ranks (product of dims)."""
        return len(self._coord_of)

    def get_axis_names(self) -> List[str]:
        """Axis names, outermost first."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis``."""
        return self.dims[self._axis_index(axis)]

    def _axis_index(self, axis: str) -> int:
        try:
            return self.axes.index(axis)
        except ValueError:
            raise ValueError(
                f"Unknown axis {axis!r}; this topology has axes {self.axes}."
            ) from None

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size():
            raise ValueError(
                f"rank {rank!r} out of range for {self!r} (world size {self.world_size()})."
            )

    def get_rank(self, **coord: int) -> int:
        """The rank at ``coord``, which must name every axis (e.g. ``pipe=1, data=0, tensor=1``)."""
        if set(coord) != set(self.axes):
            raise ValueError(
                f"get_rank needs exactly the axes {self.axes}, got {sorted(coord)}; "
                "use filter_match() for partial coordinates."
            )
        key = tuple(coord[a] for a in self.axes)
        if key not in self._rank_of:
            raise ValueError(f"coordinate {coord} is outside {self!r}.")
        return self._rank_of[key]

    def get_coord(self, rank: int):
        """The ``ProcessCoord`` namedtuple of ``rank``."""
        self._check_rank(rank)
        return self.ProcessCoord(*self._coord_of[rank])

    def filter_match(self, **partial: int) -> List[int]:
        """Ranks whose coordinates match every given axis value, ascending."""
        idx = {self._axis_index(a): v for a, v in partial.items()}
        return [r for r, c in enumerate(self._coord_of) if all(c[i] == v for i, v in idx.items())]

    def get_axis_list(self, axis: str, idx: int) -> List[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``."""
        dim = self.get_dim(axis)
        if not 0 <= idx < dim:
            raise ValueError(f"index {idx} out of range for axis {axis!r} of size {dim}.")
        return self.filter_match(**{axis: idx})

    def get_axis_comm_lists(self, axis: str) -> List[List[int]]:
        """Groups of ranks that differ only along ``axis`` (one communicator each).

        E.g. for axes (pipe, data, tensor) = (2, 2, 2), ``"tensor"`` gives
        ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` and ``"pipe"`` gives
        ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.  Groups are ordered by the
        other axes' coordinates (row-major); an axis of size 1 still gives
        singleton groups.
        """
        a = self._axis_index(axis)
        others = [i for i in range(len(self.axes)) if i != a]
        lists = []
        for other in itertools.product(*(range(self.dims[i]) for i in others)):
            coord = dict(zip(others, other))
            ranks = []
            for k in range(self.dims[a]):
                coord[a] = k
                ranks.append(self._rank_of[tuple(coord[i] for i in range(len(self.axes)))])
            lists.append(ranks)
        return lists

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Sequence[str] = ("data",),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A string naming ``rank``'s coordinates, e.g. ``"pipe_01-tensor_00"``.

        Used in checkpoint shard file names, so ranks that hold the same
        parameters (differing only along ``omit_axes``) get the same name.
        Indices are zero-padded to two digits so names sort correctly.
        """
        # Validate first: a misspelt axis would otherwise be silently kept in
        # the name, and shards of different DP ranks would stop matching.
        for a in omit_axes:
            self._axis_index(a)
        coord = self.get_coord(rank)
        parts = [f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes]
        return outer_sep.join(parts)


class PipeDataTensorParallelTopology(ProcessTopology):
    """Training layout: axes (pipe, data, tensor)."""

    def __init__(self, num_pp: int, num_dp: int, num_tp: int) -> None:
        super().__init__(axes=["pipe", "data", "tensor"], dims=[num_pp, num_dp, num_tp])


class DataPipeTensorParallelTopology(ProcessTopology):
    """Inference/generation layout: axes (data, pipe, tensor)."""

    def __init__(self, num_dp: int, num_pp: int, num_tp: int) -> None:
        super().__init__(axes=["data", "pipe", "tensor"], dims=[num_dp, num_pp, num_tp])
