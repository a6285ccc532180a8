"""Typed messages between the master worker and the model workers (request/reply stream).

Handle names and their payloads (``Payload.data`` -> ``Reply.data``):

====================  ==========================  ==========================================
handle                request                     reply
====================  ==========================  ==========================================
``spec``              None                        :class:`SpecReply`
``initialize``        :class:`InitializeRequest`  :class:`DataPosition`
``fetch``             :class:`FetchRequest`       :class:`FetchReply`
``generate``          :class:`MFCRequest`         :class:`MFCReply` (``output`` = meta)
``inference``         :class:`MFCRequest`         :class:`MFCReply` (``output`` = meta)
``train_step``        :class:`MFCRequest`         :class:`MFCReply` (``stats``)
``evaluate``          :class:`EvalRequest`        :class:`EvalReply`
``save``              :class:`SaveRequest`        list of directories written
``checkpoint``        :class:`CheckpointRequest`  list of files/directories written
``clear_data_cache``  tuple of ids                number of items dropped
``model_version``     None                        ``{role: version}``
``exit``              None                        None (the worker stops serving)
====================  ==========================  ==========================================

Samples in these messages are always metadata-only (``SequenceSample.meta()``): tensors
move between model workers only (:mod:`realhf.system.dag.transfer`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import FinetuneSpec, StepInfo
from realhf.system.dag.transfer import TransferStep

__all__ = [
    "REQUEST_STREAM",
    "MFC_HANDLES",
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
]

#: name of the request/reply stream between the master and the model workers
REQUEST_STREAM = "master_model"
MFC_HANDLES = ("generate", "inference", "train_step")


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
    """Build the engines for ``ft_spec``; load ``recover_dir`` (a complete recover checkpoint) if set.

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
    its current one is used up)."""

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
        meta: metadata-only sample of this rank's partition with the MFC's input keys
            (buffer names) and the items' metadata.
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
    """Metrics averaged over all ranks' eval items (identical on every rank)."""

    worker: str
    metrics: Dict[str, float]
    n_items: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """Write each trainable role as an HF directory: ``dirs[role]`` (rank 0 writes)."""

    dirs: Dict[str, str]


@dataclasses.dataclass(frozen=True)
class CheckpointRequest:
    """Write recover state (models, optimizers, data position) into ``dir``."""

    dir: str
    step: StepInfo
