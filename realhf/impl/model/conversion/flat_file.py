"""A model's whole flat parameter buffer as one file: weight sync through shared memory.

With ``weight_sync=shm`` the trainer writes each new version once into a file under
``/dev/shm`` (memory, not a disk) and every generation server on the host maps that file and
copies it into its own buffer in one pass.  No HuggingFace names, no per-tensor conversion, no
read through the kernel: the server's copy reads the trainer's pages in place.

Format: a safetensors file (8-byte little-endian header length, a JSON header, the data) with
one tensor, ``flat``: the flat buffer of a *single-device* ReaLModel of the model's config
(:mod:`realhf.impl.model.nn.flat_param`; a trainer on a sharded layout gathers it first, as
``save_hf`` does).  Its metadata names the format, the weight version and the layout (every
parameter's name, offset and shape).  Any safetensors reader opens it.  The data starts on a
page boundary, so a mapping of it is aligned for every dtype.

Memory is the cost that matters here: a new file's pages must be allocated and zeroed by the
kernel, which takes longer than copying the weights into them.  So a version nobody serves
any more is not deleted but *retired* (:func:`retire`: renamed to ``spare.flat`` in its
directory), and the next write takes the spare and overwrites it in place.  A directory
holds at most one spare.

Guarantees a server relies on:

- a file is written under a temporary name and renamed complete, so a reader never maps a
  half-written one;
- :func:`load_flat` checks the version it was asked for against the file's, and the file's
  layout against the model's (both in the header), before it copies anything; a mismatch is
  an error naming both, and the model keeps its weights.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Dict, List, Optional, Tuple

import torch

from realhf.impl.model.conversion.checkpoint import _SAFE_DTYPES, read_safetensors_header
from realhf.impl.model.nn.flat_param import ParamSpec

__all__ = [
    "FORMAT",
    "SPARE",
    "FlatFileError",
    "whole_model",
    "write_model",
    "write_flat",
    "load_flat",
    "map_flat",
    "read_header",
    "retire",
]

FORMAT = "realhf-flat-v1"
_ALIGN = 4096  # the data starts on a page boundary
#: the retired file of a directory, which the next write overwrites in place
SPARE = "spare.flat"
_DTYPE_NAMES = {v: k for k, v in _SAFE_DTYPES.items()}


class FlatFileError(ValueError):
    """A flat weight file that cannot be loaded into a model (names the file and why)."""


def _layout(param_spec: Dict[str, ParamSpec]) -> List[list]:
    return [[n, s.offset, list(s.shape)] for n, s in sorted(param_spec.items(), key=lambda x: x[1])]


def write_flat(
    flat: torch.Tensor, param_spec: Dict[str, ParamSpec], path: str, version: int
) -> int:
    """Write ``flat`` (a single-device model's buffer, laid out by ``param_spec``) as the
    file ``path`` holding weight version ``version``; returns the bytes written.

    The parent directory is made (mode 0700) if needed.  The file appears complete or not
    at all (written as ``path.tmp-<pid>``, then renamed).  A spare file in the directory
    (:func:`retire`) is taken and overwritten instead of making a new one."""
    if flat.dtype not in _DTYPE_NAMES:
        raise TypeError(f"cannot write a flat buffer of dtype {flat.dtype}")
    flat = flat.detach().reshape(-1).cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    header = {
        "__metadata__": {
            "format": FORMAT,
            "version": str(int(version)),
            "layout": json.dumps(_layout(param_spec), separators=(",", ":")),
        },
        "flat": {
            "dtype": _DTYPE_NAMES[flat.dtype],
            "shape": [flat.numel()],
            "data_offsets": [0, nbytes],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    # safetensors allows trailing spaces in the header: pad so the data is page-aligned.
    text += b" " * (-(8 + len(text)) % _ALIGN)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        # Claiming the spare is one rename: the manager may be retiring another version
        # at the same moment, which then becomes the next spare.
        os.rename(os.path.join(directory, SPARE), tmp)
        mode = "r+b"
    except FileNotFoundError:
        mode = "wb"
    try:
        with open(tmp, mode) as f:
            f.truncate(8 + len(text) + nbytes)  # a spare of another size: fit it
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            if nbytes:
                f.write(memoryview(flat.view(torch.uint8).numpy()))
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return 8 + len(text) + nbytes


def retire(path: str) -> None:
    """Retire the flat file ``path``, a version nobody is to load any more: it becomes its
    directory's spare (replacing an older spare, whose memory is then freed).  A server
    still mapping it keeps reading it; one in service never is (the manager retires a
    version only once every server it updated holds a newer one)."""
    os.replace(path, os.path.join(os.path.dirname(path), SPARE))


def whole_model(model):
    """The single-device model of ``model`` (a ReaLModel, maybe one part of a sharded
    layout): ``model`` itself on one device; on a sharded layout it is gathered onto the
    replica's first rank (a collective: every rank must call it), and None on the others."""
    return model.tp.gather_model(model) if model.tp.distributed else model


def write_model(model, path: str, version: int) -> Optional[int]:
    """Write the whole of ``model`` (a ReaLModel, maybe one part of a sharded layout) as the
    flat file ``path`` of ``version``; returns the bytes written, None on the ranks that
    write nothing.

    On a sharded layout this is a collective over the model's ranks (every rank must call
    it): the whole single-device model is gathered onto the replica's first rank, which
    writes it, as ``save_hf`` does."""
    full = whole_model(model)
    if full is None:
        return None
    return write_flat(full.flat_params, full.param_spec, path, version)


def read_header(path: str) -> dict:
    """The JSON header of the flat file ``path`` (with ``__metadata__``, and ``data_start``:
    where its data begins), checked for being one; :class:`FlatFileError` otherwise."""
    try:
        header, data_start = read_safetensors_header(path)
        size = os.path.getsize(path)
    except OSError as e:
        raise FlatFileError(f"cannot read the flat weight file {path}: {e}") from e
    except ValueError as e:  # a length that does not fit, bad JSON
        raise FlatFileError(f"{path}: not a readable safetensors header ({e})") from e
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or "flat" not in header:
        raise FlatFileError(
            f"{path} is not a flat weight file (format {meta.get('format')!r}, want {FORMAT!r})"
        )
    end = header["flat"]["data_offsets"][1]
    if data_start + end > size:
        raise FlatFileError(f"{path}: the file ends {data_start + end - size} bytes early")
    header["data_start"] = data_start
    return header


def map_flat(
    path: str,
    param_spec: Dict[str, ParamSpec],
    version: Optional[int] = None,
    numel: Optional[int] = None,
) -> torch.Tensor:
    """The flat file ``path`` as a 1-D tensor over a mapping of it (nothing is read yet;
    the mapping lives as long as the tensor), after checking it against the caller:

    ``version``: the version the caller was told the file holds; another one is refused.
    ``param_spec`` / ``numel``: the layout and size of the caller's model.

    The mapping is private: the tensor reads the file's pages in place (shared with every
    other process mapping them), and a write to it would copy a page for this process
    only, never changing the file."""
    return _mapped(path, param_spec, version, numel)[0]


def load_flat(
    flat: torch.Tensor,
    param_spec: Dict[str, ParamSpec],
    path: str,
    version: Optional[int] = None,
) -> int:
    """Copy the flat file ``path`` into ``flat`` (a single-device model's buffer laid out by
    ``param_spec``, any float dtype and device: the copy converts); returns the file's
    version, checked as :func:`map_flat` does.  The copy reads the mapped pages in place."""
    src, got = _mapped(path, param_spec, version, flat.numel())
    with torch.no_grad():
        flat.copy_(src)
    return got


def _mapped(path, param_spec, version, numel) -> Tuple[torch.Tensor, int]:
    """:func:`map_flat`'s tensor and the file's version."""
    header = read_header(path)
    meta, info = header["__metadata__"], header["flat"]
    got = int(meta["version"])
    if version is not None and got != version:
        raise FlatFileError(f"{path} holds weight version {got}, not the {version} asked for")
    theirs, ours = json.loads(meta["layout"]), _layout(param_spec)
    if theirs != ours:
        diff = next(
            (f"{a} here, {b} in the file" for a, b in zip(ours, theirs) if a != b),
            f"{len(ours)} parameters here, {len(theirs)} in the file",
        )
        raise FlatFileError(
            f"{path}: its layout is not this model's ({diff}); the trainer and the server "
            "must load the same architecture"
        )
    dtype = _SAFE_DTYPES.get(info["dtype"])
    n = numel if numel is not None else sum(s.numel for s in param_spec.values())
    if dtype is None or info["shape"] != [n]:
        raise FlatFileError(
            f"{path}: holds {info['shape']} of {info['dtype']}, the model {n} elements"
        )
    if n == 0:
        return torch.empty(0, dtype=dtype), got
    with open(path, "rb") as f:
        # torch wants a writable buffer: a private mapping is one, and the file stays as is.
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=dtype, count=n, offset=header["data_start"]), got
