"""A model's whole flat parameter buffer as one file: weight sync through shared memory.

With ``weight_sync=shm`` the trainer writes each new version once into a file under
``/dev/shm`` (memory, not a disk) and every generation server on the host maps that file and
serves from the mapping.  No HuggingFace names, no per-tensor conversion, no read through the
kernel, no copy on the servers' side: they share the file's pages.

Format: a safetensors file (8-byte little-endian header length, a JSON header, the data) with
one tensor, ``flat``: the flat buffer of a *single-device* ReaLModel of the model's config
(:mod:`realhf.impl.model.nn.flat_param`; a trainer on a sharded layout gathers it first, as
``save_hf`` does).  Its metadata names the format, the weight version and the layout (every
parameter's name, offset and shape).  Any safetensors reader opens it.  The data starts on a
page boundary, so a mapping of it is aligned for every dtype.

Memory is the cost that matters here, in two ways:

- a new file's pages must be allocated and zeroed by the kernel, which takes longer than
  copying the weights into them.  So a version nobody serves any more is not deleted but
  *retired* (:func:`retire`: renamed to ``spare.flat`` in its directory), and the next write
  takes the spare and overwrites it in place.  A directory holds at most one spare, so in a
  steady run two or three files take turns;
- every 4 KiB page of a mapping costs a page-table entry, made at its first touch: for a 1 GB
  file that is ~250k faults, as long as the copy of the weights itself.  So a process keeps
  the mappings it made of the files that take turns (the writer its shared read-write ones,
  a server its read-only ones), reuses one when it meets the same file again (same device,
  inode and size), and drops those of files that left the directory.  A steady run's writes
  then run at memcpy speed and a server's load costs no faults at all.

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
import threading
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from realhf.impl.model.conversion.checkpoint import _SAFE_DTYPES, read_safetensors_header
from realhf.impl.model.conversion.rules import WeightRule
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
    "map_version",
    "flat_dtype",
    "hf_recipe",
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


#: madvise(MADV_POPULATE_WRITE) (Linux 5.14+): a mapping's page-table entries in one call
_MADV_POPULATE_WRITE = 23


class _Maps:
    """The mappings this process keeps of flat files (see the module's note on memory),
    keyed by the file's device, inode and size, so that a file met again is not mapped and
    faulted in again.  ``writable``: the writer's shared read-write mappings, made resident
    when made; otherwise read-only ones, which a stray write cannot change (it faults)."""

    def __init__(self, writable: bool):
        self.writable = writable
        self._maps: Dict[Tuple[int, int, int], Tuple[mmap.mmap, str]] = {}
        self._lock = threading.Lock()

    def get(self, path: str, fd: int, keep: bool = True) -> mmap.mmap:
        """The mapping of ``path``, open as ``fd``: the one kept, or a new one (kept for
        the next time unless ``keep`` is False: then it lives as long as its users)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        if not keep:
            return mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=prot)
        with self._lock:
            if key in self._maps:
                self._trim()  # (files deleted since: their memory goes)
                return self._maps[key][0]
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=prot)
            if self.writable:
                try:  # one call instead of a fault per page at the first copy
                    mm.madvise(_MADV_POPULATE_WRITE)
                except OSError:  # an older kernel: the copy faults them in
                    pass
            self._maps[key] = (mm, os.path.dirname(os.path.abspath(path)))
            self._trim()
            return mm

    def _trim(self) -> None:
        # Forget the mappings of files no longer in their directory (a tensor still using
        # one keeps it mapped until the tensor goes): a file deleted, or replaced as the
        # spare, frees its memory once nothing maps it.
        live = set()
        for directory in {d for _, d in self._maps.values()}:
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                live.add((st.st_dev, st.st_ino, st.st_size))
        for key in [k for k in self._maps if k not in live]:
            del self._maps[key]

    def trim(self) -> None:
        with self._lock:
            self._trim()


