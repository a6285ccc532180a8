"""Carrying out a reallocation plan (:mod:`realhf.impl.model.parallelism.realloc`).

:func:`compile_plan` turns a plan into one rank's :class:`RankPlan`: per peer, the
intervals of its buffer that one message carries, and its local copies as one interval
move; :meth:`RankPlan.run` carries it out over torch.distributed with the compiled interval
kernels (:mod:`realhf.impl.kernels`), so a layout change costs about the transfers
themselves, not one Python step per row.  :func:`reallocate` compiles and runs at once.

One-to-many messages become broadcasts.  When a sender's messages to two or more receivers
carry the same source intervals in the same order (d1 -> d4: the whole model to three
ranks; m2 -> d4: each shard to every replica lacking it), they are one broadcast among the
sender and those receivers instead of one send per receiver.  Every rank derives the same
broadcast list, sorted by (sender, receivers), from the same plan.

Run order, which cannot deadlock: (1) create the missing broadcast groups, (2) post every
point-to-point send and receive in one ``batch_isend_irecv``, (3) post this rank's
broadcasts in the global order, (4) copy locally, (5) wait for all, unpack.  Steps 2-4
never block; a rank blocks in step 1 only on a group's members, who create the groups in
the same global order, so the first group anyone waits on is reached by all its members.

Broadcast groups: ``dist.new_group(ranks, use_local_synchronization=True)`` is not usable
here: in torch 2.13 it names the group by a hash of the ranks *and of how many groups the
calling rank has*, so two members that took part in different groups before derive
different names and hang (checked with gloo); plain ``new_group`` needs every rank of the
world, while only the layouts' ranks reallocate.  So the members build the backend group
themselves (gloo for host tensors, NCCL for CUDA ones) on the default store under a name
made of the ranks, once per world: :class:`_Groups` caches them by backend and ranks, and
drops them when the default process group changes.  Re-creating a world on the *same*
store object is unsupported (stale keys under the same names).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

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
class _Broadcast:
    """One message that ``root`` sends to every other rank of ``ranks`` (sorted, root
    included) at once: its elements in this rank's buffer (the source buffer at the root,
    the destination buffer at a receiver)."""

    root: int
    ranks: Tuple[int, ...]
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
    bcast: List[Optional[torch.Tensor]]  # packed at the root, the inbox at a receiver
    local: Optional[torch.Tensor]


#: how long a broadcast group waits for its members unless ``RankPlan.run`` says otherwise
_GROUP_TIMEOUT = dist.distributed_c10d.default_pg_timeout


class _Groups:
    """The broadcast groups of this process, per (backend, ranks), for the current world."""

    def __init__(self):
        self._world = None
        self._groups: Dict[Tuple[str, Tuple[int, ...]], object] = {}

    def get(self, ranks: Tuple[int, ...], device: torch.device, timeout: timedelta):
        world = dist.group.WORLD
        if world is not self._world:  # a new world: the old groups died with theirs
            self._groups.clear()
            self._world = world
        backend = "nccl" if device.type == "cuda" else "gloo"
        key = (backend, ranks)
        if key not in self._groups:
            name = f"realhf_realloc/{backend}/{'_'.join(map(str, ranks))}/"
            store = dist.PrefixStore(name, _get_default_store())
            me, n = ranks.index(dist.get_rank()), len(ranks)
            if backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._groups[key] = dist.ProcessGroupNCCL(store, me, n, opts)
            else:
                self._groups[key] = dist.ProcessGroupGloo(store, me, n, timeout)
        return self._groups[key]


_groups = _Groups()


@dataclasses.dataclass(eq=False)
class RankPlan:
    """One rank's part of a reallocation plan, compiled by :func:`compile_plan`.

    Per peer it sends to, the intervals of the source buffer making up the message; per
    peer it receives from, the intervals of the destination buffer the message fills; the
    broadcasts it takes part in (in the order every rank follows); its local copies as one
    move between source and destination intervals.  A message that is one piece of the
    buffer goes out of (or lands in) a view of it; otherwise it is packed (unpacked) by the
    compiled interval kernels through staging buffers that the plan keeps between runs, per
    dtype and device.  Callers cache a RankPlan per pair of layouts.
    """

    rank: int
    sends: Tuple[_Message, ...]
    recvs: Tuple[_Message, ...]
    local: Optional[_Local]
    broadcasts: Tuple[_Broadcast, ...] = ()
    _buffers: Dict[Tuple[torch.dtype, torch.device], _Buffers] = dataclasses.field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def counts(self) -> Dict[str, int]:
        """The elements this rank sends, receives and copies locally per run.

        A broadcast counts once for its root, however many receivers it has (the elements
        the root hands to the transport), and once for each receiver; so over all ranks
        ``received`` may exceed ``sent``."""
        return {
            "sent": sum(m.side.length for m in self.sends)
            + sum(b.side.length for b in self.broadcasts if b.root == self.rank),
            "received": sum(m.side.length for m in self.recvs)
            + sum(b.side.length for b in self.broadcasts if b.root != self.rank),
            "local": 0 if self.local is None else self.local.dst.length,
        }

    def run(
        self,
        src_flat: Optional[torch.Tensor],
        dst_flat: Optional[torch.Tensor],
        group=None,
        timeout: Optional[float] = None,
    ) -> Dict[str, int]:
        """Carry out this rank's part in the order of the module docstring: create missing
        broadcast groups (first run only), post every send and receive in one
        ``batch_isend_irecv`` and this rank's broadcasts, copy locally while the messages
        are in flight, wait, unpack.

        ``src_flat`` is this rank's source flat buffer (None if it sends and copies
        nothing), ``dst_flat`` its destination one (None if it receives and copies
        nothing); they must not overlap.  Every rank in the plan calls this at the same
        time.  ``group`` carries the point-to-point messages (default: the world);
        broadcasts run on groups of their own, whose waits give up after ``timeout``
        seconds (default: torch's default process-group timeout) — pass the world's.
        Returns :attr:`counts`.
        """
        self._check(src_flat, dst_flat)
        like = src_flat if src_flat is not None else dst_flat
        if like is None:
            return self.counts
        bufs = self._staging(like.dtype, like.device)
        wait = _GROUP_TIMEOUT if timeout is None else timedelta(seconds=timeout)
        groups = [_groups.get(b.ranks, like.device, wait) for b in self.broadcasts]
        works = self._post_p2p(src_flat, dst_flat, bufs, group)
        try:
            works += self._post_broadcasts(src_flat, dst_flat, bufs, groups)
            if self.local is not None:
                self._copy_local(src_flat, dst_flat, bufs.local)
        finally:
            # Exactly once each: with gloo a second wait on a finished send hangs.
            for work in works:
                work.wait()
        for m, inbox in zip(self.recvs, bufs.recv):
            if inbox is not None:
                set_intervals(inbox, dst_flat, m.side.intervals)
        for b, inbox in zip(self.broadcasts, bufs.bcast):
            if b.root != self.rank and inbox is not None:
                set_intervals(inbox, dst_flat, b.side.intervals)
        return self.counts

    def _post_p2p(self, src_flat, dst_flat, bufs: _Buffers, group) -> list:
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
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def _post_broadcasts(self, src_flat, dst_flat, bufs: _Buffers, groups: list) -> list:
        works = []
        for b, staging, g in zip(self.broadcasts, bufs.bcast, groups):
            if b.root != self.rank:
                tensor = b.side.view(dst_flat) if staging is None else staging
            elif staging is None:
                tensor = b.side.view(src_flat)
            else:
                tensor = slice_intervals(src_flat, b.side.intervals, out=staging)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = b.ranks.index(b.root), 0
            works.append(g.broadcast([tensor], opts))
        return works

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
                bcast=[buf(b.side) for b in self.broadcasts],
                local=(
                    torch.empty(local.src.length, dtype=dtype, device=device)
                    if local is not None and local.src.whole is None and local.dst.whole is None
                    else None
                ),
            )
        return self._buffers[key]

    def _check(self, src_flat, dst_flat) -> None:
        what = f"RankPlan.run (rank {self.rank})"
        mine = [b.side.end for b in self.broadcasts if b.root == self.rank]
        theirs = [b.side.end for b in self.broadcasts if b.root != self.rank]
        need_src = max(
            [m.side.end for m in self.sends] + mine + [self.local.src.end if self.local else 0]
        )
        need_dst = max(
            [m.side.end for m in self.recvs] + theirs + [self.local.dst.end if self.local else 0]
        )
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


def compile_plan(plan: Sequence[Copy], rank: int, broadcast: bool = True) -> RankPlan:
    """World ``rank``'s part of ``plan`` as a :class:`RankPlan` (intervals precomputed).

    ``plan`` must be the whole plan, the same on every rank: which messages form a broadcast
    depends on the other ranks' messages.  ``broadcast=False`` keeps every message
    point-to-point (the behaviour before broadcasts, for comparison)."""
    messages: Dict[Tuple[int, int], List[Copy]] = {}
    local: List[Copy] = []
    for c in plan:
        if c.length == 0:
            continue
        if c.src != c.dst:
            messages.setdefault((c.src, c.dst), []).append(c)
        elif c.src == rank:
            local.append(c)
    # Only the messages of senders this rank exchanges with can join it to a broadcast.
    senders = {rank} | {s for s, d in messages if d == rank}
    sides = {k: _sides(messages[k]) for k in sorted(messages) if k[0] in senders}
    bcasts = _broadcasts(sides) if broadcast else []
    in_bcast = {(s, d) for s, receivers in bcasts for d in receivers}
    p2p = [k for k in sides if k not in in_bcast]

    def joined(s: int, receivers: Tuple[int, ...]) -> _Broadcast:
        side = sides[s, receivers[0]][0] if s == rank else sides[s, rank][1]
        return _Broadcast(s, tuple(sorted((s, *receivers))), side)

    return RankPlan(
        rank,
        sends=tuple(_Message(d, sides[s, d][0]) for s, d in p2p if s == rank),
        recvs=tuple(_Message(s, sides[s, d][1]) for s, d in p2p if d == rank),
        local=_Local(*_sides(local)) if local else None,
        broadcasts=tuple(joined(s, ds) for s, ds in bcasts if rank == s or rank in ds),
    )


def _broadcasts(
    sides: Dict[Tuple[int, int], Tuple[_Side, _Side]],
) -> List[Tuple[int, Tuple[int, ...]]]:
    """(sender, receivers) of each group of two or more messages from one sender with the
    same source intervals in message order, sorted: the order every rank follows.  A
    sender sends one message per receiver, so (sender, receivers) names one group."""
    payloads: Dict[Tuple[int, bytes], List[int]] = {}
    for s, d in sorted(sides):
        payloads.setdefault((s, sides[s, d][0].intervals.numpy().tobytes()), []).append(d)
    return sorted((s, tuple(ds)) for (s, _), ds in payloads.items() if len(ds) >= 2)


def reallocate(
    plan: Sequence[Copy],
    rank: int,
    src_flat: Optional[torch.Tensor],
    dst_flat: Optional[torch.Tensor],
    group=None,
    broadcast: bool = True,
) -> Dict[str, int]:
    """Carry out the copies of ``plan`` that involve world ``rank``: ``compile_plan`` then
    :meth:`RankPlan.run` (see there).  Callers that reallocate the same pair of layouts
    again should keep the compiled plan instead.  Returns the elements sent, received and
    copied locally."""
    return compile_plan(plan, rank, broadcast).run(src_flat, dst_flat, group)
