"""Carrying out a reallocation plan (:mod:`realhf.impl.model.parallelism.realloc`).

:func:`compile_plan` turns a plan into one rank's :class:`RankPlan`: per peer, the
intervals of its buffer that one message carries, and its local copies as one interval
move; :meth:`RankPlan.run` carries it out over torch.distributed with the compiled interval
kernels (:mod:`realhf.impl.kernels`), so a layout change costs about the transfers
themselves, not one Python step per row.  :func:`reallocate` compiles and runs at once.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from realhf.impl.kernels import merge_intervals, set_intervals, slice_intervals
from realhf.impl.model.parallelism.realloc import Copy

__all__ = ["RankPlan", "compile_plan", "reallocate"]


@dataclasses.dataclass(frozen=True)
class _Side:
    """Where a message's elements sit in one rank's flat buffer, in message order."""

    intervals: torch.Tensor  # int64 [N, 2], adjacent ones merged
    length: int  # elements
    end: int  # the least size of the buffer
    whole: Optional[Tuple[int, int]]  # the one interval, when N == 1: no packing needed

    @staticmethod
    def of(pairs: List[Tuple[int, int]]) -> "_Side":
        iv = merge_intervals(torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2))
        length = int((iv[:, 1] - iv[:, 0]).sum())
        whole = (int(iv[0, 0]), int(iv[0, 1])) if len(iv) == 1 else None
        return _Side(iv, length, int(iv[:, 1].max()), whole)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.whole[0] : self.whole[1]]


@dataclasses.dataclass(frozen=True)
class _Message:
    """One point-to-point message with ``peer``: its elements in this rank's buffer (the
    source buffer when sending, the destination buffer when receiving)."""

    peer: int
    side: _Side


@dataclasses.dataclass(frozen=True)
class _Local:
    """All of this rank's local copies as one move from ``src`` intervals to ``dst`` ones."""

    src: _Side
    dst: _Side


def _message_order(copies: List[Copy]) -> List[Copy]:
    """The order of the copies inside one message (sender and receiver compute the same).

    The sender's buffer order when that makes the message one piece of the sender's
    buffer (sent as a view, no packing), else the receiver's, which may make it one piece
    of the receiver's buffer (received in place, no unpacking: e.g. p2 -> m2, where a
    stage's part of a tensor shard is a prefix of the shard's buffer).
    """
    by_src = sorted(copies, key=lambda c: (c.src_offset, c.dst_offset))
    if all(a.src_offset + a.length == b.src_offset for a, b in zip(by_src, by_src[1:])):
        return by_src
    return sorted(copies, key=lambda c: (c.dst_offset, c.src_offset))


def _sides(copies: List[Copy]) -> Tuple[_Side, _Side]:
    ordered = _message_order(copies)
    src = _Side.of([(c.src_offset, c.src_offset + c.length) for c in ordered])
    dst = _Side.of([(c.dst_offset, c.dst_offset + c.length) for c in ordered])
    return src, dst


@dataclasses.dataclass(frozen=True)
class _Buffers:
    """Staging buffers of one dtype and device, reused by every run (None: not needed)."""

    send: List[Optional[torch.Tensor]]
    recv: List[Optional[torch.Tensor]]
    local: Optional[torch.Tensor]


