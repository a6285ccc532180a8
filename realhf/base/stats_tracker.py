"""Scoped statistics, reduced across ranks on export.

Code that computes something worth logging records it under the current
scope; the training loop exports everything once per step::

    from realhf.base import stats_tracker

    with stats_tracker.scope("ppo"):
        stats_tracker.denominator(n_tokens=loss_mask)          # bool tensor
        stats_tracker.stat(importance_weight=ratio, denominator="n_tokens")
        stats_tracker.scalar(lr=1e-5)                            # plain floats
    stats = stats_tracker.export()
    # {"ppo/n_tokens": 812.0, "ppo/importance_weight": 1.01, "ppo/lr": 1e-05}

Reduce types (:class:`ReduceType`): ``sum``, ``mean``, ``min``, ``max`` and
``avg_min_max`` (exports ``key/avg``, ``key/min``, ``key/max``).  Repeated
records of one key are reduced together, e.g. the mean over every record (and,
for ``stat``, over every unmasked element).

``stat`` values are per-element (per-token) tensors; only elements where the
named ``denominator`` mask (recorded in the same scope, same shape) is True
count.  A denominator exports its number of True elements.

When ``torch.distributed`` is initialised, ``export`` reduces over the group
(all ranks must call it): means are global (total sum / total count, not a
mean of means), min/max global, sums summed.  Keys recorded on only some
ranks are handled; keys with nothing to average (zero count) are left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import threading
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from realhf.base.distributed import dist_util

__all__ = [
    "ReduceType",
    "StatsTracker",
    "DEFAULT_TRACKER",
    "scope",
    "scalar",
    "denominator",
    "stat",
    "export",
]


class ReduceType(str, enum.Enum):
    """How repeated records of one key combine (locally and across ranks)."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    AVG_MIN_MAX = "avg_min_max"


# Which partial aggregates each reduce type needs.
_PARTIALS = {
    ReduceType.SUM: ("sum",),
    ReduceType.MEAN: ("sum", "count"),
    ReduceType.MIN: ("min",),
    ReduceType.MAX: ("max",),
    ReduceType.AVG_MIN_MAX: ("sum", "count", "min", "max"),
}


@dataclasses.dataclass
class _Record:
    reduce_type: ReduceType
    kind: str  # "scalar" | "stat" | "denominator"
    # Flat float64 values and matching bool masks (all-True for scalars).
    # float64 because sums run over every token of a step: float32 stops
    # counting exactly at 2**24 and its sums drift long before that.  Kept on
    # the CPU so that records piling up over micro-batches hold no GPU memory.
    values: List[torch.Tensor] = dataclasses.field(default_factory=list)
    masks: List[torch.Tensor] = dataclasses.field(default_factory=list)

    def partials(self) -> Dict[str, float]:
        v = torch.cat(self.values) if self.values else torch.zeros(0, dtype=torch.float64)
        m = torch.cat(self.masks) if self.masks else torch.zeros(0, dtype=torch.bool)
        sel = v[m]
        out = {}
        for p in _PARTIALS[self.reduce_type]:
            if p == "sum":
                out[p] = float(sel.sum())
            elif p == "count":
                out[p] = float(m.sum())
            elif p == "min":
                out[p] = float(sel.min()) if sel.numel() else math.inf
            else:
                out[p] = float(sel.max()) if sel.numel() else -math.inf
        return out


def _as_reduce_type(rt) -> ReduceType:
    try:
        return ReduceType(rt)
    except ValueError:
        raise ValueError(
            f"Unknown reduce type {rt!r}; valid: {[r.value for r in ReduceType]}."
        ) from None


def _finalize(key: str, rt: ReduceType, p: Dict[str, float], out: Dict[str, float]) -> None:
    if rt == ReduceType.SUM:
        out[key] = p["sum"]
    elif rt == ReduceType.MEAN:
        if p["count"] > 0:
            out[key] = p["sum"] / p["count"]
    elif rt == ReduceType.MIN:
        if p["min"] != math.inf:
            out[key] = p["min"]
    elif rt == ReduceType.MAX:
        if p["max"] != -math.inf:
            out[key] = p["max"]
    elif p["count"] > 0:
        out[f"{key}/avg"] = p["sum"] / p["count"]
        out[f"{key}/min"] = p["min"]
        out[f"{key}/max"] = p["max"]


