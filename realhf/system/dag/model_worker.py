"""The model worker: hosts every model role as one rank of its layout, runs MFCs.

Worker type ``model_worker``; config :class:`~realhf.api.core.worker_api.ModelWorkerConfig`.
The class is the request dispatcher; two parts it delegates to read alone:

* :mod:`realhf.system.dag.worker_setup`: on ``configure``, the process, the device, the
  torch.distributed world of all model workers, the grid of every layout
  (:class:`~realhf.system.dag.worker_setup.Layouts`; trainer layout ``d × p × m``, rank =
  worker index, replica ``k`` is ranks ``[k·p·m, (k+1)·p·m)``), the tokenizer and the data
  (replica heads load training shard ``k`` of ``d`` and alone answer ``fetch``);
* :mod:`realhf.system.dag.worker_weights`: each role's part on its *home* layout (where it
  trains) and an empty *replica* for every MFC of the role on another layout, filled by the
  master's ``reallocate``; engines, offloading, weight publication and saving.

A worker outside an MFC's layout runs only the call's transfer plan.  After ``configure``
it serves the master's requests in arrival order, one at a time — the master relies on
that order to keep collectives aligned across workers.  What each handle takes, answers
and runs is the table :data:`PROTOCOL` at the end of this module; the messages are in
:mod:`realhf.system.dag.messages`.

MFC call (``generate`` / ``inference`` / ``train_step``); every rank of a replica gets the
same partition and computes the same results (the engines' contract):

1. run the master's transfer plan (:func:`~realhf.system.dag.transfer.execute_plan`);
2. assemble the local partition from the store, rename keys (``input_key_remap``);
3. seed torch/numpy/random from (seed, MFC, global step, data-parallel rank), call the
   interface;
4. store the outputs (``output_key_remap``) and reply their metadata, or reply the train
   statistics; ``stats_tracker`` records are reduced over the replicas and added;
5. after ``train_step`` of a role with ``publish_weights``, write an HF directory to
   ``constants.weight_publication_dir(role, version)`` (replica 0, a collective over its
   ranks) and set ``names.model_version``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from types import NoneType
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from realhf.api.core import registry
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import StepInfo
from realhf.api.core.worker_api import ModelWorkerConfig
from realhf.base import seeding, stats_tracker
from realhf.base.gcutil import trim_heap
from realhf.base.storage import recover
from realhf.impl.dataset.shard_loader import ShardLoader
from realhf.impl.model.parallelism import ParallelGrid
from realhf.system.dag.local_store import LocalStore
from realhf.system.dag.messages import (
    REQUEST_STREAM,
    CheckpointRequest,
    DataPosition,
    EvalReply,
    EvalRequest,
    FetchReply,
    FetchRequest,
    Handle,
    InitializeRequest,
    MFCReply,
    MFCRequest,
    ReallocReply,
    ReallocRequest,
    SaveRequest,
    SpecReply,
)
from realhf.system.dag.transfer import execute_plan
from realhf.system.dag.worker_setup import (
    Layouts,
    check_layout,
    join_world,
    load_tokenizer,
    open_eval_data,
    open_training_data,
    pick_device,
    prepare_process,
)
from realhf.system.dag.worker_weights import RoleWeights
from realhf.system.rollout.trajectory_stream import TrajectoryStreamLoader
from realhf.system.transport.errors import NoMessage, StreamTimeout
from realhf.system.transport.request_reply import Payload, ReplyServer
from realhf.system.worker.base import PollResult, Worker, register_worker

__all__ = ["ModelWorker", "Route", "PROTOCOL"]


@register_worker("model_worker")
class ModelWorker(Worker):
    """See the module docstring."""

    config_class = ModelWorkerConfig

    # What _exit_hook releases, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way.
    server: Optional[ReplyServer] = None
    loader: Optional[Union[ShardLoader, TrajectoryStreamLoader]] = None
    weights: Optional[RoleWeights] = None

    # ---- setup (worker_setup, worker_weights) -------------------------------

    def _configure(self, config: ModelWorkerConfig) -> None:
        """Set up in the order :mod:`~realhf.system.dag.worker_setup` describes."""
        prepare_process(config, self.worker_name)
        self.rank = self.worker_index
        self.world_size = self.worker_info.worker_count
        self.device = pick_device(self.rank)
        base = check_layout(config, self.world_size, self.worker_name)
        self.data_group = join_world(
            self.experiment_name,
            self.trial_name,
            self.rank,
            self.world_size,
            self.device,
            config.timeout,
            self.status_ttl,
        )
        # Right after joining: building the grids is collective (see worker_setup).
        self.layouts = Layouts.build(config, base, self.rank)
        self.tokenizer = load_tokenizer(config.tokenizer_path)
        self.weights = RoleWeights(
            config,
            self.layouts,
            self.device,
            self.tokenizer,
            self.experiment_name,
            self.trial_name,
            self.worker_name,
            self.worker_type,
        )
        # Assigned one at a time: a stream loader opened before a later step raises is
        # still closed by _exit_hook.
        self.loader = open_training_data(
            config,
            self.layouts,
            self.tokenizer,
            self.experiment_name,
            self.trial_name,
            self.worker_name,
            self.logger,
        )
        self.eval_grid, self.eval_loader = open_eval_data(
            config, self.layouts, self.tokenizer, self.worker_name, self.logger
        )
        self.mfcs: Dict[str, MFCDef] = {m.name: m for m in config.mfcs}
        self.interfaces = {m.name: registry.make_interface(m.interface_impl) for m in config.mfcs}
        self.evaluator = None
        if config.evaluation is not None:
            self.evaluator = registry.make_interface(config.evaluation.interface_impl)
        self.store = LocalStore(self.worker_name)
        self.server = None  # the stream connects on first poll

    # ---- the poll loop ------------------------------------------------------

    def _poll(self) -> PollResult:
        if self.server is None:  # the master binds after the model workers are configured
            self.server = ReplyServer(
                self.experiment_name,
                self.trial_name,
                REQUEST_STREAM,
                self.worker_name,
                connect_timeout=self.config.timeout,
            )
        try:
            # Short: the controller's requests are answered only between polls.
            req: Payload = self.server.poll(timeout=0.05)
        except (NoMessage, StreamTimeout):
            return PollResult()
        try:
            handle = _parse_handle(req.handle_name)
            route = PROTOCOL[handle]
            route.check_request(handle, req.data)
            result = route.handler(self, req.data)
        except Exception as e:
            # Tell the master (it raises with our traceback), then fail: peers may be
            # stuck in a collective with us, so carrying on is not safe.
            self.server.reply_error(req, e)
            raise
        self.server.reply(req, result)
        if handle is Handle.EXIT:
            return PollResult(completed=True)
        return PollResult(batch_count=1)

    def _exit_hook(self) -> None:
        # Each resource is None until built (class attributes above); the process group
        # tells for itself whether it was set up.
        if self.server is not None:
            self.server.close()
        if self.weights is not None:
            self.weights.close()
        if isinstance(self.loader, TrajectoryStreamLoader):
            self.loader.close()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # ---- handlers -----------------------------------------------------------

    def _spec(self, _: None) -> SpecReply:
        return SpecReply(
            worker=self.worker_name,
            dataset_size=len(self.loader) if self.loader else 0,
            eval_dataset_size=len(self.eval_loader) if self.eval_loader else 0,
            can_evaluate=self.evaluator is not None,
            roles=tuple(self.weights.specs),
        )

    def _position(self) -> DataPosition:
        if self.loader is None:
            return DataPosition(0, 0, 0)
        return DataPosition(self.loader.epoch, self.loader.n_used, len(self.loader))

    def _initialize(self, req: InitializeRequest) -> DataPosition:
        self.weights.initialize(req.ft_spec)
        if req.recover_dir is not None:
            recover.load_worker_state(
                req.recover_dir,
                self.rank,
                self.weights.trainable(),
                self.loader,
                self.interfaces,
                load_weights=self.weights.reload,
            )
            self.logger.info(f"resumed from {req.recover_dir} at data position {self._position()}")
        if req.version > 0:
            # Generation servers start from the roles' initial weights: give them the resumed ones.
            self.weights.publish_all(req.version)
        return self._position()

    def _fetch(self, req: FetchRequest) -> FetchReply:
        if self.loader is None:
            raise RuntimeError(
                f"{self.worker_name} has no dataset: ModelWorkerConfig.dataset is None, or this "
                f"rank ({self.layouts.data_grid}) is not the head (pipe 0, tensor 0) of its "
                "data-parallel replica, which alone loads the replica's data"
            )
        # Capped per request to bound one reply's load time; the master asks again for the rest.
        items = self.loader.take(req.epoch, min(req.n, self.config.dataset_batch_size))
        meta = None
        if items:
            sample = SequenceSample.gather(items)
            self.store.put_sample(sample)
            meta = sample.meta()
        stats = self.loader.take_stats() if isinstance(self.loader, TrajectoryStreamLoader) else {}
        return FetchReply(meta, self._position(), stats)

    def _run_mfc(self, req: MFCRequest) -> MFCReply:
        start = time.time()
        mfc = self.mfcs.get(req.mfc_name)
        if mfc is None:
            raise KeyError(
                f"{self.worker_name}: unknown MFC {req.mfc_name!r}; MFCs: {sorted(self.mfcs)}"
            )
        # The store keeps host tensors and data moves over gloo (the world on CPU, a side
        # group next to nccl on GPU).  Every worker runs the plan: one outside the MFC's
        # layout may hold inputs to send.
        tstats = execute_plan(req.plan, self.rank, self.store, self.data_group, torch.device("cpu"))
        grid = self.layouts.of_mfc(mfc)
        output, stats = None, {}
        if grid is not None:
            model = self.weights.model_for(mfc)
            data = self.store.sample(req.meta)
            if mfc.input_key_remap:
                data.remap_keys_(mfc.input_key_remap)
            model.version = req.step
            _seed_call(self.config.seed, f"{mfc.name}:call{req.call}", req.step, grid)
            # A call that does not train the role leaves its gradient memory free.
            idle = (
                contextlib.nullcontext() if mfc.is_train else self.weights.idle_gradients(mfc.role)
            )
            with self.weights.onloaded(mfc.role), idle:
                result = getattr(self.interfaces[mfc.name], mfc.interface_type.value)(
                    model, data, mfc.mb_spec
                )
            self.weights.release_replica(mfc)
            if mfc.is_train:
                stats = _average_stats(result)
            else:
                out = _checked_output(mfc, data, result, self.interfaces[mfc.name])
                if out is not None:
                    self.store.put_sample(out)
                    output = out.meta()
            # Every rank of the MFC's layout runs the call, so all reach this collective.
            stats.update(_export_stats(grid))
            # What the call freed goes back to the system, not into the next call's peak.
            trim_heap()
        if mfc.is_train and self.weights.specs[mfc.role].publish_weights:
            t = time.monotonic()
            self.weights.publish(mfc.role, req.step.global_step + 1)
            # The time from new weights to their publication (the servers' load is theirs).
            stats["weights/publish_s"] = time.monotonic() - t
        return MFCReply(
            worker=self.worker_name,
            mfc_name=mfc.name,
            output=output,
            stats=stats,
            start=start,
            end=time.time(),
            transfer_seconds=tstats.seconds,
            bytes_received=tstats.bytes_received,
            bytes_sent=tstats.bytes_sent,
        )

    def _reallocate(self, req: ReallocRequest) -> ReallocReply:
        return self.weights.reallocate(req)

    def _evaluate(self, req: EvalRequest) -> EvalReply:
        start = time.time()
        if self.evaluator is None:
            raise RuntimeError(
                f"{self.worker_name}: no evaluation configured (ModelWorkerConfig.evaluation)"
            )
        spec = self.config.evaluation
        grid, local, items = self.eval_grid, {}, []
        if grid is not None:  # this rank holds part of the evaluated role
            model = self.weights.models[spec.role]
            model.version = req.step
            items = [self.eval_loader.dataset[i] for i in range(len(self.eval_loader))]
            _seed_call(self.config.seed, "evaluate", req.step, grid)
            with self.weights.onloaded(spec.role), self.weights.idle_gradients(spec.role):
                local = self.evaluator.evaluate(model, SequenceSample.gather(items), spec.mb_spec)
            local = {k: float(v) for k, v in (local or {}).items()}
        # Item-weighted mean over the replicas (one entry each: a replica's ranks evaluated
        # the same items together): every rank reports the global value.
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (len(items), local))
        gathered = []
        if grid is not None:  # a rank outside the role's layout has no grid to read heads from
            heads = self.layouts.home(spec.role).dp_head
            n_replicas = self.layouts.home_layout(spec.role).data
            gathered = [everyone[heads(k)] for k in range(n_replicas)]
        total, metrics = _weighted_means(gathered)
        metrics.update(_export_stats(grid))
        return EvalReply(self.worker_name, metrics, total, start, time.time())

    def _save(self, req: SaveRequest) -> List[str]:
        return self.weights.save(req.dirs)

    def _checkpoint(self, req: CheckpointRequest) -> List[str]:
        # Every rank writes its optimizer state (its shard of the parameters); replica
        # heads their data position; replica 0 of each home layout the weights
        # (collective, rank 0 writes).
        state = self.loader.state_dict() if self.loader is not None else None
        trainable = self.weights.trainable()
        return recover.save_worker_state(
            req.dir,
            self.rank,
            trainable,
            state,
            self.interfaces,
            save_weights={r: self.weights.writes_weights(r) for r in trainable},
        )

    def _clear_data_cache(self, ids: tuple) -> int:
        return self.store.drop(ids)

    def _model_version(self, _: None) -> Dict[str, int]:
        return dict(self.weights.versions)

    def _exit(self, _: None) -> None:
        """Nothing to do: the poll loop stops after replying (``PollResult.completed``)."""
        return None


# ---- one MFC call's pieces ----------------------------------------------------------


def _seed_call(seed: int, what: str, step: StepInfo, grid: ParallelGrid) -> None:
    # Derived from the call, not drawn from a running generator: a resumed run seeds
    # every call exactly as the uninterrupted run did.  The ranks of a replica draw
    # alike (same data, same results); plain data parallelism has dp_rank == rank.
    dp = grid.dp_rank
    s = seeding.derive_seed(seed, f"{what}:step{step.global_step}:rank{dp}")
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _average_stats(result) -> Dict[str, float]:
    """A train_step result (a dict or a list of dicts) as one dict of floats."""
    dicts = result if isinstance(result, list) else [result or {}]
    out: Dict[str, List[float]] = {}
    for d in dicts:
        if not isinstance(d, dict):
            raise TypeError(
                f"train_step must return a dict or a list of dicts, got {type(d).__name__}"
            )
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().float().mean().item()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool):
                out.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in out.items()}


def _checked_output(mfc: MFCDef, data: SequenceSample, out, interface) -> Optional[SequenceSample]:
    """What ``interface`` returned for ``data``, checked, renamed (``output_key_remap``) and
    cut to the MFC's output keys; None when an MFC that drops items dropped them all."""
    if out is None and mfc.drops_items:
        return None  # every item dropped
    if not isinstance(out, SequenceSample) or out.data is None:
        method = f"{type(interface).__name__}.{mfc.interface_type.value}"
        raise TypeError(
            f"MFC {mfc.name!r}: {method} must return a SequenceSample with data for its "
            f"{len(data)} items, got {out!r}"
        )
    if mfc.drops_items:  # a subset: the master replaces the others
        if not set(out.ids) <= set(data.ids):
            raise ValueError(
                f"MFC {mfc.name!r} returned items {sorted(set(out.ids) - set(data.ids))[:4]} "
                "that were not among its inputs; an MFC that drops items returns a subset"
            )
    elif sorted(out.ids) != sorted(data.ids):
        raise ValueError(
            f"MFC {mfc.name!r} returned items {sorted(out.ids)[:4]}... for input items "
            f"{sorted(data.ids)[:4]}...; return one output item per input item, same ids"
        )
    if mfc.output_key_remap:
        out.remap_keys_({k: v for k, v in mfc.output_key_remap.items() if k in out.keys})
    missing = sorted(set(mfc.output_keys) - out.keys)
    if missing:
        raise KeyError(
            f"MFC {mfc.name!r} must produce keys {list(mfc.output_keys)} but the output lacks "
            f"{missing} (has {sorted(out.keys)}; output_key_remap {mfc.output_key_remap})"
        )
    return out.select(mfc.output_keys)


