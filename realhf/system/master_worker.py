"""The master worker: runs the dataflow graph of MFCs over the model workers, step by step.

Worker type ``master_worker`` (an asyncio worker); config
:class:`~realhf.api.core.worker_api.MasterWorkerConfig`.  The master sees metadata only;
tensors stay on the model workers and move between them.

Start (first poll): wait for every model worker on the request stream, ``spec`` (dataset
shard sizes -> the real :class:`FinetuneSpec`), pick a recover checkpoint (``recover_mode``),
``initialize`` the workers (engines, recovered weights/optimizers/data positions).

One step::

    load   fetch the step's train_batch_size items (fewer at the end of an epoch)
    run    one coroutine per MFC: wait until n_seqs of the step's items have its input
           keys, split them over the data-parallel ranks, send every rank the request
           with the transfer plan (under the dispatch lock: all ranks of one MFC before
           any other MFC), await the replies, record outputs / stats
    clear  every MFC consumed the step's items: clear_data_cache on the workers
    after  metrics line, tensorboard, progress; then eval / save / recover checkpoint
           when their frequency fires

It stops after ``total_train_epochs`` epochs or ``benchmark_steps`` steps, sends the
model workers ``exit``, writes ``curves.png`` and reports COMPLETED (the controller then
sets ``names.experiment_status`` to COMPLETE).  After every step it publishes the count of
consumed samples under ``names.training_samples``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Dict, List, Optional

from realhf.api.core.dfg import MFCDef, ModelInterfaceType, build_graph
from realhf.api.core.model_api import FinetuneSpec, StepInfo
from realhf.api.core.worker_api import MasterWorkerConfig, call_sizes
from realhf.base import constants, name_resolve, names
from realhf.base.timeutil import FrequencyControl
from realhf.system import recover
from realhf.system.buffer import SampleBuffer
from realhf.system.dag_messages import (
    REQUEST_STREAM,
    CheckpointRequest,
    DataPosition,
    EvalRequest,
    FetchRequest,
    InitializeRequest,
    MFCReply,
    MFCRequest,
    SaveRequest,
)
from realhf.system.data_transfer import build_transfer_plan, partition_for_dp
from realhf.system.master_outputs import (
    MetricsLog,
    ProgressDisplay,
    TensorBoardLog,
    TraceLog,
    plot_curves,
)
from realhf.system.request_reply_stream import RequestClient
from realhf.system.worker_base import AsyncWorker, PollResult, register_worker

__all__ = ["MasterWorker", "allocate_fetch", "STATE_FORMAT"]

STATE_FORMAT = 1


def allocate_fetch(need: int, remaining: List[int]) -> List[int]:
    """How many items to fetch from each worker: as even as the shards' leftovers allow.

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


def _freq(ctl, what: str) -> FrequencyControl:
    return FrequencyControl(
        getattr(ctl, f"{what}_freq_epochs"),
        getattr(ctl, f"{what}_freq_steps"),
        getattr(ctl, f"{what}_freq_secs"),
    )