class StatsTracker:
    """Collects scoped statistics until :meth:`export`. Thread-safe."""

    def __init__(self, name: str = "") -> None:
        self._root = name.strip("/")
        self._local = threading.local()  # scopes are per thread
        self._records: Dict[str, _Record] = {}
        self._masks: Dict[str, torch.Tensor] = {}  # latest mask per denominator key
        self._lock = threading.Lock()

    # ---- naming -------------------------------------------------------------

    @property
    def _scopes(self) -> List[str]:
        stack = getattr(self._local, "scopes", None)
        if stack is None:
            stack = self._local.scopes = []
        return stack

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside with ``name/`` (scopes nest)."""
        name = name.strip("/")
        if not name:
            raise ValueError("stats_tracker.scope needs a non-empty name.")
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def _key(self, name: str) -> str:
        return "/".join([s for s in [self._root, *self._scopes] if s] + [name])

    def _get(self, key: str, rt: ReduceType, kind: str) -> _Record:
        rec = self._records.get(key)
        if rec is None:
            rec = self._records[key] = _Record(rt, kind)
        elif (rec.reduce_type, rec.kind) != (rt, kind):
            raise ValueError(
                f"stats key {key!r} was recorded as {rec.kind} with reduce type "
                f"{rec.reduce_type.value}; now as {kind} with {rt.value}. Use another name."
            )
        return rec

    # ---- recording ----------------------------------------------------------

    def scalar(self, reduce_type=ReduceType.MEAN, **values: float) -> None:
        """Record plain numbers, e.g. ``scalar(lr=1e-5, loss=0.3)``."""
        rt = _as_reduce_type(reduce_type)
        with self._lock:
            for name, x in values.items():
                if isinstance(x, torch.Tensor):
                    if x.numel() != 1:
                        raise ValueError(
                            f"scalar {name!r} must be a number, got a tensor of shape "
                            f"{tuple(x.shape)}; use stat() for tensors."
                        )
                    x = x.item()
                if not isinstance(x, (int, float)) or isinstance(x, bool):
                    raise TypeError(f"scalar {name!r} must be a number, got {type(x).__name__}.")
                rec = self._get(self._key(name), rt, "scalar")
                rec.values.append(torch.tensor([float(x)], dtype=torch.float64))
                rec.masks.append(torch.ones(1, dtype=torch.bool))

    def denominator(self, **masks: torch.Tensor) -> None:
        """Record bool masks that later :meth:`stat` calls divide by (exports their count)."""
        with self._lock:
            for name, m in masks.items():
                if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                    raise TypeError(
                        f"denominator {name!r} must be a bool tensor, got "
                        f"{getattr(m, 'dtype', type(m).__name__)}."
                    )
                key = self._key(name)
                m = m.detach().flatten().cpu()
                rec = self._get(key, ReduceType.SUM, "denominator")
                rec.values.append(m.to(torch.float64))
                rec.masks.append(torch.ones_like(m))
                # stat() pairs values with the *latest* mask of this name, so a
                # loop that records denominator then stat per micro-batch keeps
                # each batch's values aligned with its own mask.
                self._masks[key] = m

    def stat(self, denominator: str, reduce_type=ReduceType.MEAN, **values: torch.Tensor) -> None:
        """Record per-element tensors masked by the scope's ``denominator`` mask."""
        rt = _as_reduce_type(reduce_type)
        with self._lock:
            dkey = self._key(denominator)
            mask = self._masks.get(dkey)
            if mask is None:
                raise ValueError(
                    f"denominator {dkey!r} was not recorded; call "
                    f"denominator({denominator}=mask) in this scope before stat()."
                )
            for name, v in values.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(
                        f"stat {name!r} must be a tensor, got {type(v).__name__}; "
                        "use scalar() for numbers."
                    )
                if v.numel() != mask.numel():
                    raise ValueError(
                        f"stat {name!r} has {v.numel()} elements (shape {tuple(v.shape)}) but "
                        f"denominator {dkey!r} has {mask.numel()}; they must match."
                    )
                rec = self._get(self._key(name), rt, "stat")
                rec.values.append(v.detach().flatten().cpu().to(torch.float64))
                rec.masks.append(mask)

    # ---- export -------------------------------------------------------------

    def export(
        self, reduce_group=None, reset: bool = True, *, reduce: bool = True
    ) -> Dict[str, float]:
        """Reduce everything recorded (across ``reduce_group`` if distributed) into a flat dict.

        Every rank of the group must call this (it is a collective).  Keys are
        sorted.  ``reset`` clears the records afterwards.  ``reduce=False`` keeps this
        rank's records only (no collective), for ranks whose peers recorded the same
        values (e.g. the ranks of one tensor-parallel replica).
        """
        # Snapshot under the lock, reduce outside it: the collectives wait for
        # the slowest rank, and other threads must be able to keep recording
        # (into the next step's records) meanwhile.
        with self._lock:
            local = {k: (r.reduce_type, r.partials()) for k, r in self._records.items()}
            if reset:
                self._records.clear()
                self._masks.clear()
        if reduce and dist.is_available() and dist.is_initialized():
            local = _all_reduce_partials(local, reduce_group)
        out: Dict[str, float] = {}
        for key in sorted(local):
            rt, p = local[key]
            _finalize(key, rt, p, out)
        return out

    def reset(self) -> None:
        """Drop everything recorded so far."""
        with self._lock:
            self._records.clear()
            self._masks.clear()


