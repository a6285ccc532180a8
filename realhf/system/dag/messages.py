"""Typed messages between the master worker and the model workers (request/reply stream).

A request names a :class:`Handle` (its value is the ``Payload.handle_name`` that crosses
the wire) and carries one of the request classes below as ``Payload.data``; the model
worker answers with the matching reply class.  The table of handle -> request type ->
reply type -> handler is :data:`realhf.system.dag.model_worker.PROTOCOL`.

Samples in these messages are always metadata-only (``SequenceSample.meta()``): tensors
move between model workers only (:mod:`realhf.system.dag.transfer`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Optional, Tuple

from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import ModelInterfaceType
from realhf.api.core.model_api import FinetuneSpec, StepInfo
from realhf.system.dag.transfer import TransferStep

__all__ = [
    "REQUEST_STREAM",
    "Handle",
    "MFC_HANDLES",
    "mfc_handle",
    "SpecReply",
    "InitializeRequest",
    "DataPosition",
    "FetchRequest",
    "FetchReply",
    "MFCRequest",
    "MFCReply",
    "EvalRequest",
    "EvalReply",
    "SaveRequest",
    "CheckpointRequest",
    "ReallocRequest",
    "ReallocReply",
]

#: name of the request/reply stream between the master and the model workers
REQUEST_STREAM = "master_model"


class Handle(enum.Enum):
    """What the master asks a model worker to do; the value is the name on the wire."""

    SPEC = "spec"
    INITIALIZE = "initialize"
    FETCH = "fetch"
    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"
    EVALUATE = "evaluate"
    SAVE = "save"
    CHECKPOINT = "checkpoint"
    CLEAR_DATA_CACHE = "clear_data_cache"
    MODEL_VERSION = "model_version"
    REALLOCATE = "reallocate"
    EXIT = "exit"


#: the handles that run an MFC, one per interface method
MFC_HANDLES = (Handle.GENERATE, Handle.INFERENCE, Handle.TRAIN_STEP)


def mfc_handle(interface_type: ModelInterfaceType) -> Handle:
    """The handle that runs an MFC of ``interface_type`` (same name as the method)."""
    return Handle(interface_type.value)


@dataclasses.dataclass(frozen=True)
class SpecReply:
    """What a model worker loaded: its dataset shard sizes and what it can evaluate."""

    worker: str
    dataset_size: int
    eval_dataset_size: int
    can_evaluate: bool
    roles: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class InitializeRequest:
    """Build the engines for ``ft_spec``; load ``recover_dir`` (a complete recover
    checkpoint) if set.

    ``version`` is the weight version the trainer resumes at (finished train steps): roles
    that publish weights publish it again, so generation servers can load the resumed weights.
    """

    ft_spec: FinetuneSpec
    recover_dir: Optional[str] = None
    version: int = 0


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where a worker's data loader is: epoch (from 0), items used in it, shard size."""

    epoch: int
    n_used: int
    shard_size: int

    @property
    def remaining(self) -> int:
        """Items of this epoch not fetched yet."""
        return self.shard_size - self.n_used


@dataclasses.dataclass(frozen=True)
class FetchRequest:
    """Load up to ``n`` next items of epoch ``epoch`` (the loader moves on to ``epoch`` when
    its current one is used up); sent to replica heads only."""

    epoch: int
    n: int


@dataclasses.dataclass(frozen=True)
class FetchReply:
    """The items loaded (metadata only; the tensors stay on the worker), the new position,
    and statistics of the loaded data (e.g. the staleness of streamed trajectories)."""

    meta: Optional[SequenceSample]
    position: DataPosition
    stats: Dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MFCRequest:
    """Run MFC ``mfc_name`` on this rank's partition.

    Attributes:
        mfc_name: the MFC (the worker has the MFCDef from its config).
        step: training progress (the interface sees it as ``model.version``; seeds derive from it).
        plan: the data transfers all ranks run first, in order.
        meta: metadata-only sample of this rank's partition (its data-parallel replica's:
            the same on every rank of the replica) with the MFC's input keys (buffer
            names) and the items' metadata.
        call: index of this call among the MFC's calls in the step (an MFC whose
            ``n_seqs`` is below the batch size runs several); part of the call's seed.
    """

    mfc_name: str
    step: StepInfo
    plan: Tuple[TransferStep, ...]
    meta: SequenceSample
    call: int = 0


@dataclasses.dataclass(frozen=True)
class MFCReply:
    """The result of one MFC call on one rank.

    ``output`` is the metadata of the stored output keys (None for train_step); ``stats``
    holds train statistics and anything recorded with ``stats_tracker``; times are wall
    clock (``time.time()``) so the master can draw one trace of all workers.
    """

    worker: str
    mfc_name: str
    output: Optional[SequenceSample]
    stats: Dict[str, float]
    start: float
    end: float
    transfer_seconds: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """Evaluate at training progress ``step``."""

    step: StepInfo


@dataclasses.dataclass(frozen=True)
class EvalReply:
    """Metrics averaged over the replicas' eval items (identical on every rank)."""

    worker: str
    metrics: Dict[str, float]
    n_items: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """Write each trainable role as an HF directory: ``dirs[role]`` (every rank of
    data-parallel replica 0 takes part; rank 0 writes)."""

    dirs: Dict[str, str]


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    """Write recover state (models, optimizers, data position) into ``dir``."""

    dir: str
    step: StepInfo


@dataclasses.dataclass(frozen=True)
class ReallocRequest:
    """Bring the replica of ``role`` on layout ``dst`` up to date with its home layout
    ``src`` (parameter reallocation).  Every rank of either layout takes part: the home's
    ranks send what they hold, the replica's receive.

    Attributes:
        role: the model.
        src: the role's home layout (weights and optimizer state).
        dst: the replica's layout.
        version: the trained version the replica holds afterwards (train steps dispatched
            to the role so far).
    """

    role: str
    src: ParallelismConfig
    dst: ParallelismConfig
    version: int


@dataclasses.dataclass(frozen=True)
class ReallocReply:
    """What one rank moved (bytes) and when (wall clock)."""

    worker: str
    role: str
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    start: float
    end: float
