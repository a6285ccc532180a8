"""Setting up a model worker: its process, device, world, the grid of every layout, its data.

:class:`~realhf.system.dag.model_worker.ModelWorker` runs these once, on ``configure``, in
this order:

1. :func:`prepare_process`: import the implementations the config names (they register
   themselves), set torch threads and the worker's seed;
2. :func:`pick_device`: CPU, or one CUDA device per rank (rank = worker index);
3. :func:`check_layout`: the trainer layout must span exactly the launched model workers
   (checked before joining, so a wrong config fails without waiting on peers);
4. :func:`join_world`: the torch.distributed world of all model workers
   (:mod:`realhf.system.transport.process_group`: gloo on CPU, nccl with a gloo side group
   for data when CUDA is present; every wait bounded by ``config.timeout``);
5. :meth:`Layouts.build`: the :class:`~realhf.impl.model.parallelism.ParallelGrid` of every
   layout.  ``new_group`` is collective, so every worker builds all grids, in one order,
   right after joining;
6. :func:`load_tokenizer`; the weights (:mod:`realhf.system.dag.worker_weights`); then
   :func:`open_training_data` and :func:`open_eval_data`.

The head (pipe 0, tensor 0) of replica ``k`` of the data layout loads training shard ``k``
(or consumes the rollout stream as data-parallel rank ``k``) and alone answers ``fetch``;
every rank of the evaluated role's home replica ``k`` loads eval shard ``k``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Dict, Optional, Tuple

import torch

from realhf.api.core import registry
from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.dfg import MFCDef
from realhf.api.core.worker_api import ModelWorkerConfig, Placements
from realhf.base import constants, seeding
from realhf.impl.dataset.shard_loader import ShardLoader
from realhf.impl.model.parallelism import ParallelGrid
from realhf.system.rollout.trajectory_stream import TrajectoryStreamLoader
from realhf.system.transport.process_group import init_world

__all__ = [
    "DIST_GROUP_NAME",
    "Layouts",
    "prepare_process",
    "pick_device",
    "check_layout",
    "join_world",
    "load_tokenizer",
    "open_training_data",
    "open_eval_data",
]

#: the name under ``names.distributed_master`` of the model workers' process group
DIST_GROUP_NAME = "model_worker"

# Default interface/dataset implementations register themselves on import.
_DEFAULT_IMPORTS = ("realhf.impl.dataset", "realhf.impl.model.interface")


def prepare_process(config: ModelWorkerConfig, worker_name: str) -> None:
    """Register the implementations the config names, set torch threads and the seed."""
    for module in _DEFAULT_IMPORTS + tuple(config.imports):
        importlib.import_module(module)
    if config.torch_num_threads is not None:
        torch.set_num_threads(config.torch_num_threads)
    seeding.set_random_seed(config.seed, worker_name)


def pick_device(rank: int) -> torch.device:
    """This rank's device."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # One visible device per worker under the launchers (Scheduling.gpu=1); when a
    # worker sees several, ranks spread over them.
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    constants.apply_cuda_memory_fraction(device)  # a GPU shared with generation servers
    return device


def check_layout(config: ModelWorkerConfig, world_size: int, worker_name: str) -> ParallelismConfig:
    """The trainer layout, which must span exactly the launched model workers."""
    layout = config.layout or ParallelismConfig(data=world_size)
    if layout.world_size != world_size:
        raise ValueError(
            f"{worker_name}: ModelWorkerConfig.layout={layout} spans d·p·m = "
            f"{layout.world_size} model workers but the experiment launched "
            f"{world_size}; launch one model worker per rank of the layout"
        )
    return layout


def join_world(
    experiment_name: str,
    trial_name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: float,
    status_ttl: float,
):
    """Join the model workers' torch.distributed world; return its group for data."""
    world = init_world(
        experiment_name,
        trial_name,
        DIST_GROUP_NAME,
        rank,
        world_size,
        device,
        timeout,
        # Worker 0's address vanishes when it dies, like its status key (same TTL, at
        # least 5 s), so a restarted run never connects to a dead store.
        address_ttl=max(5.0, status_ttl),
    )
    return world.data_group


