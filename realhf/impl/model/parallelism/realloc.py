"""Reallocation plans: which flat intervals move where when a model changes layout.

Every rank of a layout holds, in its flat buffer, a rectangle of each parameter of its
pipeline stage: the whole parameter (replicated), a block of rows (column-parallel weights,
the vocabulary, a kv head range) or a block of columns (row-parallel weights).  Viewing each
parameter as a 2-D ``[rows, cols]`` array (a 1-D one as ``[n, 1]``), the element ``(i, j)`` of
a rank's rectangle ``[r0, r1) × [c0, c1)`` sits at ``offset + (i - r0)·(c1 - c0) + (j - c0)`` of
its flat buffer.

:func:`plan_reallocation` intersects, parameter by parameter, what each destination rank
holds with what the source ranks hold and emits :class:`Copy` entries ``(src rank, dst rank,
src offset, dst offset, length)``: one per row of a column block, one per rectangle
otherwise, merged where both sides are contiguous.  Every destination element is written
exactly once.  Among source ranks holding the same element (data-parallel replicas, copied kv
heads, replicated parameters) the destination's own rank is preferred (a local copy), then
senders are spread over the replicas.  Plans depend only on the model's architecture and the
two layouts, so callers compute them once per pair.

Carrying a plan out is :mod:`realhf.impl.model.parallelism.realloc_exec`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.api.core.allocation import ParallelismConfig
from realhf.base.distributed.topology import DataPipeTensorParallelTopology
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.parallel_hooks import LocalHooks
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.parallelism.model import stage_layers
from realhf.impl.model.parallelism.tensor_parallel import (
    kv_heads_of,
    local_shard_config,
    shard_rule,
)

__all__ = [
    "Copy",
    "Holding",
    "LayoutOnly",
    "holdings",
    "plan_reallocation",
    "rank_model",
    "source_name",
]

# A rectangle [r0, r1) x [c0, c1) of a parameter viewed as 2-D.
Rect = Tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one rank holds of one whole parameter: a rectangle and where it starts."""

    full_name: str  # the parameter of the single-device model
    rect: Rect
    offset: int  # in the rank's flat buffer


@dataclasses.dataclass(frozen=True)
class Copy:
    """Move ``length`` elements from ``src`` rank's flat buffer at ``src_offset`` to the
    ``dst`` rank's at ``dst_offset`` (world ranks)."""

    src: int
    dst: int
    src_offset: int
    dst_offset: int
    length: int


def _as_2d(shape: Tuple[int, ...]) -> Tuple[int, int]:
    return (shape[0], shape[1]) if len(shape) == 2 else (shape[0], 1)


def _rect(name: str, shape2d: Tuple[int, int], cfg: ReaLModelConfig, m: int, t: int) -> Rect:
    rows, cols = shape2d
    rule = shard_rule(name, cfg)
    if rule is None or m == 1:
        return (0, rows, 0, cols)
    kind, dim = rule
    if kind == "kv":
        lo, hi = kv_heads_of(cfg, m, t)
        return (lo * cfg.head_dim, hi * cfg.head_dim, 0, cols)
    if dim == 0:
        n = rows // m
        return (t * n, (t + 1) * n, 0, cols)
    n = cols // m
    return (0, rows, t * n, (t + 1) * n)


class LayoutOnly(LocalHooks):
    """Hooks that only shape a tensor-parallel shard (no collectives): for building a rank's
    layout (param spec) in any process, e.g. on the meta device."""

    def __init__(self, m: int):
        self.size = m

    def local_config(self, config: ReaLModelConfig) -> ReaLModelConfig:
        return config if self.size == 1 else local_shard_config(config, self.size)


def rank_model(
    config: ReaLModelConfig, layout: ParallelismConfig, grid_rank: int, device="meta"
) -> Tuple[ReaLModel, int]:
    """The (weightless on ``meta``) ReaLModel that ``grid_rank`` of ``layout`` holds, and its
    tensor rank."""
    topo = DataPipeTensorParallelTopology(layout.data, layout.pipe, layout.tensor)
    c = topo.get_coord(grid_rank)
    stage = stage_layers(config, layout.pipe)[c.pipe]
    model = ReaLModel(
        config, device=device, init_weights=False, tp=LayoutOnly(layout.tensor), layers=stage
    )
    return model, c.tensor


def source_name(model: ReaLModel, name: str) -> str:
    """The single-device parameter that ``name`` of ``model`` holds a part of."""
    head_w = f"{model.config.head_layer_idx}.weight"
    return "0.wte.weight" if model.head_copies_embedding and name == head_w else name