@dataclasses.dataclass(eq=False)
class RankPlan:
    """One rank's part of a reallocation plan, compiled by :func:`compile_plan`.

    Per peer it sends to, the intervals of the source buffer making up the message; per
    peer it receives from, the intervals of the destination buffer the message fills; its
    local copies as one move between source and destination intervals.  A message that is
    one piece of the buffer goes out of (or lands in) a view of it; otherwise it is packed
    (unpacked) by the compiled interval kernels through staging buffers that the plan keeps
    between runs, per dtype and device.  Callers cache a RankPlan per pair of layouts.
    """

    rank: int
    sends: Tuple[_Message, ...]
    recvs: Tuple[_Message, ...]
    local: Optional[_Local]
    _buffers: Dict[Tuple[torch.dtype, torch.device], _Buffers] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def counts(self) -> Dict[str, int]:
        """The elements this rank sends, receives and copies locally per run."""
        return {
            "sent": sum(m.side.length for m in self.sends),
            "received": sum(m.side.length for m in self.recvs),
            "local": 0 if self.local is None else self.local.dst.length,
        }

    def run(
        self,
        src_flat: Optional[torch.Tensor],
        dst_flat: Optional[torch.Tensor],
        group=None,
    ) -> Dict[str, int]:
        """Carry out this rank's part: pack, post every send and receive in one
        ``batch_isend_irecv`` (no ordering between ranks can deadlock), copy locally while
        the messages are in flight, wait, unpack.

        ``src_flat`` is this rank's source flat buffer (None if it sends and copies
        nothing), ``dst_flat`` its destination one (None if it receives and copies
        nothing); they must not overlap.  Every rank in the plan calls this at the same
        time.  Returns :attr:`counts`.
        """
        self._check(src_flat, dst_flat)
        like = src_flat if src_flat is not None else dst_flat
        if like is None:
            return self.counts
        bufs = self._staging(like.dtype, like.device)
        ops = []
        for m, packed in zip(self.sends, bufs.send):
            if packed is None:
                payload = m.side.view(src_flat)
            else:
                payload = slice_intervals(src_flat, m.side.intervals, out=packed)
            ops.append(dist.P2POp(dist.isend, payload, peer=m.peer, group=group))
        for m, inbox in zip(self.recvs, bufs.recv):
            target = m.side.view(dst_flat) if inbox is None else inbox
            ops.append(dist.P2POp(dist.irecv, target, peer=m.peer, group=group))
        works = dist.batch_isend_irecv(ops) if ops else []
        try:
            if self.local is not None:
                self._copy_local(src_flat, dst_flat, bufs.local)
        finally:
            # Exactly once each: with gloo a second wait on a finished send hangs.
            for work in works:
                work.wait()
        for m, inbox in zip(self.recvs, bufs.recv):
            if inbox is not None:
                set_intervals(inbox, dst_flat, m.side.intervals)
        return self.counts

    def free_buffers(self) -> None:
        """Drop the staging buffers (the next run allocates them again)."""
        self._buffers.clear()

    def _copy_local(self, src_flat, dst_flat, scratch: Optional[torch.Tensor]) -> None:
        src, dst = self.local.src, self.local.dst
        if src.whole is not None and dst.whole is not None:
            dst.view(dst_flat).copy_(src.view(src_flat))
        elif src.whole is not None:
            set_intervals(src.view(src_flat), dst_flat, dst.intervals)
        elif dst.whole is not None:
            slice_intervals(src_flat, src.intervals, out=dst.view(dst_flat))
        else:
            set_intervals(
                slice_intervals(src_flat, src.intervals, out=scratch), dst_flat, dst.intervals
            )

    def _staging(self, dtype: torch.dtype, device: torch.device) -> _Buffers:
        key = (dtype, device)
        if key not in self._buffers:

            def buf(side: _Side) -> Optional[torch.Tensor]:
                return None if side.whole else torch.empty(side.length, dtype=dtype, device=device)

            local = self.local
            self._buffers[key] = _Buffers(
                send=[buf(m.side) for m in self.sends],
                recv=[buf(m.side) for m in self.recvs],
                local=(
                    torch.empty(local.src.length, dtype=dtype, device=device)
                    if local is not None and local.src.whole is None and local.dst.whole is None
                    else None
                ),
            )
        return self._buffers[key]

    def _check(self, src_flat, dst_flat) -> None:
        what = f"RankPlan.run (rank {self.rank})"
        need_src = max([m.side.end for m in self.sends] + [self.local.src.end if self.local else 0])
        need_dst = max([m.side.end for m in self.recvs] + [self.local.dst.end if self.local else 0])
        for name, flat, need in (
            ("src_flat", src_flat, need_src),
            ("dst_flat", dst_flat, need_dst),
        ):
            if flat is None:
                if need:
                    raise ValueError(
                        f"{what}: {name} is None but the plan reads or writes {name} up to "
                        f"element {need}; pass this rank's flat buffer of that layout"
                    )
                continue
            if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() < need:
                raise ValueError(
                    f"{what}: {name} must be a contiguous 1-D tensor of at least {need} "
                    f"elements (the plan's layout), got shape {tuple(flat.shape)}"
                )
        if src_flat is not None and dst_flat is not None:
            if (src_flat.dtype, src_flat.device) != (dst_flat.dtype, dst_flat.device):
                raise ValueError(
                    f"{what}: src_flat is {src_flat.dtype} on {src_flat.device} but dst_flat is "
                    f"{dst_flat.dtype} on {dst_flat.device}; reallocation copies, it does not cast"
                )


def compile_plan(plan: Sequence[Copy], rank: int) -> RankPlan:
    """World ``rank``'s part of ``plan`` as a :class:`RankPlan` (intervals precomputed)."""
    sends: Dict[int, List[Copy]] = {}
    recvs: Dict[int, List[Copy]] = {}
    local: List[Copy] = []
    for c in plan:
        if c.length == 0:
            continue
        if c.src == rank and c.dst == rank:
            local.append(c)
        elif c.src == rank:
            sends.setdefault(c.dst, []).append(c)
        elif c.dst == rank:
            recvs.setdefault(c.src, []).append(c)
    return RankPlan(
        rank,
        sends=tuple(_Message(p, _sides(cs)[0]) for p, cs in sorted(sends.items())),
        recvs=tuple(_Message(p, _sides(cs)[1]) for p, cs in sorted(recvs.items())),
        local=_Local(*_sides(local)) if local else None,
    )


def reallocate(
    plan: Sequence[Copy],
    rank: int,
    src_flat: Optional[torch.Tensor],
    dst_flat: Optional[torch.Tensor],
    group=None,
) -> Dict[str, int]:
    """Carry out the copies of ``plan`` that involve world ``rank``: ``compile_plan`` then
    :meth:`RankPlan.run` (see there).  Callers that reallocate the same pair of layouts
    again should keep the compiled plan instead.  Returns the elements sent, received and
    copied locally."""
    return compile_plan(plan, rank).run(src_flat, dst_flat, group)
