"""The model worker: hosts every model role as one rank of its layout, runs MFCs.

Worker type ``model_worker``; config :class:`~realhf.api.core.worker_api.ModelWorkerConfig`.

On ``configure`` it joins the torch.distributed world of all model workers
(:mod:`realhf.system.transport.process_group`: gloo on CPU, nccl with a gloo side group for
data when CUDA is present; every wait bounded by ``config.timeout``), builds the
:class:`~realhf.impl.model.parallelism.ParallelGrid` of the trainer layout ``d × p × m``
(rank = worker index; replica ``k`` is ranks ``[k·p·m, (k+1)·p·m)``), loads its part of
each role (:func:`~realhf.impl.model.parallelism.load_model`), the datasets and the
interfaces of the MFCs.  The head (pipe 0, tensor 0) of replica ``k`` loads training shard
``k`` of ``d`` and alone answers ``fetch``; every rank of replica ``k`` loads eval shard
``k``.

Per-MFC layouts (``config.placements``): the grid of every layout is built on every worker
(a layout of ``n`` ranks spans workers ``0..n-1``); each role is loaded on its *home*
layout (where it trains), and every MFC of the role on another layout gets an empty
*replica* there, which the master's ``reallocate`` request fills from the home
(:mod:`realhf.impl.model.parallelism.realloc`; plans compiled once per layout pair).  A
worker outside an MFC's layout runs only the call's transfer plan.  Worker 0 then loads
the training data as one shard.  Roles with ``offload`` wait in host memory between their
calls.  It then serves the master's requests in arrival order, one at a time — the master
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

import contextlib
import dataclasses
import importlib
import os
import random
import shutil
import time
from types import NoneType
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

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
from realhf.impl.model.backend.offload import Offloader, free_storage, regrow_storage
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.parallelism import ParallelGrid, load_model
from realhf.impl.model.parallelism.model import GridHooks
from realhf.impl.model.parallelism.realloc import plan_reallocation
from realhf.impl.model.parallelism.realloc_exec import compile_plan
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


@dataclasses.dataclass
class _Replica:
    """A role's part on an MFC layout other than its home (filled by reallocation).

    ``version`` is the trained version it holds (-1: never filled); ``model`` the handle
    interfaces get (built by ``initialize``)."""

    module: Any
    grid: ParallelGrid
    model: Optional[Model] = None
    version: int = -1


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
        self._make_grids(config, layout)
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

    def _make_grids(self, config: ModelWorkerConfig, base: ParallelismConfig) -> None:
        """The grid of every layout (collective ``new_group`` calls: every model worker
        builds all of them, in one order, right after joining).  ``self.grid`` is the base
        layout's: it shards the data.  A layout of ``n`` ranks spans workers ``0..n-1``; a
        worker outside it gets None."""
        self.base = base
        self.places = config.placements
        self.grids: Dict[str, Optional[ParallelGrid]] = {
            str(x): ParallelGrid.create(x, range(x.world_size)) for x in self.places.layouts(base)
        }
        self.grid = self.grids[str(base)]
        # The data shards' layout: the base, or one shard on worker 0 (a grid without groups).
        data = self.places.data_layout(base)
        self.data_grid = self.grid if data == base else ParallelGrid.create(data, (0,))

    def _grid_of_mfc(self, mfc: MFCDef) -> Optional[ParallelGrid]:
        return self.grids[str(self.places.of_mfc(mfc.name, self.base))]

    def _home_grid(self, role: str) -> Optional[ParallelGrid]:
        return self.grids[str(self.places.home(role, self.base))]

    @property
    def is_replica_head(self) -> bool:
        """Whether this rank is its replica's (pipe 0, tensor 0) rank: it loads the
        replica's training data and answers ``fetch``."""
        return self.data_grid is not None and self.rank == self.data_grid.dp_head(
            self.data_grid.dp_rank
        )

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
        """Each role's weights (this rank's part) on its home layout, and empty replicas for
        its MFCs on other layouts (engines come later; reallocation fills replicas)."""
        from realhf.impl.model.conversion.hf import config_from_hf_dir

        self.specs = {m.role: m for m in config.models}
        self.configs = {
            m.role: config_from_hf_dir(m.path, is_critic=m.is_critic) for m in config.models
        }
        self.modules: Dict[str, Any] = {}  # role -> its home part, on the home's ranks
        for spec in config.models:
            if self._home_grid(spec.role) is None:
                continue
            # Weights drawn at load time (the fresh value head of a critic started from a
            # causal LM) must be the same on every rank: replicas and tensor/pipeline peers
            # hold one model.  Every rank draws what rank 0 draws, per role (not every
            # rank loads every role).
            torch.manual_seed(seeding.derive_seed(config.seed, f"{self.worker_type}/0/{spec.role}"))
            self.modules[spec.role] = self._load_part(spec.role, spec.path)
        self.replicas: Dict[Tuple[str, str], _Replica] = {}
        for mfc in config.mfcs:
            grid = self._grid_of_mfc(mfc)
            key = (mfc.role, str(grid.layout) if grid else "")
            if grid is None or not self.places.on_replica(mfc, self.base) or key in self.replicas:
                continue
            self.replicas[key] = _Replica(self._empty_part(mfc.role, grid), grid)
        self.offloaders = {
            role: Offloader(module.flat_params)
            for role, module in self.modules.items()
            if self.specs[role].offload
        }

    def _empty_part(self, role: str, grid: ParallelGrid):
        """This rank's part of ``role`` in ``grid``'s layout, with uninitialised weights."""
        spec, cfg = self.specs[role], self.configs[role]
        hooks = GridHooks(grid)
        return ReaLModel(
            cfg,
            dtype=getattr(torch, spec.dtype),
            device=self.device,
            init_weights=False,
            tp=hooks,
            layers=hooks.stage_range(cfg),
            critic_lm_logits=spec.critic_lm_logits,
        )

    def _load_part(self, role: str, path: str):
        """This rank's part of HF directory ``path`` as a ReaLModel of ``role``'s spec, in
        ``role``'s home layout."""
        spec = self.specs[role]
        return load_model(
            path,
            self._home_grid(role),
            dtype=getattr(torch, spec.dtype),
            device=self.device,
            is_critic=spec.is_critic,
            gradient_checkpointing=spec.gradient_checkpointing,
            critic_lm_logits=spec.critic_lm_logits,
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
                self.data_grid.dp_rank,  # the replica head consumes the stream as this dp rank
                self.worker_name,
                log_path=os.path.join(constants.run_dir(), "trajectories.jsonl"),
            )
        else:
            self.loader = self._make_loader(config.dataset, "dataset", self.data_grid)
        # Evaluation runs where the evaluated role lives.
        self.eval_grid = (
            None if config.evaluation is None else self._home_grid(config.evaluation.role)
        )
        self.eval_loader = None
        if self.eval_grid is not None:
            self.eval_loader = self._make_loader(
                config.eval_dataset, "eval_dataset", self.eval_grid
            )

    def _make_interfaces(self, config: ModelWorkerConfig) -> None:
        """The MFCs' interfaces and the evaluator."""
        self.mfcs: Dict[str, MFCDef] = {m.name: m for m in config.mfcs}
        self.interfaces = {m.name: registry.make_interface(m.interface_impl) for m in config.mfcs}
        self.evaluator = None
        if config.evaluation is not None:
            self.evaluator = registry.make_interface(config.evaluation.interface_impl)

    def _reset_run_state(self) -> None:
        """Empty engines, data store and weight versions; the stream connects on first poll."""
        self.models: Dict[str, Model] = {}  # built by `initialize` (home parts)
        self.engines: Dict[str, Any] = {}
        self.initialized = False
        self.realloc_plans: Dict[Tuple[str, str, str], Any] = {}
        self.store = LocalStore(self.worker_name)
        self.server: Optional[ReplyServer] = None
        self.versions: Dict[str, int] = {}

    def _make_loader(self, abstraction, what: str, grid: ParallelGrid) -> Optional[ShardLoader]:
        if abstraction is None:
            return None
        dp_rank, dp_size = grid.dp_rank, grid.dp_size
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
        if self.initialized:
            raise RuntimeError(
                f"{self.worker_name} is already initialized; `initialize` comes once"
            )
        self.initialized = True
        self.ft_spec: FinetuneSpec = req.ft_spec
        for role, module in self.modules.items():
            spec = self.specs[role]
            grid = self._home_grid(role)
            if spec.trainable:
                engine = TrainEngine(
                    module,
                    spec.optimizer_config,
                    req.ft_spec,
                    grid=grid,
                    gradient_checkpointing=spec.gradient_checkpointing,
                )
            else:
                engine = InferenceEngine(module, grid=grid)
            self.engines[role] = engine
            self.models[role] = self._handle(role, engine, req.ft_spec if spec.trainable else None)
        for (role, _), rep in self.replicas.items():
            rep.model = self._handle(role, InferenceEngine(rep.module, grid=rep.grid), None)
        for off in self.offloaders.values():
            off.offload()  # brought back around each call
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

    def _handle(self, role: str, engine, ft_spec) -> Model:
        return Model(
            name=role, module=engine, tokenizer=self.tokenizer, device=self.device, ft_spec=ft_spec
        )

    def _trainable(self) -> Dict[str, tuple]:
        """Trainable roles whose home part this rank holds."""
        return {r: (m, self.engines[r]) for r, m in self.modules.items() if self.specs[r].trainable}

    def _fetch(self, req: FetchRequest) -> FetchReply:
        if self.loader is None:
            raise RuntimeError(
                f"{self.worker_name} has no dataset: ModelWorkerConfig.dataset is None, or this "
                f"rank ({self.data_grid}) is not the head (pipe 0, tensor 0) of its data-parallel "
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

    def _seed_for(self, what: str, step: StepInfo, grid: ParallelGrid) -> None:
        # Derived from the call, not drawn from a running generator: a resumed run seeds
        # every call exactly as the uninterrupted run did.  The ranks of a replica draw
        # alike (same data, same results); plain data parallelism has dp_rank == rank.
        dp = grid.dp_rank
        s = seeding.derive_seed(self.config.seed, f"{what}:step{step.global_step}:rank{dp}")
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)

    def _model(self, mfc: MFCDef) -> Model:
        """The model handle ``mfc`` runs on here: its role's replica on the MFC's layout, or
        the home part."""
        if not self.initialized:
            raise RuntimeError(
                f"{self.worker_name}: model {mfc.role!r} is not initialized; "
                "the master sends `initialize` first"
            )
        if self.places.on_replica(mfc, self.base):
            rep = self.replicas[(mfc.role, str(self._grid_of_mfc(mfc).layout))]
            if rep.version < 0:
                raise RuntimeError(
                    f"{self.worker_name}: MFC {mfc.name!r} runs on a replica of {mfc.role!r} "
                    "that no reallocation has filled; the master reallocates before the call"
                )
            return rep.model
        if mfc.role in self.models:
            return self.models[mfc.role]
        # An MFC that reads no weights, away from where its role lives: tokenizer only.
        return Model(name=mfc.role, module=None, tokenizer=self.tokenizer, device=self.device)

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
        grid = self._grid_of_mfc(mfc)
        output, stats = None, {}
        if grid is not None:
            model = self._model(mfc)
            data = self.store.sample(req.meta)
            if mfc.input_key_remap:
                data.remap_keys_(mfc.input_key_remap)
            model.version = req.step
            self._seed_for(f"{mfc.name}:call{req.call}", req.step, grid)
            with self._onloaded(mfc.role):
                result = getattr(self.interfaces[mfc.name], mfc.interface_type.value)(
                    model, data, mfc.mb_spec
                )
            if self.places.on_replica(mfc, self.base) and not self.places.keep_replicas:
                rep = self.replicas[(mfc.role, str(grid.layout))]
                free_storage(rep.module.flat_params)  # refilled by the next reallocation
                rep.version = -1
            if mfc.is_train:
                stats = _average_stats(result)
            else:
                output = self._store_output(mfc, data, result)
            # Every rank of the MFC's layout runs the call, so all reach this collective.
            stats.update(self._export_stats(grid))
        if mfc.is_train and self.specs[mfc.role].publish_weights:
            self._publish(mfc.role, req.step.global_step + 1)
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

    @contextlib.contextmanager
    def _onloaded(self, role: str):
        """``role``'s home weights on the device for the duration (offloaded roles)."""
        off = self.offloaders.get(role)
        if off is None:
            yield
            return
        off.onload()
        try:
            yield
        finally:
            off.offload()

    def _reallocate(self, req: ReallocRequest) -> ReallocReply:
        """Copy ``req.role``'s trained weights from its home layout into its replica on
        ``req.dst`` (every rank of either layout calls this; plans are cached per pair)."""
        start = time.time()
        key = (req.role, str(req.src), str(req.dst))
        if key not in self.realloc_plans:
            # Layouts span the first d·p·m workers, so grid ranks are world ranks.
            plan = plan_reallocation(self.configs[req.role], req.src, req.dst)
            self.realloc_plans[key] = compile_plan(plan, self.rank)
        src = self.modules.get(req.role) if self.grids[str(req.src)] is not None else None
        rep = self.replicas.get((req.role, str(req.dst)))
        if rep is not None:
            regrow_storage(rep.module.flat_params)
        with torch.no_grad(), self._onloaded(req.role):
            moved = self.realloc_plans[key].run(
                None if src is None else src.flat_params.detach(),
                None if rep is None else rep.module.flat_params.detach(),
                timeout=self.config.timeout,
            )
        if rep is not None:
            rep.version = req.version
        size = torch.finfo(getattr(torch, self.specs[req.role].dtype)).bits // 8
        return ReallocReply(
            self.worker_name,
            req.role,
            moved["sent"] * size,
            moved["received"] * size,
            moved["local"] * size,
            start,
            time.time(),
        )

    def _export_stats(self, grid: Optional[ParallelGrid]) -> Dict[str, float]:
        """The ``stats_tracker`` records of the call, reduced over the data-parallel replicas.

        The ranks of a replica recorded identical values (same data, same results), so the
        reduction runs over the ``data`` group only: over all ranks, sums would count each
        replica ``p·m`` times.
        """
        if grid is None or grid.dp_size == 1:
            return stats_tracker.export(reduce=False)
        return stats_tracker.export(reduce_group=grid.groups["data"])

    def _store_output(self, mfc: MFCDef, data: SequenceSample, out) -> Optional[SequenceSample]:
        if out is None and mfc.drops_items:
            return None  # every item dropped
        if not isinstance(out, SequenceSample) or out.data is None:
            method = f"{type(self.interfaces[mfc.name]).__name__}.{mfc.interface_type.value}"
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
        out = out.select(mfc.output_keys)
        self.store.put_sample(out)
        return out.meta()

    def _publish(self, role: str, version: int) -> None:
        # Data-parallel replicas hold the same weights after a step: replica 0 of the home
        # layout writes for all (save_hf is a collective over its ranks; rank 0 writes the
        # files).  The directory is renamed into place complete, then the version key names
        # it, so a generation server that sees the key never loads a half-written directory.
        grid = self._home_grid(role)
        if grid is not None and grid.dp_rank == 0:
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
        if self.evaluator is None:
            raise RuntimeError(
                f"{self.worker_name}: no evaluation configured (ModelWorkerConfig.evaluation)"
            )
        spec = self.config.evaluation
        grid, local, items = self.eval_grid, {}, []
        if grid is not None:  # this rank holds part of the evaluated role
            model = self.models[spec.role]
            model.version = req.step
            items = [self.eval_loader.dataset[i] for i in range(len(self.eval_loader))]
            self._seed_for("evaluate", req.step, grid)
            with self._onloaded(spec.role):
                local = self.evaluator.evaluate(model, SequenceSample.gather(items), spec.mb_spec)
            local = {k: float(v) for k, v in (local or {}).items()}
        # Item-weighted mean over the replicas (one entry each: a replica's ranks evaluated
        # the same items together): every rank reports the global value.
        everyone: List[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (len(items), local))
        heads = self.grids[str(self.places.home(spec.role, self.base))].dp_head
        n_replicas = self.places.home(spec.role, self.base).data
        gathered = [everyone[heads(k)] for k in range(n_replicas)] if grid else []
        total = sum(n for n, _ in gathered)
        keys = sorted({k for _, m in gathered for k in m})
        metrics = {
            k: sum(n * m[k] for n, m in gathered if k in m)
            / max(1, sum(n for n, m in gathered if k in m))
            for k in keys
        }
        metrics.update(self._export_stats(grid))
        return EvalReply(self.worker_name, metrics, total, start, time.time())

    def _save(self, req: SaveRequest) -> List[str]:
        unknown = sorted(set(req.dirs) - set(self.specs))
        if unknown:
            raise KeyError(f"{self.worker_name}: cannot save unknown roles {unknown}")
        written = []
        for role, path in req.dirs.items():
            grid = self._home_grid(role)
            if grid is not None and grid.dp_rank == 0:  # replicas are identical (_publish)
                self.modules[role].save_hf(path, tokenizer=self.config.tokenizer_path or None)
                if self.rank == 0:
                    written.append(path)
        return written

    def _checkpoint(self, req: CheckpointRequest) -> List[str]:
        # Every rank writes its optimizer state (its shard of the parameters); replica
        # heads their data position; replica 0 of each home layout the weights
        # (collective, rank 0 writes).
        state = self.loader.state_dict() if self.loader is not None else None
        return recover.save_worker_state(
            req.dir,
            self.rank,
            self._trainable(),
            state,
            self.interfaces,
            save_weights={r: self._home_grid(r).dp_rank == 0 for r in self._trainable()},
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
    Handle.REALLOCATE: Route(ReallocRequest, ReallocReply, ModelWorker._reallocate),
    Handle.EXIT: Route(NoneType, NoneType, ModelWorker._exit),
}


def _parse_handle(name: str) -> Handle:
    try:
        return Handle(name)
    except ValueError:
        known = sorted(h.value for h in Handle)
        raise ValueError(f"unknown request {name!r}; known: {known}") from None