def holdings(config: ReaLModelConfig, layout: ParallelismConfig) -> List[List[Holding]]:
    """Per grid rank of ``layout``, what it holds of each parameter (no memory is
    allocated: the rank's model is built on the meta device)."""
    full_shapes = {
        n: s.shape
        for n, s in ReaLModel(config, device="meta", init_weights=False).param_spec.items()
    }
    out = []
    for r in range(layout.world_size):
        model, t = rank_model(config, layout, r)
        mine = []
        for name, spec in model.param_spec.items():
            full = source_name(model, name)
            rect = _rect(name, _as_2d(full_shapes[full]), config, layout.tensor, t)
            mine.append(Holding(full, rect, spec.offset))
        out.append(mine)
    return out


def _intersect(a: Rect, b: Rect) -> Optional[Rect]:
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def _copies(src: Holding, dst: Holding, part: Rect, s: int, d: int) -> List[Copy]:
    """The copies moving rectangle ``part`` from ``src`` to ``dst``: one per row, unless
    both sides hold whole rows of it (then one for the rectangle)."""
    r0, r1, c0, c1 = part
    sw, dw = src.rect[3] - src.rect[2], dst.rect[3] - dst.rect[2]

    def at(h: Holding, width: int, i: int, j: int) -> int:
        return h.offset + (i - h.rect[0]) * width + (j - h.rect[2])

    if c1 - c0 == sw == dw:  # whole rows on both sides: contiguous
        n = (r1 - r0) * (c1 - c0)
        return [Copy(s, d, at(src, sw, r0, c0), at(dst, dw, r0, c0), n)]
    return [Copy(s, d, at(src, sw, i, c0), at(dst, dw, i, c0), c1 - c0) for i in range(r0, r1)]


def _merge(copies: List[Copy]) -> List[Copy]:
    out: List[Copy] = []
    for c in sorted(copies, key=lambda c: (c.src, c.dst, c.dst_offset)):
        p = out[-1] if out else None
        if (
            p is not None
            and (p.src, p.dst) == (c.src, c.dst)
            and p.src_offset + p.length == c.src_offset
            and p.dst_offset + p.length == c.dst_offset
        ):
            out[-1] = dataclasses.replace(p, length=p.length + c.length)
        else:
            out.append(c)
    return out


def plan_reallocation(
    config: ReaLModelConfig,
    src: ParallelismConfig,
    dst: ParallelismConfig,
    src_ranks: Optional[Sequence[int]] = None,
    dst_ranks: Optional[Sequence[int]] = None,
) -> List[Copy]:
    """The copies that turn ``src``-layout flat buffers into ``dst``-layout ones.

    ``src_ranks`` / ``dst_ranks`` map each layout's grid ranks to world ranks (default
    ``0..n-1``); a world rank in both may copy locally.
    """
    src_ranks = list(range(src.world_size)) if src_ranks is None else list(src_ranks)
    dst_ranks = list(range(dst.world_size)) if dst_ranks is None else list(dst_ranks)
    if len(src_ranks) != src.world_size or len(dst_ranks) != dst.world_size:
        raise ValueError(
            f"plan_reallocation: {src} needs {src.world_size} ranks and {dst} needs "
            f"{dst.world_size}; got {len(src_ranks)} and {len(dst_ranks)}"
        )
    src_h, dst_h = holdings(config, src), holdings(config, dst)
    # full parameter -> [(replica, world rank, holding)] over the source ranks
    by_param: Dict[str, List[Tuple[int, int, Holding]]] = {}
    per_replica = src.pipe * src.tensor
    for r, hs in enumerate(src_h):
        for h in hs:
            by_param.setdefault(h.full_name, []).append((r // per_replica, src_ranks[r], h))
    copies: List[Copy] = []
    for gd, hs in enumerate(dst_h):
        d = dst_ranks[gd]
        # Spread senders: destination replica k reads from source replica k mod d_src.
        replica = (gd // (dst.pipe * dst.tensor)) % src.data
        for h in hs:
            holders = by_param[h.full_name]
            # Distinct source rectangles; for each, the preferred holder: this very rank,
            # else one of the chosen replica, else any.
            best: Dict[Rect, Tuple[int, int, Holding]] = {}
            for k, s, sh in holders:
                score = (s != d, k != replica, s)
                if sh.rect not in best or score < best[sh.rect][0]:
                    best[sh.rect] = (score, s, sh)
            for rect, (_, s, sh) in best.items():
                part = _intersect(rect, h.rect)
                if part is not None:
                    copies.extend(_copies(sh, h, part, s, d))
    return _merge(copies)
