"""One model worker's weights of every model role: loading, engines, reallocation, writing.

A role lives on its *home* layout (where it trains): each rank of that layout holds its part
(:attr:`RoleWeights.modules`, loaded by :func:`~realhf.impl.model.parallelism.load_model`).
Every MFC of the role that runs on another layout gets an empty *replica* there, which the
master's ``reallocate`` request fills from the home (:meth:`RoleWeights.reallocate`;
:mod:`realhf.impl.model.parallelism.realloc`, plans compiled once per layout pair).  Roles
with ``offload`` wait in host memory between their calls (:meth:`RoleWeights.onloaded`).
``initialize`` wraps the parts in engines (train or inference) and model handles.

Writing weights (:meth:`~RoleWeights.publish` for generation servers, :meth:`~RoleWeights.save`,
and the weights of a checkpoint): data-parallel replicas hold the same weights after a step,
so replica 0 of the home layout writes for all (``save_hf`` is a collective over its ranks;
rank 0 writes the files) — :meth:`RoleWeights.writes_weights`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec, Model
from realhf.api.core.rollout_config import WeightSync
from realhf.api.core.worker_api import ModelWorkerConfig
from realhf.base import constants, logging, name_resolve, names, seeding
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.backend.offload import Offloader, free_storage, regrow_storage
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion.flat_file import whole_model, write_flat
from realhf.impl.model.nn.lora import add_lora
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.parallelism import ParallelGrid, load_model
from realhf.impl.model.parallelism.model import GridHooks
from realhf.impl.model.parallelism.realloc import plan_reallocation
from realhf.impl.model.parallelism.realloc_exec import compile_plan
from realhf.system.dag.messages import ReallocReply, ReallocRequest
from realhf.system.dag.worker_setup import Layouts

__all__ = ["RoleWeights"]

logger = logging.getLogger("worker_weights")


@dataclasses.dataclass
class _Replica:
    """A role's part on an MFC layout other than its home (filled by reallocation).

    ``version`` is the trained version it holds (-1: never filled); ``model`` the handle
    interfaces get (built by ``initialize``)."""

    module: Any
    grid: ParallelGrid
    model: Optional[Model] = None
    version: int = -1


class RoleWeights:
    """This rank's parts of every role (see the module docstring).

    Args:
        config: the worker's config (its ``models``, ``mfcs``, ``seed``, ``timeout``,
            ``tokenizer_path``).
        layouts: the worker's grids.
        device: where the parts live.
        tokenizer: given to the model handles.
        experiment_name, trial_name: name the published version keys.
        worker_name, worker_type: name this worker in errors / derive the load seed.
    """

    def __init__(
        self,
        config: ModelWorkerConfig,
        layouts: Layouts,
        device: torch.device,
        tokenizer,
        experiment_name: str,
        trial_name: str,
        worker_name: str,
        worker_type: str,
    ):
        from realhf.impl.model.conversion.hf import config_from_hf_dir

        self.config, self.layouts, self.device, self.tokenizer = config, layouts, device, tokenizer
        self.experiment_name, self.trial_name = experiment_name, trial_name
        self.worker_name = worker_name
        self.specs = {m.role: m for m in config.models}
        self.configs = {
            m.role: config_from_hf_dir(m.path, is_critic=m.is_critic) for m in config.models
        }
        self.modules: Dict[str, Any] = {}  # role -> its home part, on the home's ranks
        for spec in config.models:
            if layouts.home(spec.role) is None or spec.adapters_of is not None:
                continue  # (a role on another's base loads nothing: see `initialize`)
            # Weights drawn at load time (the fresh value head of a critic started from a
            # causal LM) must be the same on every rank: replicas and tensor/pipeline peers
            # hold one model.  Every rank draws what rank 0 draws, per role (not every
            # rank loads every role).
            torch.manual_seed(seeding.derive_seed(config.seed, f"{worker_type}/0/{spec.role}"))
            self.modules[spec.role] = self._load_part(spec.role, spec.path)
        self.replicas: Dict[Tuple[str, str], _Replica] = {}
        for mfc in config.mfcs:
            grid = layouts.of_mfc(mfc)
            key = (mfc.role, str(grid.layout) if grid else "")
            if grid is None or not layouts.on_replica(mfc) or key in self.replicas:
                continue
            self.replicas[key] = _Replica(self._empty_part(mfc.role, grid), grid)
        self.offloaders = {
            role: Offloader(module.flat_params)
            for role, module in self.modules.items()
            if self.specs[role].offload
        }
        self.models: Dict[str, Model] = {}  # built by `initialize` (home parts)
        self.engines: Dict[str, Any] = {}
        self.initialized = False
        self.realloc_plans: Dict[Tuple[str, str, str], Any] = {}
        self.versions: Dict[str, int] = {}  # role -> last published version
        self.senders: Dict[str, WeightSender] = {}  # role -> its sender (weight_sync=broadcast)

    # ---- loading ------------------------------------------------------------

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
        module = load_model(
            path,
            self.layouts.home(role),
            dtype=getattr(torch, spec.dtype),
            device=self.device,
            is_critic=spec.is_critic,
            gradient_checkpointing=spec.gradient_checkpointing,
            critic_lm_logits=spec.critic_lm_logits,
        )
        if spec.has_lora:  # fresh adapters (drawn alike on every rank: seeded above)
            add_lora(module, spec.lora)
        return module

    def reload(self, role: str, path: str) -> None:
        """Replace ``role``'s trained weights in place (parameters and optimizer stay
        bound): from an HF directory, or with LoRA from an adapter directory."""
        if self.specs[role].has_lora:
            self.modules[role].load_trained(path)
            return
        self.modules[role].load_flat(self._load_part(role, path).flat_params.detach())

    # ---- engines and model handles ------------------------------------------

    def initialize(self, ft_spec: FinetuneSpec) -> None:
        """Wrap every home part in its engine and every replica in an inference engine,
        then offload the offloaded roles (brought back around each call).  Once only."""
        if self.initialized:
            raise RuntimeError(
                f"{self.worker_name} is already initialized; `initialize` comes once"
            )
        self.initialized = True
        for role, module in self.modules.items():
            spec = self.specs[role]
            grid = self.layouts.home(role)
            if spec.trainable:
                engine = TrainEngine(
                    module,
                    spec.optimizer_config,
                    ft_spec,
                    grid=grid,
                    gradient_checkpointing=spec.gradient_checkpointing,
                )
            else:
                engine = InferenceEngine(module, grid=grid)
            self.engines[role] = engine
            self.models[role] = self._handle(role, engine, ft_spec if spec.trainable else None)
        for spec in self.specs.values():
            if spec.adapters_of is not None and spec.adapters_of in self.modules:
                # The LoRA role's own module with its adapters off: no second copy.
                host, grid = self.modules[spec.adapters_of], self.layouts.home(spec.role)
                engine = InferenceEngine(host, grid=grid, adapters=False)
                self.engines[spec.role] = engine
                self.models[spec.role] = self._handle(spec.role, engine, None)
        for (role, _), rep in self.replicas.items():
            rep.model = self._handle(role, InferenceEngine(rep.module, grid=rep.grid), None)
        for off in self.offloaders.values():
            off.offload()  # brought back around each call

    def _handle(self, role: str, engine, ft_spec) -> Model:
        return Model(
            name=role, module=engine, tokenizer=self.tokenizer, device=self.device, ft_spec=ft_spec
        )

    def trainable(self) -> Dict[str, tuple]:
        """Trainable roles whose home part this rank holds: ``{role: (module, engine)}``."""
        return {r: (m, self.engines[r]) for r, m in self.modules.items() if self.specs[r].trainable}

    def model_for(self, mfc: MFCDef) -> Model:
        """The model handle ``mfc`` runs on here: its role's replica on the MFC's layout, or
        the home part."""
        if not self.initialized:
            raise RuntimeError(
                f"{self.worker_name}: model {mfc.role!r} is not initialized; "
                "the master sends `initialize` first"
            )
        if self.layouts.on_replica(mfc):
            rep = self.replicas[(mfc.role, str(self.layouts.of_mfc(mfc).layout))]
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

    @contextlib.contextmanager
    def onloaded(self, role: str):
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

    def idle_gradients(self, role: str):
        """For work on ``role``'s weights that does not train them (its generation and
        inference calls, writing them): its train engine's gradient buffer gives its memory
        back for the duration (``TrainEngine.gradients_released``)."""
        engine = self.engines.get(role)
        if isinstance(engine, TrainEngine):
            return engine.gradients_released()
        return contextlib.nullcontext()

    # ---- reallocation -------------------------------------------------------

    def release_replica(self, mfc: MFCDef) -> None:
        """After a call of ``mfc``: free its replica's memory unless the placements keep
        replicas (the next reallocation refills it)."""
        if self.layouts.on_replica(mfc) and not self.layouts.places.keep_replicas:
            rep = self.replicas[(mfc.role, str(self.layouts.of_mfc(mfc).layout))]
            free_storage(rep.module.flat_params)
            rep.version = -1

    def reallocate(self, req: ReallocRequest) -> ReallocReply:
        """Copy ``req.role``'s trained weights from its home layout into its replica on
        ``req.dst`` (every rank of either layout calls this; plans are cached per pair)."""
        start = time.time()
        key = (req.role, str(req.src), str(req.dst))
        if key not in self.realloc_plans:
            # Layouts span the first d·p·m workers, so grid ranks are world ranks.
            plan = plan_reallocation(self.configs[req.role], req.src, req.dst)
            self.realloc_plans[key] = compile_plan(plan, self.layouts.rank)
        src = self.modules.get(req.role) if self.layouts.of(req.src) is not None else None
        rep = self.replicas.get((req.role, str(req.dst)))
        if rep is not None:
            regrow_storage(rep.module.flat_params)
        with torch.no_grad(), self.onloaded(req.role):
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

    # ---- writing weights ----------------------------------------------------

    def writes_weights(self, role: str) -> bool:
        """Whether this rank is in replica 0 of ``role``'s home layout, which writes the
        role's weights for all replicas (see the module docstring)."""
        grid = self.layouts.home(role)
        return grid is not None and grid.dp_rank == 0

    def publish(self, role: str, version: int) -> None:
        """Write ``role``'s weights as ``version`` for the generation servers (a HF
        directory; with ``weight_sync=shm`` a flat file in shared memory; with ``broadcast``
        a copy the role's weight sender serves) and name it under ``names.model_version``."""
        # The weights are moved into place complete, then the version key names them, so a
        # generation server that sees the key never loads half a version.
        if self.writes_weights(role):
            t0, module = time.monotonic(), self.modules[role]
            if self.specs[role].weight_sync == WeightSync.SHM:
                self._publish_flat(role, version)
            elif self.specs[role].weight_sync == WeightSync.BROADCAST:
                self._publish_broadcast(role, version)
            else:
                self._publish_hf(role, version)
            flat = module.trained_flat
            logger.info(
                f"published {role} version {version}: {flat.numel() * flat.element_size()} "
                f"bytes{' (its LoRA adapters)' if module.lora is not None else ''}"
                f"{' of this rank' if module.tp.distributed else ''} in "
                f"{time.monotonic() - t0:.3f}s (weight_sync={self.specs[role].weight_sync})"
            )
            if self.layouts.rank == 0:
                name_resolve.add(
                    names.model_version(self.experiment_name, self.trial_name, role),
                    str(version),
                    replace=True,
                )
        self.versions[role] = version

    # With LoRA every mode publishes the adapters alone: the servers hold the base already
    # (GenerationServerConfig.lora), and it never changes.

    def _publish_hf(self, role: str, version: int) -> None:
        final = constants.weight_publication_dir(role, version)
        tmp = final + ".tmp"
        if self.layouts.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        # (a collective on sharded layouts; a LoRA version is its adapters, no tokenizer)
        spec = self.specs[role]
        with self.idle_gradients(role):
            self.modules[role].save_trained(
                tmp,
                base_model_path=os.path.abspath(spec.path),
                tokenizer=None if spec.has_lora else self.config.tokenizer_path or None,
            )
        if self.layouts.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)

    def _publish_flat(self, role: str, version: int) -> None:
        # The servers hold single-device models: a sharded home layout gathers the whole
        # model onto its rank 0, which writes (a collective over the replica, as save_hf).
        full = whole_model(self.modules[role])
        if full is not None:  # what trains: the whole model, or its LoRA adapters
            write_flat(
                full.trained_flat,
                full.trained_spec,
                constants.weight_shm_path(role, version),
                version,
            )

    def _publish_broadcast(self, role: str, version: int) -> None:
        # Gathered as for _publish_flat; the sender lives on the rank that holds the whole
        # model, and its address is named before the first version is.
        full = whole_model(self.modules[role])
        if full is None:
            return
        sender = self.senders.get(role)
        if sender is None:
            sender = self.senders[role] = WeightSender(timeout=min(self.config.timeout, 120.0))
            name_resolve.add(
                names.weight_sender(self.experiment_name, self.trial_name, role),
                sender.address,
                replace=True,
            )
        sender.stage(full.trained_flat, full.trained_spec, version)

    def close(self) -> None:
        """Stop the weight senders (servers can pull nothing more from this worker)."""
        for sender in self.senders.values():
            sender.close()
        self.senders.clear()

    def publish_all(self, version: int) -> None:
        """Publish every role with ``publish_weights`` as ``version``."""
        for role, spec in self.specs.items():
            if spec.publish_weights:
                self.publish(role, version)

    def save(self, dirs: Dict[str, str]) -> List[str]:
        """Write each role of ``dirs`` as an HF directory; returns those written (rank 0)."""
        unknown = sorted(set(dirs) - set(self.specs))
        if unknown:
            raise KeyError(f"{self.worker_name}: cannot save unknown roles {unknown}")
        written = []
        for role, path in dirs.items():
            if self.writes_weights(role):
                self._save_role(role, path)
                if self.layouts.rank == 0:
                    written.append(path)
        return written

    def _save_role(self, role: str, path: str) -> None:
        """An HF directory; with LoRA the adapters in PEFT's format (on the role's base
        path), and the merged model under ``path/merged`` if ``lora.save_merged``."""
        spec, module = self.specs[role], self.modules[role]
        tokenizer = self.config.tokenizer_path or None
        with self.idle_gradients(role):
            module.save_trained(
                path, base_model_path=os.path.abspath(spec.path), tokenizer=tokenizer
            )
            if spec.has_lora and spec.lora.save_merged:
                module.save_hf(os.path.join(path, "merged"), tokenizer=tokenizer)