def _export_stats(grid: Optional[ParallelGrid]) -> Dict[str, float]:
    """The ``stats_tracker`` records of the call, reduced over the data-parallel replicas.

    The ranks of a replica recorded identical values (same data, same results), so the
    reduction runs over the ``data`` group only: over all ranks, sums would count each
    replica ``p·m`` times.
    """
    if grid is None or grid.dp_size == 1:
        return stats_tracker.export(reduce=False)
    return stats_tracker.export(reduce_group=grid.groups["data"])


def _weighted_means(gathered: List[Tuple[int, Dict[str, float]]]) -> Tuple[int, Dict[str, float]]:
    """The total item count and each metric's item-weighted mean over the replicas'
    ``(n_items, metrics)`` (a metric counts only the replicas that report it)."""
    total = sum(n for n, _ in gathered)
    keys = sorted({k for _, m in gathered for k in m})
    metrics = {
        k: sum(n * m[k] for n, m in gathered if k in m)
        / max(1, sum(n for n, m in gathered if k in m))
        for k in keys
    }
    return total, metrics


# ---- the protocol -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Route:
    """How a model worker serves one handle.

    Attributes:
        request: the type of ``Payload.data`` (checked before the handler runs).
        reply: the type of ``Reply.data``.
        handler: the :class:`ModelWorker` method that serves it (``handler(worker, data)``).
    """

    request: type
    reply: type
    handler: Callable[[ModelWorker, Any], Any]

    def check_request(self, handle: Handle, data: Any) -> None:
        """Raise TypeError unless ``data`` is this route's request type."""
        if not isinstance(data, self.request):
            raise TypeError(
                f"request {handle.value!r} carries data of type {type(data).__name__}; "
                f"it takes {self.request.__name__}"
            )