def _all_reduce_partials(local, group):
    """Union keys over ranks, then SUM/MIN/MAX-reduce the partials in 3 collectives."""
    # A rank that saw no data for a key (e.g. no sample of some kind this step)
    # never recorded it, yet must still contribute to that key's collective.
    # Gathering the key names first gives every rank the same sorted union, so
    # slot i of each reduced tensor means the same key on every rank.
    world = dist.get_world_size(group)
    gathered: List[Optional[Dict[str, str]]] = [None] * world
    dist.all_gather_object(gathered, {k: rt.value for k, (rt, _) in local.items()}, group=group)
    types: Dict[str, ReduceType] = {}
    for rank, kinds in enumerate(gathered):
        for k, rt in kinds.items():
            if k in types and types[k].value != rt:
                raise ValueError(
                    f"stats key {k!r} has reduce type {types[k].value} on one rank and {rt} "
                    f"on rank {rank}; record it the same way everywhere."
                )
            types[k] = ReduceType(rt)
    keys = sorted(types)
    slots = {"sum": [], "count": [], "min": [], "max": []}
    for k in keys:
        p = local[k][1] if k in local else {}
        for name in _PARTIALS[types[k]]:
            # Identity elements of each reduction, so absent keys change nothing.
            default = {"min": math.inf, "max": -math.inf}.get(name, 0.0)
            slots[name].append((k, p.get(name, default)))
    reduced: Dict[str, Dict[str, float]] = {k: {} for k in keys}
    for name, op in (
        ("sum", dist.ReduceOp.SUM),
        ("count", dist.ReduceOp.SUM),
        ("min", dist.ReduceOp.MIN),
        ("max", dist.ReduceOp.MAX),
    ):
        entries = slots[name]
        # Every rank has the same key union, hence the same slot lengths, so
        # skipping empty slots keeps all ranks' collectives in lockstep.
        if not entries:
            continue
        t = torch.tensor([v for _, v in entries], dtype=torch.float64)
        dist_util.all_reduce_(t, op, group)  # nccl: via the GPU and back
        for (k, _), v in zip(entries, t.tolist()):
            reduced[k][name] = v
    return {k: (types[k], reduced[k]) for k in keys}


#: The process-wide tracker the module functions use.
DEFAULT_TRACKER = StatsTracker()
scope = DEFAULT_TRACKER.scope
scalar = DEFAULT_TRACKER.scalar
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
export = DEFAULT_TRACKER.export
reset = DEFAULT_TRACKER.reset
