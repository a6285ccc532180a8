"""Reading and writing the weight files of a HuggingFace directory.

Reads ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json`` (or shards without an index),
``pytorch_model.bin`` and sharded ``.bin`` with its index.  Tensors are read one
at a time on demand (safetensors) or from a memory-mapped ``.bin``, so loading
never holds a second full copy of the model.  Writes safetensors only, sharded
with an index above ``max_shard_bytes``.

Safetensors files are read with plain reads into fresh tensors, not memory-mapped
(``safe_open``): the pages of a mapped file count in the process's RSS for as long as it
is open, which after reading every tensor is the whole file -- one more copy of the model
at the peak of a generation server loading new weights beside its KV cache (measured at
the Qwen2.5-0.5B shape: +1.9 GB for an fp32 directory).  The format is an 8-byte header
length, a JSON header of ``name -> dtype, shape, [start, end)``, then the data.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import save_file

from realhf.impl.model.conversion.hf_config import CheckpointError

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
WEIGHT_FILES = (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE)
#: default shard size of a save: a shard's tensors are materialised (and serialised) at
#: once, so this bounds what a save adds to the process's memory (HF's own default of
#: 5 GB would be a whole extra copy of a 1B model at the trainer's peak)
SHARD_BYTES = 512 * 1024**2


class CheckpointReader:
    """Find which file holds each tensor of a HF directory and read tensors lazily."""

    def __init__(self, model_dir: str):
        self.model_dir = str(model_dir)
        self.key_to_file: Dict[str, str] = {}
        self.files: List[str] = []
        self._handles: Dict[str, object] = {}
        self._discover()

    def _path(self, name: str) -> str:
        return os.path.join(self.model_dir, name)

    def _discover(self) -> None:
        for index_name in (SAFE_INDEX, BIN_INDEX):
            if os.path.isfile(self._path(index_name)):
                self._read_index(index_name)
                return
        for single in (SAFE_SINGLE, BIN_SINGLE):
            if os.path.isfile(self._path(single)):
                self._add_file(single)
                return
        # Shards written without an index (seen in hand-made checkpoints).
        shards = sorted(glob.glob(self._path("*.safetensors")))
        if shards:
            for s in shards:
                self._add_file(os.path.basename(s))
            return
        if os.path.isdir(self.model_dir):
            holds = sorted(os.listdir(self.model_dir))
        else:
            holds = "nothing, it does not exist"
        raise CheckpointError(
            f"{self.model_dir}: no weight file found; expected one of {', '.join(WEIGHT_FILES)} "
            f"(directory holds: {holds})"
        )

    def _read_index(self, index_name: str) -> None:
        path = self._path(index_name)
        try:
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot read the weight index ({e})") from e
        for key, fname in weight_map.items():
            if not os.path.isfile(self._path(fname)):
                raise CheckpointError(
                    f"{path}: weight file {fname!r} listed for parameter {key!r} is missing "
                    f"from {self.model_dir}"
                )
            self.key_to_file[key] = fname
        self.files = sorted(set(weight_map.values()))

    def _add_file(self, fname: str) -> None:
        self.files.append(fname)
        for key in self._open(fname).keys():
            self.key_to_file[key] = fname

    def _open(self, fname: str):
        if fname not in self._handles:
            path = self._path(fname)
            try:
                if fname.endswith(".safetensors"):
                    self._handles[fname] = SafetensorsFile(path)
                else:
                    self._handles[fname] = _load_bin(path)
            except CheckpointError:
                raise
            except Exception as e:  # corrupt / truncated files raise many types
                raise CheckpointError(
                    f"{path}: cannot read weight file ({type(e).__name__}: {e})"
                ) from e
        return self._handles[fname]

    def describe(self) -> str:
        """The weight files, for error messages."""
        return ", ".join(self.files)

    def resolve(self, name: str, fallback_prefixes: Sequence[str] = ()) -> Optional[str]:
        """The stored key for ``name``: itself, or without one of ``fallback_prefixes``."""
        if name in self.key_to_file:
            return name
        for p in fallback_prefixes:
            if name.startswith(p) and name[len(p) :] in self.key_to_file:
                return name[len(p) :]
        return None

    def file_of(self, key: str) -> str:
        """Path of the file holding ``key``."""
        return self._path(self.key_to_file[key])

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor (CPU)."""
        h = self._open(self.key_to_file[key])
        if isinstance(h, dict):
            return h[key]
        try:
            return h.get_tensor(key)
        except Exception as e:
            raise CheckpointError(
                f"{self.file_of(key)}: cannot read parameter {key!r} ({e})"
            ) from e

    def keys(self) -> Iterable[str]:
        """All stored tensor names."""
        return self.key_to_file.keys()


#: safetensors dtype names
_SAFE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: str) -> Tuple[dict, int]:
    """The JSON header of the safetensors file ``path`` (``__metadata__`` included) and the
    offset where its data starts: the format is an 8-byte little-endian length, the JSON,
    then the data.  OSError if unreadable, ValueError if the length does not fit the file
    or the header is not JSON."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= os.path.getsize(path) - 8:
            raise ValueError(f"header length {n} does not fit the file")
        return json.loads(f.read(n)), 8 + n


class SafetensorsFile:
    """One safetensors file, each tensor read into a fresh tensor on demand (not mapped:
    see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        header, self.data_start = read_safetensors_header(path)
        header.pop("__metadata__", None)
        self.header: Dict[str, dict] = header

    def keys(self) -> Iterable[str]:
        return self.header.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self.header[key]
        if info["dtype"] not in _SAFE_DTYPES:
            raise ValueError(f"dtype {info['dtype']} is not supported")
        t = torch.empty(info["shape"], dtype=_SAFE_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        if end - start != t.numel() * t.element_size():
            raise ValueError(f"{end - start} bytes for a {info['dtype']} tensor of {info['shape']}")
        if t.numel():
            with open(self.path, "rb") as f:
                f.seek(self.data_start + start)
                got = f.readinto(t.reshape(-1).view(torch.uint8).numpy())
            if got != end - start:
                raise ValueError(f"the file ends {end - start - got} bytes early")
        return t


def _load_bin(path: str) -> Dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:
        # Files written with the legacy (non-zip) format cannot be memory-mapped.
        return torch.load(path, map_location="cpu", weights_only=True)


def remove_weight_files(model_dir: str) -> None:
    """Delete weight files of any format so a save leaves no stale shards behind."""
    patterns = ("model*.safetensors", SAFE_INDEX, "pytorch_model*.bin", BIN_INDEX)
    for pat in patterns:
        for p in glob.glob(os.path.join(model_dir, pat)):
            os.remove(p)


def write_safetensors(
    model_dir: str,
    entries: Sequence[Tuple[str, int, Callable[[], torch.Tensor]]],
    max_shard_bytes: int,
) -> List[str]:
    """Write tensors as ``model.safetensors`` or shards plus an index.

    Args:
        entries: ``(name, nbytes, make_tensor)``; tensors are materialised one
            shard at a time so memory stays bounded by the shard size.
        max_shard_bytes: shard size limit (a tensor larger than it gets its own
            shard).

    Returns:
        The file names written.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    shards: List[List[Tuple[str, Callable[[], torch.Tensor]]]] = [[]]
    size = 0
    total = 0
    for name, nbytes, make in entries:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, make))
        size += nbytes
        total += nbytes
    n = len(shards)
    names = (
        [SAFE_SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {name: make() for name, make in shard}
        save_file(tensors, os.path.join(model_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    if n > 1:
        # The index goes last: a reader that sees it can trust every shard exists.
        with open(os.path.join(model_dir, SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
