"""The master worker: runs the dataflow graph of MFCs over the model workers, step by step.

Worker type ``master_worker`` (an asyncio worker); config
:class:`~realhf.api.core.worker_api.MasterWorkerConfig`.  The master sees metadata only;
tensors stay on the model workers and move between them.

The model workers form the trainer layout ``config.layout`` (``d × p × m``, ranks row-major
over (data, pipe, tensor)): the master splits each MFC call over the ``d`` data-parallel
replicas and sends every rank of a replica the same part; only replica heads (pipe 0,
tensor 0) hold dataset shards and answer ``fetch``.

Start (first poll): wait for every model worker on the request stream, ``spec`` (the
heads' dataset shard sizes -> the real :class:`FinetuneSpec`), pick a recover checkpoint
(``recover_mode``; it must come from the same layout), ``initialize`` the workers
(engines, recovered weights/optimizers/data positions).

Then step after step (:class:`~realhf.system.dag.runner.DagRunner`: load the step's
items, run every MFC over them, clear them), followed by the step's metrics line,
tensorboard scalars and progress, then eval / save / recover checkpoint when their
frequency fires.

It stops after ``total_train_epochs`` epochs or ``benchmark_steps`` steps, sends the
model workers ``exit``, writes ``curves.png`` and reports COMPLETED (the controller then
sets ``names.experiment_status`` to COMPLETE).  After every step it publishes the count of
consumed samples under ``names.training_samples``; once the workers are initialized it
publishes ``names.trainer_start`` (trained samples, version, recover checkpoint), which the
rollout side of asynchronous RL waits for.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Dict, List, Optional

from realhf.api.cli_args import RecoverMode
from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.dfg import MFCDef, build_graph
from realhf.api.core.model_api import FinetuneSpec, StepInfo
from realhf.api.core.worker_api import MasterWorkerConfig
from realhf.base import constants, name_resolve, names, worker_faults
from realhf.base.storage import recover
from realhf.base.storage.atomic_file import write_atomic
from realhf.base.timeutil import FrequencyControl
from realhf.system.dag.messages import (
    REQUEST_STREAM,
    CheckpointRequest,
    DataPosition,
    EvalRequest,
    Handle,
    InitializeRequest,
    SaveRequest,
)
from realhf.system.dag.outputs import (
    MetricsLog,
    ProgressDisplay,
    TensorBoardLog,
    TraceLog,
    WandbLog,
    plot_curves,
)
from realhf.system.dag.runner import DagRunner
from realhf.system.transport.request_reply import RequestClient
from realhf.system.worker.base import AsyncWorker, PollResult, register_worker

__all__ = ["MasterWorker", "STATE_FORMAT"]

#: version of the master's state in a recover checkpoint (bump when its layout changes)
STATE_FORMAT = 1


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

    # What _exit_hook releases, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way.
    client: Optional[RequestClient] = None
    metrics: Optional[MetricsLog] = None
    tb: Optional[TensorBoardLog] = None
    wandb: Optional[WandbLog] = None
    trace: Optional[TraceLog] = None
    progress: Optional[ProgressDisplay] = None

    def _configure(self, config: MasterWorkerConfig) -> None:
        self.graph = build_graph(config.mfcs)
        self.mfcs: Dict[str, MFCDef] = {m.name: m for m in config.mfcs}
        self.n = config.n_model_workers
        self.layout: ParallelismConfig = config.layout
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
        self.runner = DagRunner(
            self.graph,
            self.client,
            config.timeout,
            layout=self.layout,
            placements=config.placements,
            max_fill_rounds=config.max_fill_rounds,
        )
        #: the allocation a recover checkpoint must match (optimizer states are per rank)
        self.allocation = config.placements.describe(self.layout)
        self.save_ctl = _freq(config.exp_ctrl, "save")
        self.ckpt_ctl = _freq(config.exp_ctrl, "ckpt")
        self.eval_ctl = _freq(config.exp_ctrl, "eval")
        self.step = StepInfo()  # progress before the next step
        self.counters = {"samples": 0, "tokens": 0, "seconds": 0.0}
        self.started = False

    # ---- start --------------------------------------------------------------

    async def _call(self, handle: Handle, datas: List[Any]) -> List[Any]:
        return await self.runner.call(handle, datas)

    async def _start(self) -> None:
        cfg = self.config
        self.client.wait_for_handlers(cfg.timeout)
        specs = await self._call(Handle.SPEC, [None] * self.n)
        heads = self.runner.heads
        self.shard_sizes = [specs[h].dataset_size for h in heads]
        size = sum(self.shard_sizes)
        if size == 0:
            raise RuntimeError(
                "the model workers loaded no training data (ModelWorkerConfig.dataset)"
            )
        cfg.check_call_sizes(size)
        self.ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
        if size != cfg.ft_spec.dataset_size:
            self.logger.warning(
                f"the datasets hold {size} items, ft_spec planned "
                f"{cfg.ft_spec.dataset_size}; using {size}"
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
        init = InitializeRequest(self.ft_spec, ckpt, self.step.global_step)
        positions = await self._call(Handle.INITIALIZE, [init] * self.n)
        self.runner.remaining = [self._remaining(h, positions[h]) for h in heads]
        self._announce_start(ckpt)
        resume = None if ckpt is None else self.step.global_step
        self.metrics = MetricsLog(constants.metrics_path(), resume_step=resume)
        self.tb = TensorBoardLog(constants.tensorboard_dir(), resume_step=resume)
        self.wandb = WandbLog(
            cfg.wandb,
            constants.run_dir(),
            self.experiment_name,
            self.trial_name,
            cfg.run_config,
            resume_step=resume,
        )
        self.trace = TraceLog(
            constants.trace_path(), ["master_worker/0"] + self.handlers, resume=ckpt is not None
        )
        self.runner.trace = self.trace
        self.progress = ProgressDisplay(
            self.total_steps,
            self.step.global_step,
            cfg.log_stats_keys,
            interval=cfg.progress_interval,
        )
        # The launcher's console follows the run from this and metrics.jsonl.
        plan = {
            "total_steps": self.total_steps,
            "start_step": self.step.global_step,
            "steps_per_epoch": self.ft_spec.steps_per_epoch,
            "dataset_size": size,
            "resumed_from": ckpt,
        }
        write_atomic(constants.progress_path(), json.dumps(plan), fsync=False)
        if ckpt is None and cfg.eval and cfg.exp_ctrl.eval_at_start:
            record = {"step": 0, "epoch": 0, **await self._evaluate()}
            self._write(record)
            self.logger.info(f"evaluated before training: {record}")
        self.logger.info(
            f"{size} items over {self.layout.data} data-parallel replicas "
            f"(layout {self.layout}, {self.n} model workers), "
            f"{self.ft_spec.steps_per_epoch} steps/epoch, "
            f"running steps {self.step.global_step + 1}..{self.total_steps}"
            + (f" (resumed from {ckpt})" if ckpt else "")
            + f"\n{self.graph.to_text()}"
        )

    def _announce_start(self, ckpt: Optional[str]) -> None:
        """Tell the rollout side where training starts (async RL waits for this)."""
        exp, trial = self.experiment_name, self.trial_name
        samples = str(self.counters["samples"])
        name_resolve.add(names.training_samples(exp, trial), samples, replace=True)
        start = {
            "trained_samples": self.counters["samples"],
            "version": self.step.global_step,
            "checkpoint": ckpt,
        }
        name_resolve.add(names.trainer_start(exp, trial), json.dumps(start), replace=True)

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
        mode = RecoverMode(self.config.recover_mode)
        if mode is RecoverMode.DISABLED:
            return None
        root = recover.recover_root(self.config.recover_dir)
        path = recover.find_latest(root) if os.path.isdir(root) else None
        if path is None and mode is RecoverMode.RESUME:
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
            "layout": self.allocation,
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
        # Optimizer states, data positions and interface states are per rank of the layout.
        layout = state.get("layout", str(ParallelismConfig(data=state["n_model_workers"])))
        if layout != self.allocation:
            raise recover.RecoverError(
                f"recover checkpoint {path} was written by trainer layout {layout}, this run "
                f"has layout {self.allocation}; a checkpoint resumes on the layout "
                f"that wrote it (its optimizer states are per rank): run with {layout} or "
                "delete the checkpoint to start afresh"
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
                    f"recover checkpoint {path} was written with {k}={state[k]}, "
                    f"this run has {k}={v}; resume with the same config or delete the checkpoint "
                    "to start afresh"
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
        res = await self.runner.run_step(step, self.config.train_batch_size)
        epoch_done = sum(self.runner.remaining) == 0
        if epoch_done:  # the loaders move on to the next epoch at the next fetch
            self.runner.remaining = list(self.shard_sizes)
        self.step = step.next(epoch_done)
        seconds = time.monotonic() - t0
        self.counters["samples"] += len(res.ids)
        self.counters["tokens"] += res.tokens
        self.counters["seconds"] += seconds
        record = {
            "step": self.step.global_step,
            "epoch": step.epoch + 1,
            "epoch_step": step.epoch_step + 1,
            "n_items": len(res.ids),
            "tokens": res.tokens,
            "time": seconds,
            "tokens_per_s": res.tokens / max(seconds, 1e-9),
            "elapsed": self.counters["seconds"],
            **res.stats,
        }
        self.trace.complete(f"step {self.step.global_step}", "master_worker/0", wall0, time.time())
        # The rollout side's staleness control admits new generations against this count.
        name_resolve.add(
            names.training_samples(self.experiment_name, self.trial_name),
            str(self.counters["samples"]),
            replace=True,
        )
        done = self.step.global_step >= self.total_steps
        # Before the record is written, so eval metrics share the step's line.
        if self.config.eval and self.eval_ctl.check(epochs=int(epoch_done), steps=1):
            record.update(await self._evaluate())
        self._write(record)
        self.trace.flush()
        self.progress.update(record)
        saved = self.save_ctl.check(epochs=int(epoch_done), steps=1)
        # The final model is saved whenever saving is configured, due or not.
        if saved or (done and self._saves_configured()):
            await self._save(record)
        # Not after the last step: the run is complete, nothing is left to resume.
        if self.ckpt_ctl.check(epochs=int(epoch_done), steps=1) and not done:
            await self._checkpoint()
        return len(res.ids)

    def _write(self, record: Dict[str, Any]) -> None:
        """One step's record to metrics.jsonl, tensorboard and W&B."""
        self.metrics.write(record)
        self.tb.write(record["step"], record)
        self.wandb.write(record["step"], record)

    # ---- periodic actions -----------------------------------------------------

    async def _evaluate(self) -> Dict[str, float]:
        replies = await self._call(Handle.EVALUATE, [EvalRequest(self.step)] * self.n)
        for rank, r in enumerate(replies):
            self.trace.complete("evaluate", self.handlers[rank], r.start, r.end, n_items=r.n_items)
        # Keys go under "eval/" (once: an interface may have prefixed them already).
        return {
            (k if k.startswith("eval/") else f"eval/{k}"): v for k, v in replies[0].metrics.items()
        }

    def _saves_configured(self) -> bool:
        c = self.config.exp_ctrl
        return any(x is not None for x in (c.save_freq_epochs, c.save_freq_steps, c.save_freq_secs))

    async def _save(self, record: Dict[str, Any]) -> None:
        """HF directories of the trained roles, named like ``epoch1epochstep3globalstep3``."""
        tag = constants.hf_checkpoint_name(record["epoch"], record["epoch_step"], record["step"])
        roles = sorted({m.role for m in self.mfcs.values() if m.is_train})
        dirs = {r: os.path.join(constants.checkpoint_dir(), r, tag) for r in roles}
        await self._call(Handle.SAVE, [SaveRequest(dirs)] * self.n)
        self.logger.info(f"saved {', '.join(f'{r} -> {d}' for r, d in dirs.items())}")

    async def _checkpoint(self) -> None:
        t = time.time()
        root = recover.recover_root(self.config.recover_dir)
        # Workers write into a .tmp directory that only the commit below, after every
        # worker has replied, turns into a checkpoint: a crash mid-write leaves none.
        tmp = recover.prepare_tmp_dir(root, self.step.global_step)
        try:
            # Every worker's reply is awaited, errors included, before the directory can be
            # discarded below: a worker still writing would recreate it after the discard.
            await self.runner.call(
                Handle.CHECKPOINT, [CheckpointRequest(tmp, self.step)] * self.n, wait_all=True
            )
            hold = worker_faults.faults_of(self.worker_name).get("slow_checkpoint")
            if hold:  # reliability tests strike while a checkpoint is being written
                await asyncio.sleep(hold)
            recover.commit(
                root,
                tmp,
                self.step.global_step,
                self._state_dict(),
                self.config.max_recover_checkpoints,
            )
        except BaseException:
            # A worker's write failed (e.g. CheckpointWriteError: the disk is full): the
            # partial directory goes, the previous checkpoint stays the one to resume
            # from, and the error (naming the directory and the cause) fails the run.
            recover.discard_tmp_dir(tmp)
            raise
        self.trace.complete("checkpoint", "master_worker/0", t, time.time())

    async def _finish(self) -> None:
        await self._call(Handle.EXIT, [None] * self.n)
        self.trace.close()
        self.tb.close()
        self.wandb.close(exit_code=0)
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
        # Each resource is None until built (class attributes above).
        for out in (self.trace, self.tb, self.wandb):
            if out is not None:
                try:
                    out.close()
                except Exception:
                    self.logger.exception("closing an output failed")
        if self.client is not None:
            self.client.close()