_WRITER_MAPS = _Maps(writable=True)
_READER_MAPS = _Maps(writable=False)


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
    size = 8 + len(text) + nbytes
    try:
        # Claiming the spare is one rename: the manager may be retiring another version
        # at the same moment, which then becomes the next spare.
        os.rename(os.path.join(directory, SPARE), tmp)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)  # a spare of another size: fit it
            mm = _WRITER_MAPS.get(tmp, fd)
        finally:
            os.close(fd)
        mm[:8] = len(text).to_bytes(8, "little")
        mm[8 : 8 + len(text)] = text
        if nbytes:
            data = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=8 + len(text))
            data.copy_(flat.view(torch.uint8))
            del data
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _WRITER_MAPS.trim()
    return size


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

    The tensor reads the file's pages in place, shared with every other process mapping
    them.  It is read-only: a write to it faults (a model that must change its weights
    copies them first).  The mapping is kept for the next version written into the same
    file (see the module's note), so its pages are faulted in once per file, not per load."""
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
    src, got = _mapped(path, param_spec, version, flat.numel(), keep=False)
    with torch.no_grad():
        flat.copy_(src)
    return got


def _versioned_header(path: str, version: Optional[int]) -> dict:
    header = read_header(path)
    got = int(header["__metadata__"]["version"])
    if version is not None and got != version:
        raise FlatFileError(f"{path} holds weight version {got}, not the {version} asked for")
    return header


def hf_recipe(path: str, version: int, rules: Sequence[WeightRule]) -> List[dict]:
    """How a process without realhf builds the HuggingFace tensors of the flat file
    ``path`` (which must hold ``version``) from views of it: one
    :meth:`~realhf.impl.model.conversion.rules.WeightRule.hf_recipe` per rule of the
    model's family (``rules``).  The file's layout must hold every parameter the rules
    read, and nothing else.  Raises :class:`FlatFileError`."""
    header = _versioned_header(path, version)
    layout = {n: (off, shape) for n, off, shape in json.loads(header["__metadata__"]["layout"])}
    wanted = {n for r in rules for n in r.ours}
    if wanted != set(layout):
        missing, extra = sorted(wanted - set(layout)), sorted(set(layout) - wanted)
        raise FlatFileError(
            f"{path}: its layout is not the served model's (missing {missing[:3]}, "
            f"unexpected {extra[:3]}); the trainer and the server must load the same "
            "architecture"
        )
    return [r.hf_recipe(layout) for r in rules]


def flat_dtype(path: str) -> torch.dtype:
    """The dtype of the flat file ``path``'s weights (from its header)."""
    name = read_header(path)["flat"]["dtype"]
    if name not in _SAFE_DTYPES:
        raise FlatFileError(f"{path}: weights of dtype {name}, which no model here holds")
    return _SAFE_DTYPES[name]


def _mapped(path, param_spec, version, numel, keep=True) -> Tuple[torch.Tensor, int]:
    """:func:`map_flat`'s tensor and the file's version; ``keep``: the mapping is kept for
    the file's next version (a server serving from it), else it goes with the tensor."""
    header = _versioned_header(path, version)
    meta, info = header["__metadata__"], header["flat"]
    got = int(meta["version"])
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
    return _data(path, header, dtype, n, keep), got


def _data(path: str, header: dict, dtype: torch.dtype, n: int, keep: bool) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = _READER_MAPS.get(path, fd, keep)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # Read-only on purpose: a server that wrote into its weights would fault here
        # rather than change (or silently detach from) the file every server reads.
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(mm, dtype=dtype, count=n, offset=header["data_start"])


def map_version(path: str, version: int) -> torch.Tensor:
    """The flat file ``path``, which must hold ``version``, as :func:`map_flat` maps it
    (read-only, the mapping kept for the file's next version), for a reader with no model
    to check the layout against: it reads the buffer by the file's own layout (e.g.
    :func:`hf_recipe`'s).  Raises :class:`FlatFileError`."""
    header = _versioned_header(path, version)
    info = header["flat"]
    dtype = _SAFE_DTYPES.get(info["dtype"])
    if dtype is None or len(info["shape"]) != 1:
        raise FlatFileError(f"{path}: holds {info['shape']} of {info['dtype']}, not weights")
    return _data(path, header, dtype, info["shape"][0], keep=True)
