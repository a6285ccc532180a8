"""Small helpers the interfaces share: reaching the engine and network behind a `Model`,
stable seeds, per-sequence views of grouped samples, and collective-safe checks."""

from __future__ import annotations

import hashlib
from typing import Dict, List

import torch
import torch.distributed as dist

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import Model
from realhf.base import stats_tracker
from realhf.base.distributed import dist_util

__all__ = [
    "engine_of",
    "network_of",
    "dp_group_of",
    "stable_seed",
    "require_keys",
    "all_reduce_min",
    "all_reduce_sum",
    "sequence_ids",
    "seqs_per_item",
]


def engine_of(model: Model, *, train: bool = False):
    """The backend engine in ``model.module`` (a TrainEngine when ``train``)."""
    module = model.module
    need = "train_batch" if train else "forward"
    if not hasattr(module, need):
        kind = "a TrainEngine" if train else "an InferenceEngine or TrainEngine"
        raise TypeError(
            f"model {model.name}: module is {type(module).__name__}; the interface needs {kind} "
            "(realhf.impl.model.backend) wrapping the ReaLModel"
        )
    return module


def network_of(model: Model) -> torch.nn.Module:
    """The ReaLModel behind ``model.module`` (an engine or the bare network)."""
    module = model.module
    return getattr(module, "model", module)


def dp_group_of(model: Model):
    """The engine's data-parallel group (None: a single process)."""
    return getattr(model.module, "dp_group", None)


def stable_seed(*parts) -> int:
    """A 63-bit seed from strings/ints, the same in every process and Python run."""
    # blake2b, not hash(): Python salts str hashes per process (PYTHONHASHSEED), and
    # every rank must derive the same seed. 63 bits: seeds must fit a signed int64.
    h = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def require_keys(data: SequenceSample, keys, who: str) -> None:
    """Fail with the missing keys and the keys present."""
    missing = sorted(set(keys) - data.keys)
    if missing:
        raise KeyError(
            f"{who} needs keys {missing}, which the input lacks (it has {sorted(data.keys)}); add "
            "them to the MFC's input_keys or remap them with input_key_remap"
        )
    if data.data is None or any(data.data.get(k) is None for k in keys):
        raise ValueError(f"{who} needs the data of keys {sorted(keys)}, got a metadata-only sample")


def export_stats(group) -> Dict[str, float]:
    """The stats tracker's records reduced over the data-parallel ``group`` (None: this
    rank's own, as for one replica: its tensor/pipeline peers recorded the same values,
    which a reduction over the world would count p·m times)."""
    return stats_tracker.export(reduce_group=group, reduce=group is not None)


def all_reduce_min(value: int, group) -> int:
    """The minimum of ``value`` over ``group`` (the value itself without torch.distributed)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    return int(dist_util.all_reduce_(t, dist.ReduceOp.MIN, group).item())


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place (no-op without torch.distributed); CPU tensors are
    moved to the GPU and back for nccl."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return t
    return dist_util.all_reduce_(t, group=group)


def sequence_ids(data: SequenceSample, key: str = "packed_input_ids") -> List[str]:
    """``"{item id}@{j}"`` for sequence j of each item."""
    return [f"{i}@{j}" for i, lens in zip(data.ids, data.seqlens[key]) for j in range(len(lens))]


def seqs_per_item(data: SequenceSample, key: str = "packed_input_ids") -> List[int]:
    """How many sequences each item holds."""
    return [len(lens) for lens in data.seqlens[key]]