@dataclasses.dataclass(frozen=True)
class Layouts:
    """The grid of every layout on one rank, and where each MFC runs and each role lives.

    A layout of ``n`` ranks spans workers ``0..n-1`` (so grid ranks are world ranks); a
    worker outside it has None for its grid.

    Attributes:
        rank: this worker's rank.
        base: the trainer layout ``d × p × m``; its grid shards the data.
        places: the per-MFC layouts (:class:`~realhf.api.core.worker_api.Placements`).
        grids: ``{str(layout): grid or None}`` for every layout of ``places``.
        data_grid: the data shards' grid: the base's, or one shard on worker 0.
    """

    rank: int
    base: ParallelismConfig
    places: Placements
    grids: Dict[str, Optional[ParallelGrid]]
    data_grid: Optional[ParallelGrid]

    @classmethod
    def build(cls, config: ModelWorkerConfig, base: ParallelismConfig, rank: int) -> Layouts:
        """Every layout's grid (collective: see the module docstring)."""
        places = config.placements
        grids = {str(x): ParallelGrid.create(x, range(x.world_size)) for x in places.layouts(base)}
        # The data shards' layout: the base, or one shard on worker 0 (a grid without groups).
        data = places.data_layout(base)
        grid = grids[str(base)]
        data_grid = grid if data == base else ParallelGrid.create(data, (0,))
        return cls(rank, base, places, grids, data_grid)

    def of(self, layout: ParallelismConfig) -> Optional[ParallelGrid]:
        return self.grids[str(layout)]

    def of_mfc(self, mfc: MFCDef) -> Optional[ParallelGrid]:
        return self.grids[str(self.places.of_mfc(mfc.name, self.base))]

    def home_layout(self, role: str) -> ParallelismConfig:
        """Where ``role`` lives (and trains)."""
        return self.places.home(role, self.base)

    def home(self, role: str) -> Optional[ParallelGrid]:
        return self.grids[str(self.home_layout(role))]

    def on_replica(self, mfc: MFCDef) -> bool:
        """Whether ``mfc`` runs on a replica of its role, away from the role's home."""
        return self.places.on_replica(mfc, self.base)

    @property
    def is_replica_head(self) -> bool:
        """Whether this rank is its replica's (pipe 0, tensor 0) rank: it loads the
        replica's training data and answers ``fetch``."""
        return self.data_grid is not None and self.rank == self.data_grid.dp_head(
            self.data_grid.dp_rank
        )


def load_tokenizer(path: Optional[str]):
    """The HF tokenizer of ``path`` (None without one)."""
    if not path:
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def open_training_data(
    config: ModelWorkerConfig,
    layouts: Layouts,
    tokenizer,
    experiment_name: str,
    trial_name: str,
    worker_name: str,
    logger,
) -> Optional[ShardLoader | TrajectoryStreamLoader]:
    """The training data: the replica's shard or the rollout stream on replica heads, None
    elsewhere (the master sends such a rank its replica's items through transfer plans)."""
    if not layouts.is_replica_head:
        return None
    if config.stream is not None:
        return TrajectoryStreamLoader(
            config.stream,
            experiment_name,
            trial_name,
            layouts.data_grid.dp_rank,  # the replica head consumes the stream as this dp rank
            worker_name,
            log_path=os.path.join(constants.run_dir(), "trajectories.jsonl"),
        )
    return _make_loader(
        config.dataset, "dataset", layouts.data_grid, config.seed, tokenizer, worker_name, logger
    )


def open_eval_data(
    config: ModelWorkerConfig, layouts: Layouts, tokenizer, worker_name: str, logger
) -> Tuple[Optional[ParallelGrid], Optional[ShardLoader]]:
    """The eval grid and shard: evaluation runs where the evaluated role lives, every rank
    of a replica loading the replica's shard.  (None, None) on other ranks."""
    grid = None if config.evaluation is None else layouts.home(config.evaluation.role)
    if grid is None:
        return None, None
    loader = _make_loader(
        config.eval_dataset, "eval_dataset", grid, config.seed, tokenizer, worker_name, logger
    )
    return grid, loader


def _make_loader(
    abstraction, what: str, grid: ParallelGrid, seed: int, tokenizer, worker_name: str, logger
) -> Optional[ShardLoader]:
    if abstraction is None:
        return None
    dp_rank, dp_size = grid.dp_rank, grid.dp_size
    dataset = registry.make_dataset(
        abstraction,
        seed=seed,
        dp_rank=dp_rank,
        world_size=dp_size,
        tokenizer=tokenizer,
    )
    loader = ShardLoader(dataset, seed, f"{worker_name} {what}")
    logger.info(f"{what} {abstraction.type_!r}: {len(loader)} items in shard {dp_rank}/{dp_size}")
    return loader
