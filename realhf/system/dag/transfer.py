"""Moving an MFC's input data between model workers: the transfer plan and its execution.

The master decides, the model workers move.  Once the master has cut a call's ids into one
group per data-parallel replica (:func:`realhf.system.dag.dp_split.partition_for_dp`; every
rank of a replica gets its group):

1. :func:`build_transfer_plan` lists, for every input key, which rank sends which items
   to which rank: an ordered list of :class:`TransferStep` s, one per (key, src, dst)
   with data to move.  A rank that already holds a key (it produced it, loaded it or
   received it earlier) is never sent it again.  A step carries the sequence lengths,
   dtype and trailing shape, so the receiver allocates its buffer without asking.
2. Every model worker runs :func:`execute_plan` on the *same* plan, in plan order,
   with blocking point-to-point send/recv: the source sends, the destination receives,
   everyone else skips.  This cannot deadlock: a step involves two ranks, each reaches
   it after finishing all earlier steps it takes part in, which by induction finish.
   The master dispatches one MFC at a time to all ranks and workers serve requests in
   order, so plans of different MFCs never interleave.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "TransferStep",
    "TransferStats",
    "DataTransferError",
    "build_transfer_plan",
    "execute_plan",
]


class DataTransferError(RuntimeError):
    """A transfer step failed (peer gone, timeout, shape mismatch); names the step."""


@dataclasses.dataclass(frozen=True)
class TransferStep:
    """Send ``key`` of items ``ids`` from rank ``src`` to rank ``dst``.

    The data travels as one packed tensor of shape ``[sum of all seqlens, *trailing_shape]``
    (items in ``ids`` order); ``seqlens[j]`` are item j's sequence lengths.
    """

    key: str
    src: int
    dst: int
    ids: Tuple[str, ...]
    seqlens: Tuple[Tuple[int, ...], ...]
    dtype: torch.dtype
    trailing_shape: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.src == self.dst:
            raise ValueError(f"TransferStep {self.key!r}: src and dst are both rank {self.src}")
        if len(self.ids) != len(self.seqlens) or not self.ids:
            raise ValueError(
                f"TransferStep {self.key!r}: {len(self.ids)} ids and {len(self.seqlens)} seqlens; "
                "give one (non-empty) list of lengths per id"
            )

    @property
    def n_rows(self) -> int:
        """Rows of the packed tensor (total tokens)."""
        return sum(sum(l) for l in self.seqlens)

    def describe(self) -> str:
        """``key 'x': rank 0 -> 1, 3 items, 42 rows``."""
        return (
            f"key {self.key!r}: rank {self.src} -> {self.dst}, {len(self.ids)} items, "
            f"{self.n_rows} rows"
        )


@dataclasses.dataclass
class TransferStats:
    """What one rank moved while executing a plan."""

    n_sent: int = 0
    n_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


def build_transfer_plan(
    partitions: Sequence[Sequence[str]],
    keys: Sequence[str],
    holders: Mapping[Tuple[str, str], Sequence[int]],
    seqlens: Callable[[str, str], Sequence[int]],
    dtypes: Mapping[str, torch.dtype],
    trailing_shapes: Mapping[str, Tuple[int, ...]],
) -> List[TransferStep]:
    """The steps that bring every rank the ``keys`` of its partition.

    Args:
        partitions: ``partitions[r]`` = ids rank r will process (the ranks of one
            data-parallel replica share a partition).
        keys: the MFC's input keys (buffer names).
        holders: ``(id, key) -> ranks holding it`` (owner first).
        seqlens: ``seqlens(id, key)`` = the item's sequence lengths for ``key``.
        dtypes, trailing_shapes: per key.

    A missing key is fetched from its lowest-numbered holder.  Steps come ordered by
    key (in ``keys`` order), then source rank, then destination rank; a step's ids keep
    their partition order.
    """
    grouped: Dict[Tuple[int, int, int], List[str]] = {}
    for ki, key in enumerate(keys):
        for dst, part in enumerate(partitions):
            for id_ in part:
                hs = holders.get((id_, key))
                if not hs:
                    raise ValueError(
                        f"build_transfer_plan: no rank holds key {key!r} of item {id_!r}"
                    )
                if dst in hs:
                    continue
                grouped.setdefault((ki, min(hs), dst), []).append(id_)
    plan = []
    for ki, src, dst in sorted(grouped):
        key, ids = keys[ki], grouped[(ki, src, dst)]
        plan.append(
            TransferStep(
                key=key,
                src=src,
                dst=dst,
                ids=tuple(ids),
                seqlens=tuple(tuple(seqlens(i, key)) for i in ids),
                dtype=dtypes[key],
                trailing_shape=tuple(trailing_shapes[key]),
            )
        )
    return plan


# gloo has no bool; ship those bytes as uint8.
_WIRE_DTYPE = {torch.bool: torch.uint8}


def execute_plan(
    plan: Sequence[TransferStep],
    rank: int,
    store,
    group=None,
    device: Optional[torch.device] = None,
) -> TransferStats:
    """Run this rank's part of ``plan`` (see the module docstring).

    Args:
        plan: the same list on every rank.
        rank: this rank in ``group`` (= its model-worker rank).
        store: a :class:`~realhf.system.dag.local_store.LocalStore` with ``get``/``put``.
        group: the process group (gloo recommended for host tensors); None = default.
        device: where the wire tensors live (CPU for gloo, the GPU for nccl).

    Raises:
        DataTransferError: naming the step, this rank and the cause (timeouts included:
            the group's timeout bounds every send/recv).
    """
    stats = TransferStats()
    t0 = time.monotonic()
    device = device or torch.device("cpu")
    for n, step in enumerate(plan):
        if rank not in (step.src, step.dst):
            continue
        try:
            if rank == step.src:
                x = torch.cat([store.get(i, step.key) for i in step.ids], dim=0)
                if tuple(x.shape) != (step.n_rows, *step.trailing_shape):
                    raise ValueError(
                        f"local data has shape {tuple(x.shape)}, the plan expects "
                        f"{(step.n_rows, *step.trailing_shape)}"
                    )
                # send() needs one contiguous buffer; the receiver allocates it from the step.
                wire = x.to(device=device, dtype=_WIRE_DTYPE.get(x.dtype, x.dtype)).contiguous()
                dist.send(wire, dst=_global(step.dst, group), group=group)
                stats.n_sent += 1
                stats.bytes_sent += wire.numel() * wire.element_size()
            else:
                wire = torch.empty(
                    (step.n_rows, *step.trailing_shape),
                    dtype=_WIRE_DTYPE.get(step.dtype, step.dtype),
                    device=device,
                )
                dist.recv(wire, src=_global(step.src, group), group=group)
                x = wire.to(dtype=step.dtype)
                parts = torch.split(x, [sum(l) for l in step.seqlens], dim=0)
                for id_, lens, part in zip(step.ids, step.seqlens, parts):
                    store.put(id_, step.key, part, lens)
                stats.n_received += 1
                stats.bytes_received += wire.numel() * wire.element_size()
        except Exception as e:
            raise DataTransferError(
                f"data transfer step {n + 1}/{len(plan)} ({step.describe()}) failed on rank "
                f"{rank}: {type(e).__name__}: {e}"
            ) from e
    stats.seconds = time.monotonic() - t0
    return stats


def _global(rank: int, group) -> int:
    # send/recv address peers by global rank even when given a group; plan ranks are ranks
    # in `group`.
    if group is None:
        return rank
    return dist.get_global_rank(group, rank)