#: The master <-> model worker protocol: handle -> request type -> reply type -> handler.
#: ``generate``/``inference``/``train_step`` run one MFC call (``MFCReply.output`` is the
#: outputs' metadata, None for ``train_step``); after ``exit`` the worker stops serving.
PROTOCOL: Dict[Handle, Route] = {
    Handle.SPEC: Route(NoneType, SpecReply, ModelWorker._spec),
    Handle.INITIALIZE: Route(InitializeRequest, DataPosition, ModelWorker._initialize),
    Handle.FETCH: Route(FetchRequest, FetchReply, ModelWorker._fetch),
    Handle.GENERATE: Route(MFCRequest, MFCReply, ModelWorker._run_mfc),
    Handle.INFERENCE: Route(MFCRequest, MFCReply, ModelWorker._run_mfc),
    Handle.TRAIN_STEP: Route(MFCRequest, MFCReply, ModelWorker._run_mfc),
    Handle.EVALUATE: Route(EvalRequest, EvalReply, ModelWorker._evaluate),
    Handle.SAVE: Route(SaveRequest, list, ModelWorker._save),  # directories written
    Handle.CHECKPOINT: Route(CheckpointRequest, list, ModelWorker._checkpoint),  # files written
    Handle.CLEAR_DATA_CACHE: Route(tuple, int, ModelWorker._clear_data_cache),  # ids -> dropped
    Handle.MODEL_VERSION: Route(NoneType, dict, ModelWorker._model_version),  # {role: version}
    Handle.REALLOCATE: Route(ReallocRequest, ReallocReply, ModelWorker._reallocate),
    Handle.EXIT: Route(NoneType, NoneType, ModelWorker._exit),
}


def _parse_handle(name: str) -> Handle:
    try:
        return Handle(name)
    except ValueError:
        known = sorted(h.value for h in Handle)
        raise ValueError(f"unknown request {name!r}; known: {known}") from None
