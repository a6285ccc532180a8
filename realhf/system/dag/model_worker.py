"""The model worker: hosts every model role as one rank of the trainer layout, runs MFCs.

Worker type ``model_worker``; config :class:`~realhf.api.core.worker_api.ModelWorkerConfig`.

On ``configure`` it joins the torch.distributed world of all model workers
(:mod:`realhf.system.transport.process_group`: gloo on CPU, nccl with a gloo side group for
data when CUDA is present; every wait bounded by ``config.timeout``), builds the
:class:`~realhf.impl.model.parallelism.ParallelGrid` of the trainer layout ``d × p × m``
(rank = worker index; replica ``k`` is ranks ``[k·p·m, (k+1)·p·m)``), loads its part of
each role (:func:`~realhf.impl.model.parallelism.load_model`), the datasets and the
interfaces of the MFCs.  The head (pipe 0, tensor 0) of replica ``k`` loads training shard
``k`` of ``d`` and alone answers ``fetch``; every rank of replica ``k`` loads eval shard
``k``.  It then serves the master's requests in arrival order, one at a time — the master
relies on that order to keep collectives aligned across workers.  What each handle takes,
answers and runs is the table :data:`PROTOCOL` at the end of this module; the messages are
in :mod:`realhf.system.dag.messages`.

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

import dataclasses
import importlib
import os
import random
import shutil
import time
from types import NoneType
from typing import Any, Callable, Dict, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from realhf.api.core import registry
from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec, Model, StepInfo
from realhf.api.core.worker_api import ModelWorkerConfig
from realhf.base import constants, name_resolve, names, recover, seeding, stats_tracker
from realhf.impl.dataset.shard_loader import ShardLoader
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.parallelism import ParallelGrid, load_model
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
    SaveRequest,
    SpecReply,
)
from realhf.system.dag.transfer import execute_plan
from realhf.system.rollout.trajectory_stream import TrajectoryStreamLoader
from realhf.system.transport.errors import NoMessage, StreamTimeout
from realhf.system.transport.process_group import init_world
from realhf.system.transport.request_reply import Payload, ReplyServer
from realhf.system.worker.base import PollResult, Worker, register_worker

__all__ = ["ModelWorker", "Route", "PROTOCOL", "DIST_GROUP_NAME"]

#: the name under ``names.distributed_master`` of the model workers' process group
DIST_GROUP_NAME = "model_worker"

# Default interface/dataset implementations register themselves on import.
_DEFAULT_IMPORTS = ("realhf.impl.dataset", "realhf.impl.model.interface")


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


@register_worker("model_worker")
class ModelWorker(Worker):
    """See the module docstring."""

    config_class = ModelWorkerConfig

    # What _exit_hook releases, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way.
    server: Optional[ReplyServer] = None
    loader: Optional[Union[ShardLoader, TrajectoryStreamLoader]] = None

    # ---- setup --------------------------------------------------------------

    def _configure(self, config: ModelWorkerConfig) -> None:
        self._prepare_process(config)
        self._pick_device()
        layout = self._check_layout(config)
        self._join_world(config)
        # Collective (new_group): every model worker builds it, right after joining.
        self.grid = ParallelGrid.create(layout)
        self._load_tokenizer(config)
        self._load_models(config)
        self._open_datasets(config)
        self._make_interfaces(config)
        self._reset_run_state()

    def _prepare_process(self, config: ModelWorkerConfig) -> None:
        """Register the implementations the config names, set torch threads and the seed."""
        for module in _DEFAULT_IMPORTS + tuple(config.imports):
            importlib.import_module(module)
        if config.torch_num_threads is not None:
            torch.set_num_threads(config.torch_num_threads)
        seeding.set_random_seed(config.seed, self.worker_name)

    def _pick_device(self) -> None:
        """Rank and world size (= worker index and count) and this rank's device."""
        self.rank = self.worker_index
        self.world_size = self.worker_info.worker_count
        self.device = torch.device("cpu")
        if torch.cuda.is_available():
            # One visible device per worker under the launchers (Scheduling.gpu=1); when a
            # worker sees several, ranks spread over them.
            self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)

    def _check_layout(self, config: ModelWorkerConfig) -> ParallelismConfig:
        """The trainer layout, which must span exactly the launched model workers."""
        layout = config.layout or ParallelismConfig(data=self.world_size)
        if layout.world_size != self.world_size:
            raise ValueError(
                f"{self.worker_name}: ModelWorkerConfig.layout={layout} spans d·p·m = "
                f"{layout.world_size} model workers but the experiment launched "
                f"{self.world_size}; launch one model worker per rank of the layout"
            )
        return layout

    @property
    def is_replica_head(self) -> bool:
        """Whether this rank is its replica's (pipe 0, tensor 0) rank: it loads the
        replica's training data and answers ``fetch``."""
        return self.rank == self.grid.dp_head(self.grid.dp_rank)

    def _join_world(self, config: ModelWorkerConfig) -> None:
        """Join the model workers' torch.distributed world; keep its group for data."""
        world = init_world(
            self.experiment_name,
            self.trial_name,
            DIST_GROUP_NAME,
            self.rank,
            self.world_size,
            self.device,
            config.timeout,
            # Worker 0's address vanishes when it dies, like its status key (same TTL, at
            # least 5 s), so a restarted run never connects to a dead store.
            address_ttl=max(5.0, self.status_ttl),
        )
        self.data_group = world.data_group

    def _load_tokenizer(self, config: ModelWorkerConfig) -> None:
        """The HF tokenizer of ``config.tokenizer_path`` (None without one)."""
        self.tokenizer = None
        if config.tokenizer_path:
            import transformers

            self.tokenizer = transformers.AutoTokenizer.from_pretrained(config.tokenizer_path)

    def _load_models(self, config: ModelWorkerConfig) -> None:
        """Each role's weights (this rank's part) on this rank's device (engines come later)."""
        self.specs = {m.role: m for m in config.models}
        self.modules: Dict[str, Any] = {}
        # Weights drawn at load time (the fresh value head of a critic started from a causal
        # LM) must be the same on every rank: replicas and tensor/pipeline peers hold one
        # model.  Every rank draws what rank 0 draws.
        torch.manual_seed(seeding.derive_seed(config.seed, f"{self.worker_type}/0"))
        for spec in config.models:
            self.modules[spec.role] = self._load_part(spec.role, spec.path)

    def _load_part(self, role: str, path: str):
        """This rank's part of HF directory ``path`` as a ReaLModel of ``role``'s spec."""
        spec = self.specs[role]
        return load_model(
            path,
            self.grid,
            dtype=getattr(torch, spec.dtype),
            device=self.device,
            is_critic=spec.is_critic,
            gradient_checkpointing=spec.gradient_checkpointing,
        )

    def _reload_weights(self, role: str, path: str) -> None:
        """Replace ``role``'s weights in place (parameters and optimizer stay bound)."""
        self.modules[role].load_flat(self._load_part(role, path).flat_params.detach())

    def _open_datasets(self, config: ModelWorkerConfig) -> None:
        """The training data (replica heads: the replica's shard or the rollout stream) and
        the eval shard (every rank of the replica)."""
        self.loader = None
        if not self.is_replica_head:
            pass  # the master sends this rank its replica's items through transfer plans
        elif config.stream is not None:
            self.loader = TrajectoryStreamLoader(
                config.stream,
                self.experiment_name,
                self.trial_name,
                self.grid.dp_rank,  # the replica head consumes the stream as this dp rank
                self.worker_name,
                log_path=os.path.join(constants.run_dir(), "trajectories.jsonl"),
            )
        else:
            self.loader = self._make_loader(config.dataset, "dataset")
        self.eval_loader = self._make_loader(config.eval_dataset, "eval_dataset")

    def _make_interfaces(self, config: ModelWorkerConfig) -> None:
        """The MFCs' interfaces and the evaluator."""
        self.mfcs: Dict[str, MFCDef] = {m.name: m for m in config.mfcs}
        self.interfaces = {m.name: registry.make_interface(m.interface_impl) for m in config.mfcs}
        self.evaluator = None
        if config.evaluation is not None:
            self.evaluator = registry.make_interface(config.evaluation.interface_impl)

    def _reset_run_state(self) -> None:
        """Empty engines, data store and weight versions; the stream connects on first poll."""
        self.models: Dict[str, Model] = {}  # built by `initialize`
        self.engines: Dict[str, Any] = {}
        self.store = LocalStore(self.worker_name)
        self.server: Optional[ReplyServer] = None
        self.versions: Dict[str, int] = {}

    def _make_loader(self, abstraction, what: str) -> Optional[ShardLoader]:
        if abstraction is None:
            return None
        dp_rank, dp_size = self.grid.dp_rank, self.grid.dp_size
        dataset = registry.make_dataset(
            abstraction,
            seed=self.config.seed,
            dp_rank=dp_rank,
            world_size=dp_size,
            tokenizer=self.tokenizer,
        )
        loader = ShardLoader(dataset, self.config.seed, f"{self.worker_name} {what}")
        self.logger.info(
            f"{what} {abstraction.type_!r}: {len(loader)} items in shard {dp_rank}/{dp_size}"
        )
        return loader

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
            roles=tuple(self.specs),
        )

    def _position(self) -> DataPosition:
        if self.loader is None:
            return DataPosition(0, 0, 0)
        return DataPosition(self.loader.epoch, self.loader.n_used, len(self.loader))

    def _initialize(self, req: InitializeRequest) -> DataPosition:
        if self.models:
            raise RuntimeError(
                f"{self.worker_name} is already initialized; `initialize` comes once"
            )
        self.ft_spec: FinetuneSpec = req.ft_spec
        for role, spec in self.specs.items():
            module = self.modules[role]
            if spec.trainable:
                engine = TrainEngine(
                    module,
                    spec.optimizer_config,
                    req.ft_spec,
                    grid=self.grid,
                    gradient_checkpointing=spec.gradient_checkpointing,
                )
            else:
                engine = InferenceEngine(module, grid=self.grid)
            self.engines[role] = engine
            self.models[role] = Model(
                name=role,
                module=engine,
                tokenizer=self.tokenizer,
                device=self.device,
                ft_spec=req.ft_spec if spec.trainable else None,
            )
        if req.recover_dir is not None:
            recover.load_worker_state(
                req.recover_dir,
                self.rank,
                self._trainable(),
                self.loader,
                self.interfaces,
                load_weights=self._reload_weights,
            )
            self.logger.info(f"resumed from {req.recover_dir} at data position {self._position()}")
        if req.version > 0:
            # Generation servers start from the roles' initial weights: give them the resumed ones.
            for role, spec in self.specs.items():
                if spec.publish_weights:
                    self._publish(role, req.version)
        return self._position()

    def _trainable(self) -> Dict[str, tuple]:
        return {r: (self.modules[r], self.engines[r]) for r, s in self.specs.items() if s.trainable}

    def _fetch(self, req: FetchRequest) -> FetchReply:
        if self.loader is None:
            raise RuntimeError(
                f"{self.worker_name} has no dataset: ModelWorkerConfig.dataset is None, or this "
                f"rank ({self.grid}) is not the head (pipe 0, tensor 0) of its data-parallel "
                "replica, which alone loads the replica's data"
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

    def _seed_for(self, what: str, step: StepInfo) -> None:
        # Derived from the call, not drawn from a running generator: a resumed run seeds
        # every call exactly as the uninterrupted run did.  The ranks of a replica draw
        # alike (same data, same results); plain data parallelism has dp_rank == rank.
        dp = self.grid.dp_rank
        s = seeding.derive_seed(self.config.seed, f"{what}:step{step.global_step}:rank{dp}")
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)

    def _model(self, role: str) -> Model:
        if role not in self.models:
            raise RuntimeError(
                f"{self.worker_name}: model {role!r} is not initialized; "
                "the master sends `initialize` first"
            )
        return self.models[role]

    def _run_mfc(self, req: MFCRequest) -> MFCReply:
        start = time.time()
        mfc = self.mfcs.get(req.mfc_name)
        if mfc is None:
            raise KeyError(
                f"{self.worker_name}: unknown MFC {req.mfc_name!r}; MFCs: {sorted(self.mfcs)}"
            )
        model = self._model(mfc.role)
        # The store keeps host tensors and data moves over gloo (the world on CPU, a side
        # group next to nccl on GPU).
        tstats = execute_plan(req.plan, self.rank, self.store, self.data_group, torch.device("cpu"))
        data = self.store.sample(req.meta)
        if mfc.input_key_remap:
            data.remap_keys_(mfc.input_key_remap)
        model.version = req.step
        self._seed_for(f"{mfc.name}:call{req.call}", req.step)
        result = getattr(self.interfaces[mfc.name], mfc.interface_type.value)(
            model, data, mfc.mb_spec
        )
        output = None
        if mfc.is_train:
            stats = _average_stats(result)
            if self.specs[mfc.role].publish_weights:
                self._publish(mfc.role, req.step.global_step + 1)
        else:
            output = self._store_output(mfc, data, result)
            stats = {}
        # Every rank runs every MFC call, so all reach this collective.
        stats.update(self._export_stats())
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

    def _export_stats(self) -> Dict[str, float]:
        """The ``stats_tracker`` records of the call, reduced over the data-parallel replicas.

        The ranks of a replica recorded identical values (same data, same results), so the
        reduction runs over the ``data`` group only: over all ranks, sums would count each
        replica ``p·m`` times.
        """
        if self.grid.dp_size == 1:
            return stats_tracker.export(reduce=False)
        return stats_tracker.export(reduce_group=self.grid.groups["data"])

    def _store_output(self, mfc: MFCDef, data: SequenceSample, out) -> SequenceSample:
        if not isinstance(out, SequenceSample) or out.data is None:
            method = f"{type(self.interfaces[mfc.name]).__name__}.{mfc.interface_type.value}"
            raise TypeError(
                f"MFC {mfc.name!r}: {method} must return a SequenceSample with data for its "
                f"{len(data)} items, got {out!r}"
            )
        if sorted(out.ids) != sorted(data.ids):
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
        out = out.select(mfc.output_keys)
        self.store.put_sample(out)
        return out.meta()

    def _publish(self, role: str, version: int) -> None:
        # Data-parallel replicas hold the same weights after a step: replica 0 writes for
        # all (save_hf is a collective over its ranks; rank 0 writes the files).  The
        # directory is renamed into place complete, then the version key names it, so a
        # generation server that sees the key never loads a half-written directory.
        if self.grid.dp_rank == 0:
            final = constants.weight_publication_dir(role, version)
            tmp = final + ".tmp"
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self.modules[role].save_hf(tmp, tokenizer=self.config.tokenizer_path or None)
            if self.rank == 0:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                name_resolve.add(
                    names.model_version(self.experiment_name, self.trial_name, role),
                    str(version),
                    replace=True,
                )
        self.versions[role] = version

    def _evaluate(self, req: EvalRequest) -> EvalReply:
        start = time.time()
        if self.evaluator is None or self.eval_loader is None:
            raise RuntimeError(
                f"{self.worker_name}: no evaluation configured (ModelWorkerConfig.evaluation)"
            )
        spec = self.config.evaluation
        model = self._model(spec.role)
        model.version = req.step
        items = [self.eval_loader.dataset[i] for i in range(len(self.eval_loader))]
        self._seed_for("evaluate", req.step)
        local = self.evaluator.evaluate(model, SequenceSample.gather(items), spec.mb_spec) or {}
        local = {k: float(v) for k, v in local.items()}
        # Item-weighted mean over the replicas (one entry each: a replica's ranks evaluated
        # the same items together): every rank reports the global value.
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (len(items), local))
        gathered = [everyone[self.grid.dp_head(k)] for k in range(self.grid.dp_size)]
        total = sum(n for n, _ in gathered)
        keys = sorted({k for _, m in gathered for k in m})
        metrics = {
            k: sum(n * m[k] for n, m in gathered if k in m)
            / max(1, sum(n for n, m in gathered if k in m))
            for k in keys
        }
        metrics.update(self._export_stats())
        return EvalReply(self.worker_name, metrics, total, start, time.time())

    def _save(self, req: SaveRequest) -> List[str]:
        unknown = sorted(set(req.dirs) - set(self.specs))
        if unknown:
            raise KeyError(f"{self.worker_name}: cannot save unknown roles {unknown}")
        written = []
        if self.grid.dp_rank == 0:  # replicas are identical (see _publish)
            for role, path in req.dirs.items():
                self.modules[role].save_hf(path, tokenizer=self.config.tokenizer_path or None)
                if self.rank == 0:
                    written.append(path)
        return written

    def _checkpoint(self, req: CheckpointRequest) -> List[str]:
        # Every rank writes its optimizer state (its shard of the parameters); replica
        # heads their data position; replica 0 the weights (collective, rank 0 writes).
        state = self.loader.state_dict() if self.loader is not None else None
        return recover.save_worker_state(
            req.dir,
            self.rank,
            self._trainable(),
            state,
            self.interfaces,
            save_weights=self.grid.dp_rank == 0,
        )

    def _clear_data_cache(self, ids: tuple) -> int:
        return self.store.drop(ids)

    def _model_version(self, _: None) -> Dict[str, int]:
        return dict(self.versions)

    def _exit(self, _: None) -> None:
        """Nothing to do: the poll loop stops after replying (``PollResult.completed``)."""
        return None


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
    Handle.EXIT: Route(NoneType, NoneType, ModelWorker._exit),
}


def _parse_handle(name: str) -> Handle:
    try:
        return Handle(name)
    except ValueError:
        known = sorted(h.value for h in Handle)
        raise ValueError(f"unknown request {name!r}; known: {known}") from None
