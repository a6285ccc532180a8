"""One step of the dataflow graph, run by the master over the model workers (metadata only).

:class:`DagRunner` owns the master's side of the data: the :class:`SampleBuffer`, the
request client and the shards' positions.  A step is::

    load   fetch the step's items from the replicas' shards (allocate_fetch; only the
           head, pipe 0 / tensor 0, of each data-parallel replica holds a shard)
    run    one coroutine per MFC: wait until n_seqs of the step's items have its input
           keys (oldest first), split them over the d data-parallel replicas of the MFC's
           layout, send every rank its replica's part with the transfer plan (which brings
           the part's data to every rank of the replica), await the replies, record the
           outputs as held by every rank of the replica (they compute the same) and the
           stats averaged over the replicas
    clear  every MFC consumed the step's items: clear_data_cache on every worker

Dynamic sampling (an MFC with ``drops_items``, e.g. a reward call that drops prompt groups
whose answers all agree): the step first runs the *fill phase* (the dropper and its
predecessors) in rounds — fetch, run, keep what the dropper kept — until ``batch_size``
items are kept, ``max_fill_rounds`` rounds ran, or the epoch's data ran out; each later
round fetches the missing count divided by the step's keep rate so far (at most a batch).
The step then trains on the first ``batch_size`` kept items (oldest first; kept items
beyond them are the ``surplus``) and runs the other MFCs over them only.  Every fetched
item is cleared at the end of the step.

Ordering rule (deadlock freedom): requests of one MFC go to all ranks in one
synchronous burst (``_dispatch`` never awaits, and runs under the dispatch lock to say
so), so every worker receives MFC requests in the same order.  Workers serve requests
in order, hence run their data transfers and collectives in the same global order.

Per-MFC layouts (``placements``; parameter reallocation): an MFC runs on the first
``d·p·m`` workers of its layout; every worker still gets its request (those outside run
only the transfer plan, as they may hold inputs).  An MFC on a *replica* of its model (a
layout other than the model's home) is preceded, in the same burst, by a ``reallocate``
request to the ranks of both layouts whenever the replica is behind: the master counts
``train_step`` calls dispatched per role, and workers serve in order, so a replica
reallocated after the n-th train call holds exactly the n-th weights.  Each reallocation
is traced per rank with its bytes.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.dfg import DataFlowGraph, MFCDef, ModelInterfaceType
from realhf.api.core.model_api import StepInfo
from realhf.api.core.worker_api import Placements, call_sizes
from realhf.base.distributed.topology import DataPipeTensorParallelTopology
from realhf.system.dag.buffer import SampleBuffer
from realhf.system.dag.dp_split import partition_for_dp
from realhf.system.dag.messages import (
    FetchRequest,
    Handle,
    MFCReply,
    MFCRequest,
    ReallocReply,
    ReallocRequest,
    mfc_handle,
)
from realhf.system.dag.transfer import build_transfer_plan
from realhf.system.transport.errors import RemoteError
from realhf.system.transport.request_reply import RequestClient

__all__ = ["DagRunner", "StepResult", "allocate_fetch"]


class _Ranks:
    """The model workers of one layout (the first ``d·p·m``) and its replicas.

    Attributes:
        layout: the layout.
        ranks: its world ranks ``0..d·p·m-1``.
        replicas: world ranks of each data-parallel replica; its head (pipe 0, tensor 0)
            first.
        heads: each replica's head.
        replica_of: the replica of each rank.
    """

    def __init__(self, layout: ParallelismConfig):
        topo = DataPipeTensorParallelTopology(layout.data, layout.pipe, layout.tensor)
        self.layout = layout
        self.ranks = list(range(layout.world_size))
        self.replicas: List[List[int]] = [topo.filter_match(data=k) for k in range(layout.data)]
        self.heads: List[int] = [r[0] for r in self.replicas]
        self.replica_of: List[int] = [topo.get_coord(r).data for r in self.ranks]


def allocate_fetch(need: int, remaining: List[int]) -> List[int]:
    """How many items to fetch from each shard: as even as the shards' leftovers allow.

    Deterministic in ``(need, remaining)``, which a recover checkpoint restores, so a
    resumed run fetches exactly what the uninterrupted one would have.
    """
    if need > sum(remaining) or need < 0:
        raise ValueError(f"cannot fetch {need} items from shards with {remaining} left")
    alloc = [0] * len(remaining)
    left = need
    while left:
        open_ = [i for i, r in enumerate(remaining) if r > alloc[i]]
        share = max(1, left // len(open_))
        for i in open_:
            give = min(share, remaining[i] - alloc[i], left)
            alloc[i] += give
            left -= give
            if not left:
                break
    return alloc


class StepResult:
    """What one step did: its items, their tokens, and stats averaged per key."""

    def __init__(self, ids: List[str], tokens: int, stats: Dict[str, float]):
        self.ids, self.tokens, self.stats = ids, tokens, stats


class DagRunner:
    """Runs steps of ``graph`` over the model workers ``handlers`` (see the module docstring).

    Args:
        graph: the MFCs.
        client: the request client (its handlers are the model workers, rank = index).
        timeout: seconds to wait for any reply.
        trace: a :class:`~realhf.system.dag.outputs.TraceLog` (or None).
        layout: the trainer layout of the model workers (None: each one is a data-parallel
            replica); ranks are laid out like the workers' grid, row-major over (data,
            pipe, tensor).
        max_fill_rounds: with an MFC that drops items, the most fetch-and-filter rounds of
            one step (see the module docstring).
    """

    def __init__(
        self,
        graph: DataFlowGraph,
        client: RequestClient,
        timeout: float,
        trace=None,
        layout: Optional[ParallelismConfig] = None,
        placements: Optional[Placements] = None,
        max_fill_rounds: int = 1,
    ):
        if max_fill_rounds < 1:
            raise ValueError(f"max_fill_rounds must be >= 1, got {max_fill_rounds}")
        self.graph = graph
        self.max_fill_rounds = max_fill_rounds
        self.client = client
        self.handlers = list(client.handlers)
        self.n = len(self.handlers)
        self.layout = layout or ParallelismConfig(data=self.n)
        if self.layout.world_size != self.n:
            raise ValueError(
                f"layout {self.layout} spans {self.layout.world_size} model workers, "
                f"the master talks to {self.n}"
            )
        self.placements = placements or Placements()
        #: the ranks whose replica heads hold the data shards
        self.data = _Ranks(self.placements.data_layout(self.layout))
        #: where each MFC runs
        self.ranks_of: Dict[str, _Ranks] = {
            name: _Ranks(self.placements.of_mfc(name, self.layout)) for name in graph.mfcs
        }
        #: train_step calls dispatched per role (the version its home weights will have
        #: once the workers ran everything dispatched so far) and the version each replica
        #: (role, layout) holds; a replica behind its role is reallocated before its MFC
        self.role_version: Dict[str, int] = {m.role: 0 for m in graph.mfcs.values()}
        self.replica_version: Dict[Tuple[str, str], int] = {}
        self.timeout = timeout
        self.trace = trace
        self.buffer = SampleBuffer()
        # `cond` guards the buffer and `_done`, and wakes MFCs waiting for their inputs
        # whenever a call's outputs land or an MFC finishes.
        self.cond = asyncio.Condition()
        self.dispatch_lock = asyncio.Lock()
        #: per replica (its head's shard): items of the current epoch not fetched yet (set
        #: by the master)
        self.remaining: List[int] = []
        self._stats: Dict[str, List[float]] = {}
        self._done: Dict[str, bool] = {}
        #: items the dropper dropped in the current round
        self._dropped: set = set()

    @property
    def heads(self) -> List[int]:
        """The ranks holding the data shards (see ``Placements.data_layout``)."""
        return self.data.heads

    async def call(
        self,
        handle: Handle,
        datas: List[Any],
        ranks: Optional[Sequence[int]] = None,
        wait_all: bool = False,
    ) -> List[Any]:
        """Send ``handle`` to the workers of ``ranks`` (default: all; one datum each);
        return their replies' data.

        A worker's error is raised as soon as its reply arrives; with ``wait_all`` only
        after every worker has replied (a caller that cleans up after a failure must know
        that no worker is still acting on the request).
        """
        handlers = self.handlers if ranks is None else [self.handlers[r] for r in ranks]
        rids = self.client.request(handlers, handle, datas)
        replies = await self.client.gather_async(
            rids, timeout=self.timeout, raise_remote=not wait_all
        )
        failed = [r for r in replies if r.error is not None]
        if failed:
            raise RemoteError(failed[0].error)
        return [r.data for r in replies]

    def _trace(self, name: str, process: str, start: float, end: float, **kw) -> None:
        if self.trace is not None:
            self.trace.complete(name, process, start, end, **kw)

    # ---- a step -------------------------------------------------------------

    async def run_step(self, step: StepInfo, batch_size: int) -> StepResult:
        """Load, run every MFC over, and clear one step of up to ``batch_size`` items."""
        self._stats = {}
        order = self.graph.topological_order()
        if self.graph.dropper is None:
            ids = fetched = await self._load(step.epoch, min(batch_size, sum(self.remaining)))
        else:
            ids, fetched = await self._fill(step, batch_size)
            order = [n for n in order if n not in self.graph.fill_phase]
        await self._run_mfcs(order, ids, step)
        # Tokens of the step (every fetched item: dropped ones were generated too): per
        # item, its longest key.
        tokens = sum(
            max((k.n_tokens for k in self.buffer.entry(i).keys.values()), default=0)
            for i in fetched
        )
        await self.call(Handle.CLEAR_DATA_CACHE, [tuple(fetched)] * self.n)
        self.buffer.remove(fetched)
        return StepResult(ids, tokens, {k: sum(v) / len(v) for k, v in sorted(self._stats.items())})

    async def _run_mfcs(self, names: List[str], ids: List[str], step: StepInfo) -> None:
        """Run the MFCs ``names`` over ``ids`` (the others count as done)."""
        self._done = {name: name not in names for name in self.graph.mfcs}
        # One task per MFC: each dispatches a call as soon as its inputs are ready, so with
        # n_seqs below the batch size a consumer starts on the first outputs of its producer.
        try:
            async with asyncio.TaskGroup() as tg:
                for name in names:
                    tg.create_task(self._run_mfc(self.graph.mfcs[name], ids, step))
        except ExceptionGroup as eg:  # the first failure names the MFC and the worker
            raise eg.exceptions[0] from None

    async def _fill(self, step: StepInfo, batch_size: int) -> Tuple[List[str], List[str]]:
        """Run the fill phase in rounds until ``batch_size`` items are kept (module
        docstring); return (the kept items the step trains on, every fetched item)."""
        phase = self.graph.fill_phase
        kept: List[str] = []
        fetched: List[str] = []
        rounds = skipped = 0
        need = batch_size
        while True:
            left = sum(self.remaining)
            # Every data-parallel replica of a call needs an item: the size nearest to
            # `need` that all the fill phase's calls can split, within the epoch's rest.
            start = min(need, left)
            sizes = [*range(start, left + 1), *range(start - 1, 0, -1)]
            n = next((k for k in sizes if self._splittable(phase, k)), 0)
            if n == 0:
                if left:  # a rest no call can split: skipped, so that the epoch ends
                    fetched += await self._load(step.epoch, left)
                    skipped = left
                break
            ids = await self._load(step.epoch, n)
            rounds += 1
            self._dropped = set()
            await self._run_mfcs(phase, ids, step)
            fetched += ids
            kept += [i for i in ids if i not in self._dropped]
            missing = batch_size - len(kept)
            if missing <= 0 or rounds >= self.max_fill_rounds:
                break
            rate = len(kept) / (len(fetched) - skipped)
            need = batch_size if rate == 0 else min(batch_size, math.ceil(missing / rate))
        train = min(len(kept), batch_size)
        later = [n for n in self.graph.mfcs if n not in phase]
        while train > 0 and not self._splittable(later, train):
            train -= 1  # too few kept items to give every replica of a later call one
        for key, v in (
            ("rounds", rounds),
            ("fetched", len(fetched)),
            ("dropped", len(fetched) - skipped - len(kept)),
            ("kept", train),
            ("surplus", len(kept) - train),
            ("skipped", skipped),
            ("keep_rate", len(kept) / max(1, len(fetched) - skipped)),
        ):
            self._stats[f"dynamic_sampling/{key}"] = [float(v)]
        return kept[:train], fetched

    def _splittable(self, names: List[str], n_items: int) -> bool:
        """Whether every call of the MFCs ``names`` over ``n_items`` items gives each
        data-parallel replica of the MFC's layout at least one item."""
        return all(
            size >= self.ranks_of[name].layout.data
            for name in names
            for size in call_sizes(n_items, self.graph.mfcs[name].n_seqs)
        )

    async def _load(self, epoch: int, need: int) -> List[str]:
        """Fetch ``need`` items from the replica heads (metadata into the buffer; tensors
        stay on the workers)."""
        want = allocate_fetch(need, self.remaining)
        ids: List[str] = []
        t = time.time()
        # A worker answers at most dataset_batch_size items per fetch: ask until all came.
        while True:
            asked = list(want)
            replies = await self.call(
                Handle.FETCH, [FetchRequest(epoch, w) for w in asked], ranks=self.heads
            )
            for k, rep in enumerate(replies):
                head = self.heads[k]
                got = 0 if rep.meta is None else len(rep.meta)
                if got:
                    self.buffer.add(rep.meta, owner=head)
                    ids.extend(rep.meta.ids)
                self.remaining[k] = rep.position.remaining
                for key, v in rep.stats.items():
                    self._stats.setdefault(key, []).append(v)
                # Nothing back would make this loop forever; more than asked means master
                # and worker disagree on the shard.
                if got == 0 and asked[k] > 0 or got > asked[k]:
                    raise RuntimeError(
                        f"{self.handlers[head]} returned {got} items for a fetch of {asked[k]} "
                        f"(epoch {epoch}, position {rep.position}); master and worker disagree"
                    )
                want[k] -= got
            if not any(want):
                break
        self._trace("fetch", "master_worker/0", t, time.time(), n_items=len(ids))
        return ids

    async def _run_mfc(self, mfc: MFCDef, step_ids: List[str], step: StepInfo) -> None:
        """Run ``mfc`` over all of the step's items, ``n_seqs`` at a time, oldest first."""
        parents = self.graph.parents(mfc.name)
        for call, size in enumerate(call_sizes(len(step_ids), mfc.n_seqs)):
            async with self.cond:
                while True:
                    ready = self.buffer.ready(mfc.name, mfc.input_keys, among=step_ids)
                    if len(ready) >= size:
                        break
                    # No producer left to add inputs: fail instead of waiting forever.
                    if all(self._done[p] for p in parents):
                        raise RuntimeError(
                            f"MFC {mfc.name!r} needs {size} items with keys "
                            f"{list(mfc.input_keys)} but only {len(ready)} have them after "
                            f"its producers {parents} finished"
                        )
                    await self.cond.wait()
                ids = ready[:size]
                # Marked under the condition, so the MFC's next call cannot take them again.
                self.buffer.mark_consumed(ids, mfc.name)
            async with self.dispatch_lock:
                realloc_rids, rids, parts = self._dispatch(mfc, ids, step, call)
            t = time.time()
            # Awaited outside the condition: other MFCs dispatch while this call runs.
            if realloc_rids:
                realloc = await self.client.gather_async(realloc_rids, timeout=self.timeout)
                self._absorb_realloc(mfc, [r.data for r in realloc])
            replies = await self.client.gather_async(rids, timeout=self.timeout)
            async with self.cond:
                self._absorb(mfc, parts, [r.data for r in replies], t)
                self.cond.notify_all()
        async with self.cond:
            self._done[mfc.name] = True
            self.cond.notify_all()

    def _dispatch(
        self, mfc: MFCDef, ids: List[str], step: StepInfo, call: int
    ) -> Tuple[List[str], List[str], list]:
        """Split over the MFC's replicas, plan and send one MFC call to every worker (no
        await: one burst), preceded by a reallocation when the MFC runs on a replica of its
        model that is behind the trained weights.  Returns the reallocation's and the call's
        request ids and the replicas' parts."""
        where = self.ranks_of[mfc.name]
        realloc = self._realloc_requests(mfc, where.layout)
        if mfc.is_train:  # everything dispatched after this call sees the new weights
            self.role_version[mfc.role] += 1
        keys = list(mfc.input_keys)
        by_count = mfc.interface_type == ModelInterfaceType.GENERATE
        d = where.layout.data
        parts = partition_for_dp(ids, self.buffer.item_tokens(ids, keys), d, by_count)
        first = self.buffer.entry(ids[0]).keys
        plan = build_transfer_plan(
            # Every rank of a replica needs the replica's whole part; the MFC's ranks are
            # world ranks 0..d·p·m-1.
            [parts[k] for k in where.replica_of],
            keys,
            self.buffer.holder_map(ids, keys),
            seqlens=lambda i, k: self.buffer.entry(i).keys[k].seqlens,
            dtypes={k: first[k].dtype for k in keys},
            trailing_shapes={k: first[k].trailing_shape for k in keys},
        )
        for s in plan:
            self.buffer.add_holder(s.ids, s.key, s.dst)
        tplan = tuple(plan)
        metas = [MFCRequest(mfc.name, step, tplan, self.buffer.meta(p, keys), call) for p in parts]
        # Every worker gets the request: one outside the MFC's layout runs the transfer plan
        # only (it may hold inputs), and all workers see every request in one order.
        datas = [
            metas[where.replica_of[r]] if r < len(where.ranks) else metas[0] for r in range(self.n)
        ]
        handle = mfc_handle(mfc.interface_type)
        return realloc, self.client.request(self.handlers, handle, datas), parts

    def _realloc_requests(self, mfc: MFCDef, layout: ParallelismConfig) -> List[str]:
        """Send the reallocation that brings ``mfc``'s replica up to date, if it is behind
        (part of the dispatch burst); its request ids."""
        if not self.placements.on_replica(mfc, self.layout):
            return []
        key, version = (mfc.role, str(layout)), self.role_version[mfc.role]
        if self.replica_version.get(key) == version:
            return []
        if self.placements.keep_replicas:
            self.replica_version[key] = version  # else the worker frees it after the call
        home = self.placements.home(mfc.role, self.layout)
        ranks = range(max(home.world_size, layout.world_size))
        req = ReallocRequest(mfc.role, home, layout, version)
        return self.client.request(
            [self.handlers[r] for r in ranks], Handle.REALLOCATE, [req] * len(ranks)
        )

    def _absorb_realloc(self, mfc: MFCDef, replies: List[ReallocReply]) -> None:
        """Trace a reallocation (one event per rank) and record its bytes and seconds."""
        home = self.placements.home(mfc.role, self.layout)
        name = f"realloc {mfc.role} {home}->{self.ranks_of[mfc.name].layout}"
        for rep in replies:
            self._trace(
                name,
                rep.worker,
                rep.start,
                rep.end,
                tid=mfc.role,
                bytes_sent=rep.bytes_sent,
                bytes_received=rep.bytes_received,
                bytes_local=rep.bytes_local,
            )
        # From the workers' own clocks: the dispatch burst may still be sending when the
        # reallocation (sent first) is done.
        self._stats.setdefault(f"realloc/{mfc.name}_seconds", []).append(
            max(r.end for r in replies) - min(r.start for r in replies)
        )
        self._stats.setdefault(f"realloc/{mfc.name}_bytes", []).append(
            sum(r.bytes_received + r.bytes_local for r in replies)
        )

    def _absorb(
        self, mfc: MFCDef, parts: List[List[str]], replies: List[MFCReply], sent: float
    ) -> None:
        """Record one call's replies (one per worker; ``parts`` per replica of the MFC's
        layout, whose ranks come first): output holders
        (every rank of the replica, its head the owner), stats (averaged over the replicas:
        a replica's ranks report the same), trace."""
        stats: Dict[str, List[float]] = {}
        where = self.ranks_of[mfc.name]
        replies = replies[: len(where.ranks)]  # the others only ran the transfer plan
        for rank, rep in enumerate(replies):
            k = where.replica_of[rank]
            part, head = parts[k], where.heads[k]
            if rep.output is None and mfc.drops_items:
                if rank == head:
                    self._dropped.update(part)
            elif rep.output is not None:
                out = rep.output
                if mfc.drops_items and rank == head:
                    self._dropped.update(set(part) - set(out.ids))
                same = (
                    set(out.ids) <= set(part)
                    if mfc.drops_items
                    else sorted(out.ids) == sorted(part)
                )
                if not same or not set(mfc.output_keys) <= out.keys:
                    raise RuntimeError(
                        f"MFC {mfc.name!r}: {rep.worker} replied items {sorted(out.ids)[:3]}... "
                        f"with keys {sorted(out.keys)} for its {len(part)} items; expected "
                        f"keys {list(mfc.output_keys)}"
                    )
                if rank == head:  # heads come first in their replica (lowest rank)
                    self.buffer.amend(out, owner=rank)
                else:
                    for key in out.keys:
                        self.buffer.add_holder(out.ids, key, rank)
            elif mfc.output_keys:
                raise RuntimeError(f"MFC {mfc.name!r}: {rep.worker} replied no output")
            if rank == head:
                for key, v in rep.stats.items():
                    stats.setdefault(key, []).append(v)
            self._trace(
                mfc.name,
                self.handlers[rank],
                rep.start,
                rep.end,
                tid=mfc.role,
                n_items=len(part),
                transfer_s=round(rep.transfer_seconds, 6),
                bytes_received=rep.bytes_received,
            )
        for k, v in stats.items():
            self._stats.setdefault(f"{mfc.name}/{k}", []).append(sum(v) / len(v))
        # Workers' wall clocks against the master's: good to the clock skew between hosts.
        self._stats.setdefault(f"timing/{mfc.name}", []).append(max(r.end for r in replies) - sent)
        self._stats.setdefault(f"data_transfer/{mfc.name}_bytes", []).append(
            sum(r.bytes_received for r in replies)
        )