@register_worker("master_worker")
class MasterWorker(AsyncWorker):
    """See the module docstring."""

    config_class = MasterWorkerConfig

    def _configure(self, config: MasterWorkerConfig) -> None:
        self.graph = build_graph(config.mfcs)
        self.mfcs: Dict[str, MFCDef] = {m.name: m for m in config.mfcs}
        self.n = config.n_model_workers
        self.handlers = [f"model_worker/{i}" for i in range(self.n)]
        # Bind and publish now; model workers connect on their first poll.
        self.client = RequestClient(
            self.experiment_name,
            self.trial_name,
            REQUEST_STREAM,
            self.handlers,
            reply_timeout=config.timeout,
            wait=False,
        )
        self.buffer = SampleBuffer()
        self.cond = asyncio.Condition()
        self.dispatch_lock = asyncio.Lock()
        self.save_ctl = _freq(config.exp_ctrl, "save")
        self.ckpt_ctl = _freq(config.exp_ctrl, "ckpt")
        self.eval_ctl = _freq(config.exp_ctrl, "eval")
        self.step = StepInfo()  # progress before the next step
        self.counters = {"samples": 0, "tokens": 0, "seconds": 0.0}
        self.started = False
        self.metrics = self.tb = self.trace = self.progress = None

    # ---- start --------------------------------------------------------------

    async def _call(self, handle: str, datas: List[Any]) -> List[Any]:
        rids = self.client.request(self.handlers, handle, datas)
        return [r.data for r in await self.client.gather_async(rids, timeout=self.config.timeout)]

    async def _start(self) -> None:
        cfg = self.config
        self.client.wait_for_handlers(cfg.timeout)
        specs = await self._call("spec", [None] * self.n)
        self.shard_sizes = [s.dataset_size for s in specs]
        size = sum(self.shard_sizes)
        if size == 0:
            raise RuntimeError(
                "the model workers loaded no training data (ModelWorkerConfig.dataset)"
            )
        cfg.check_call_sizes(size)
        self.ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
        if size != cfg.ft_spec.dataset_size:
            self.logger.warning(
                f"the datasets hold {size} items, ft_spec planned {cfg.ft_spec.dataset_size}; using {size}"
            )
        self.total_steps = self.ft_spec.total_train_steps
        if cfg.exp_ctrl.benchmark_steps is not None:
            self.total_steps = min(self.total_steps, cfg.exp_ctrl.benchmark_steps)
        if cfg.eval and not all(s.can_evaluate for s in specs):
            raise RuntimeError(
                "MasterWorkerConfig.eval is set but the model workers have no evaluation configured"
            )
        ckpt = self._find_checkpoint()
        if ckpt is not None:
            self._load_state(recover.read_master_state(ckpt), ckpt)
        positions = await self._call("initialize", [InitializeRequest(self.ft_spec, ckpt)] * self.n)
        self.remaining = [self._remaining(i, p) for i, p in enumerate(positions)]
        resume = None if ckpt is None else self.step.global_step
        self.metrics = MetricsLog(constants.metrics_path(), resume_step=resume)
        self.tb = TensorBoardLog(constants.tensorboard_dir(), resume_step=resume)
        self.trace = TraceLog(
            constants.trace_path(), ["master_worker/0"] + self.handlers, resume=ckpt is not None
        )
        self.progress = ProgressDisplay(
            self.total_steps,
            self.step.global_step,
            cfg.log_stats_keys,
            interval=cfg.progress_interval,
        )
        self.logger.info(
            f"{size} items over {self.n} model workers, {self.ft_spec.steps_per_epoch} steps/epoch, "
            f"running steps {self.step.global_step + 1}..{self.total_steps}"
            + (f" (resumed from {ckpt})" if ckpt else "")
            + f"\n{self.graph.to_text()}"
        )

    def _remaining(self, rank: int, p: DataPosition) -> int:
        if p.epoch == self.step.epoch:
            return p.remaining
        # Checkpointed right after an epoch's last step: the loader moves on at the next fetch.
        if p.epoch == self.step.epoch - 1 and p.remaining == 0:
            return p.shard_size
        raise recover.RecoverError(
            f"model_worker/{rank} is in epoch {p.epoch} ({p.n_used}/{p.shard_size} used) but the "
            f"master resumes in epoch {self.step.epoch}; the checkpoint is inconsistent"
        )

    def _find_checkpoint(self) -> Optional[str]:
        mode = self.config.recover_mode
        if mode == "disabled":
            return None
        root = recover.recover_root(self.config.recover_dir)
        path = recover.find_latest(root) if os.path.isdir(root) else None
        if path is None and mode == "resume":
            raise recover.RecoverError(
                f"recover_mode=resume but {root} holds no complete recover checkpoint"
            )
        return path

    def _state_dict(self) -> Dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "step": {
                "epoch": self.step.epoch,
                "epoch_step": self.step.epoch_step,
                "global_step": self.step.global_step,
            },
            "seed": self.config.seed,
            "n_model_workers": self.n,
            "train_batch_size": self.config.train_batch_size,
            "dataset_size": self.ft_spec.dataset_size,
            "save_ctl": self.save_ctl.state_dict(),
            "ckpt_ctl": self.ckpt_ctl.state_dict(),
            "eval_ctl": self.eval_ctl.state_dict(),
            "counters": dict(self.counters),
        }

    def _load_state(self, state: Dict[str, Any], path: str) -> None:
        if state.get("format") != STATE_FORMAT:
            raise recover.RecoverError(
                f"{path}: unknown master state format {state.get('format')!r}"
            )
        now = {
            "seed": self.config.seed,
            "n_model_workers": self.n,
            "train_batch_size": self.config.train_batch_size,
            "dataset_size": self.ft_spec.dataset_size,
        }
        for k, v in now.items():
            if state[k] != v:
                raise recover.RecoverError(
                    f"recover checkpoint {path} was written with {k}={state[k]}, this run has {k}={v}; "
                    "resume with the same config or delete the checkpoint to start afresh"
                )
        self.step = StepInfo(**state["step"])
        self.save_ctl.load_state_dict(state["save_ctl"])
        self.ckpt_ctl.load_state_dict(state["ckpt_ctl"])
        self.eval_ctl.load_state_dict(state["eval_ctl"])
        self.counters.update(state["counters"])

    # ---- the loop -------------------------------------------------------------

    async def _poll_async(self) -> PollResult:
        if not self.started:
            await self._start()
            self.started = True
            return PollResult()
        if self.step.global_step >= self.total_steps:
            await self._finish()
            return PollResult(completed=True)
        n = await self._run_step()
        return PollResult(sample_count=n, batch_count=1)

    async def _run_step(self) -> int:
        t0, wall0 = time.monotonic(), time.time()
        step = self.step
        ids = await self._load_step()
        self._stats: Dict[str, List[float]] = {}
        self._done: Dict[str, bool] = {name: False for name in self.mfcs}
        try:
            async with asyncio.TaskGroup() as tg:
                for name in self.graph.topological_order():
                    tg.create_task(self._run_mfc(self.mfcs[name], ids, step))
        except ExceptionGroup as eg:  # the first failure names the MFC and worker
            raise eg.exceptions[0] from None
        tokens = self._step_tokens(ids)
        await self._call("clear_data_cache", [tuple(ids)] * self.n)
        self.buffer.remove(ids)
        epoch_done = sum(self.remaining) == 0
        if epoch_done:
            self.remaining = list(self.shard_sizes)
        self.step = step.next(epoch_done)
        seconds = time.monotonic() - t0
        self.counters["samples"] += len(ids)
        self.counters["tokens"] += tokens
        self.counters["seconds"] += seconds
        record = {
            "step": self.step.global_step,
            "epoch": step.epoch + 1,
            "epoch_step": step.epoch_step + 1,
            "n_items": len(ids),
            "tokens": tokens,
            "time": seconds,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "elapsed": self.counters["seconds"],
            **{k: sum(v) / len(v) for k, v in sorted(self._stats.items())},
        }
        self.trace.complete(f"step {self.step.global_step}", "master_worker/0", wall0, time.time())
        name_resolve.add(
            names.training_samples(self.experiment_name, self.trial_name),
            str(self.counters["samples"]),
            replace=True,
        )
        done = self.step.global_step >= self.total_steps
        if self.config.eval and self.eval_ctl.check(epochs=int(epoch_done), steps=1):
            record.update(await self._evaluate())
        self.metrics.write(record)
        self.tb.write(self.step.global_step, record)
        self.trace.flush()
        self.progress.update(record)
        saved = self.save_ctl.check(epochs=int(epoch_done), steps=1)
        if saved or (done and self._saves_configured()):
            await self._save(record)
        if self.ckpt_ctl.check(epochs=int(epoch_done), steps=1) and not done:
            await self._checkpoint()
        return len(ids)

    async def _load_step(self) -> List[str]:
        """Fetch the step's items (metadata into the buffer, tensors stay on the workers)."""
        need = min(self.config.train_batch_size, sum(self.remaining))
        want = allocate_fetch(need, self.remaining)
        ids: List[str] = []
        t = time.time()
        while True:
            asked = list(want)
            replies = await self._call("fetch", [FetchRequest(self.step.epoch, w) for w in asked])
            for rank, rep in enumerate(replies):
                got = 0 if rep.meta is None else len(rep.meta)
                if got:
                    self.buffer.add(rep.meta, owner=rank)
                    ids.extend(rep.meta.ids)
                self.remaining[rank] = rep.position.remaining
                if got == 0 and asked[rank] > 0 or got > asked[rank]:
                    raise RuntimeError(
                        f"model_worker/{rank} returned {got} items for a fetch of {asked[rank]} "
                        f"(epoch {self.step.epoch}, position {rep.position}); master and worker disagree"
                    )
                want[rank] -= got
            if not any(want):
                break
        self.trace.complete("fetch", "master_worker/0", t, time.time(), n_items=len(ids))
        return ids

    async def _run_mfc(self, mfc: MFCDef, step_ids: List[str], step: StepInfo) -> None:
        """Run ``mfc`` over all of the step's items, ``n_seqs`` at a time, oldest first."""
        parents = self.graph.parents(mfc.name)
        for size in call_sizes(len(step_ids), mfc.n_seqs):
            async with self.cond:
                while True:
                    ready = self.buffer.ready(mfc.name, mfc.input_keys, among=step_ids)
                    if len(ready) >= size:
                        break
                    if all(self._done[p] for p in parents):
                        raise RuntimeError(
                            f"MFC {mfc.name!r} needs {size} items with keys {list(mfc.input_keys)} but only "
                            f"{len(ready)} have them after its producers {parents} finished"
                        )
                    await self.cond.wait()
                ids = ready[:size]
                self.buffer.mark_consumed(ids, mfc.name)
            async with self.dispatch_lock:
                rids, parts = self._dispatch(mfc, ids, step)
            t = time.time()
            replies = [
                r.data for r in await self.client.gather_async(rids, timeout=self.config.timeout)
            ]
            async with self.cond:
                self._absorb(mfc, parts, replies, t)
                self.cond.notify_all()
        async with self.cond:
            self._done[mfc.name] = True
            self.cond.notify_all()

    def _dispatch(self, mfc: MFCDef, ids: List[str], step: StepInfo):
        """Split, plan and send one MFC call to every rank (no await: atomic in the loop)."""
        keys = list(mfc.input_keys)
        by_count = mfc.interface_type == ModelInterfaceType.GENERATE
        parts = partition_for_dp(ids, self.buffer.item_tokens(ids, keys), self.n, by_count)
        first = self.buffer.entry(ids[0]).keys
        plan = build_transfer_plan(
            parts,
            keys,
            self.buffer.holder_map(ids, keys),
            seqlens=lambda i, k: self.buffer.entry(i).keys[k].seqlens,
            dtypes={k: first[k].dtype for k in keys},
            trailing_shapes={k: first[k].trailing_shape for k in keys},
        )
        for s in plan:
            self.buffer.add_holder(s.ids, s.key, s.dst)
        datas = [MFCRequest(mfc.name, step, tuple(plan), self.buffer.meta(p, keys)) for p in parts]
        return self.client.request(self.handlers, mfc.interface_type.value, datas), parts

    def _absorb(
        self, mfc: MFCDef, parts: List[List[str]], replies: List[MFCReply], sent: float
    ) -> None:
        """Record one call's replies: output ownership, stats (averaged over ranks), trace."""
        stats: Dict[str, List[float]] = {}
        for rank, (part, rep) in enumerate(zip(parts, replies)):
            if rep.output is not None:
                if (
                    sorted(rep.output.ids) != sorted(part)
                    or not set(mfc.output_keys) <= rep.output.keys
                ):
                    raise RuntimeError(
                        f"MFC {mfc.name!r}: {rep.worker} replied items/keys {sorted(rep.output.ids)[:3]}/"
                        f"{sorted(rep.output.keys)} for {len(part)} items and keys {list(mfc.output_keys)}"
                    )
                self.buffer.amend(rep.output, owner=rank)
            elif mfc.output_keys:
                raise RuntimeError(f"MFC {mfc.name!r}: {rep.worker} replied no output")
            for k, v in rep.stats.items():
                stats.setdefault(k, []).append(v)
            self.trace.complete(
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
        self._stats.setdefault(f"timing/{mfc.name}", []).append(max(r.end for r in replies) - sent)
        self._stats.setdefault(f"data_transfer/{mfc.name}_bytes", []).append(
            sum(r.bytes_received for r in replies)
        )

    def _step_tokens(self, ids: List[str]) -> int:
        """Tokens of the step: per item, its longest key."""
        return sum(
            max((k.n_tokens for k in self.buffer.entry(i).keys.values()), default=0) for i in ids
        )

    # ---- periodic actions -----------------------------------------------------

    async def _evaluate(self) -> Dict[str, float]:
        replies = await self._call("evaluate", [EvalRequest(self.step)] * self.n)
        for rank, r in enumerate(replies):
            self.trace.complete("evaluate", self.handlers[rank], r.start, r.end, n_items=r.n_items)
        return {f"eval/{k}": v for k, v in replies[0].metrics.items()}

    def _saves_configured(self) -> bool:
        c = self.config.exp_ctrl
        return any(x is not None for x in (c.save_freq_epochs, c.save_freq_steps, c.save_freq_secs))

    async def _save(self, record: Dict[str, Any]) -> None:
        """HF directories of the trained roles, named like ``epoch1epochstep3globalstep3``."""
        tag = f"epoch{record['epoch']}epochstep{record['epoch_step']}globalstep{record['step']}"
        roles = sorted({m.role for m in self.mfcs.values() if m.is_train})
        dirs = {r: os.path.join(constants.checkpoint_dir(), r, tag) for r in roles}
        await self._call("save", [SaveRequest(dirs)] * self.n)
        self.logger.info(f"saved {', '.join(f'{r} -> {d}' for r, d in dirs.items())}")

    async def _checkpoint(self) -> None:
        t = time.time()
        root = recover.recover_root(self.config.recover_dir)
        tmp = recover.prepare_tmp_dir(root, self.step.global_step)
        await self._call("checkpoint", [CheckpointRequest(tmp, self.step)] * self.n)
        recover.commit(
            root,
            tmp,
            self.step.global_step,
            self._state_dict(),
            self.config.max_recover_checkpoints,
        )
        self.trace.complete("checkpoint", "master_worker/0", t, time.time())

    async def _finish(self) -> None:
        await self._call("exit", [None] * self.n)
        self.trace.close()
        self.tb.close()
        self.progress.close()
        png = None
        if self.config.plot_curves:
            png = plot_curves(
                constants.metrics_path(),
                os.path.join(constants.run_dir(), "curves.png"),
                self.config.log_stats_keys,
            )
        self.logger.info(
            f"finished {self.step.global_step} steps ({self.counters['samples']} samples, "
            f"{self.counters['seconds']:.1f}s); metrics in {constants.metrics_path()}"
            + (f", curves in {png}" if png else "")
        )

    def _exit_hook(self) -> None:
        for out in (self.trace, self.tb, self.progress):
            if out is not None:
                try:
                    out.close()
                except Exception:
                    self.logger.exception("closing an output failed")
        if getattr(self, "client", None) is not None:
            self.client.close()
