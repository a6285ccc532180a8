"""Loading our flat weight buffer into vLLM, inside vLLM's worker process: from a flat file
in shared memory (``weight_sync=shm``) or pulled from the trainer (``weight_sync=broadcast``).

vLLM usually runs from a venv of its own, which has torch but not all of realhf's
dependencies; so this module imports only torch and the standard library, and realhf only
in :meth:`RealhfWeightLoader.realhf_pull` (the pull is realhf's own protocol; its imports are
among vLLM's dependencies).  The vLLM backend (:mod:`realhf.system.rollout.vllm_backend`)
copies this module into a private directory on vLLM's ``PYTHONPATH``, links the realhf
package beside it, and names :class:`RealhfWeightLoader` as vLLM's
``--worker-extension-cls``: vLLM mixes the class into its worker, and ``POST
/collective_rpc`` with ``{"method": "realhf_load_flat" | "realhf_pull", ...}`` calls it
there.

The flat buffer is laid out by our parameter names; vLLM loads HuggingFace tensors.  The
adapter, which knows the model family's conversion rules, sends a *recipe*: for every HF
tensor the pieces of the flat buffer it is made of and how they are put together
(transposed, concatenated, reshaped).  Each piece is a view of the buffer (the mapped file,
or the pulled copy), so a tensor costs no copy unless its recipe needs one (a concatenation
or a transposed GPT-2 matrix); vLLM then copies it into its own parameters, layer by layer,
with its in-place reload (the path of a reload from disk, without the disk).

Recipe (JSON): ``[{"name": str, "pieces": [[offset, [shape...]], ...], "transpose": bool,
"dim": int, "shape": [hf shape...]}, ...]``, offsets and shapes in elements of the flat
buffer.  The HF tensor is ``cat([piece.t() if transpose else piece ...], dim)``, reshaped
to ``shape``.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import warnings
from typing import Dict, Iterator, List, Tuple

import torch

__all__ = ["RealhfWeightLoader", "assemble", "map_file"]

#: the safetensors dtype names a flat file may hold
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# Mappings kept between loads: the files take turns (the trainer overwrites a retired one in
# place), and a mapping met again costs no page faults.  Keyed by (device, inode, size);
# those of files gone from their directory are dropped at the next mapping.
_MAPS: Dict[Tuple[int, int, int], Tuple[mmap.mmap, str]] = {}
_LOCK = threading.Lock()


def _trim() -> None:
    live = set()
    for directory in {d for _, d in _MAPS.values()}:
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
    for key in [k for k in _MAPS if k not in live]:
        del _MAPS[key]


def map_file(path: str, version: int) -> Tuple[torch.Tensor, int]:
    """The flat buffer of the file ``path`` as a read-only 1-D tensor over a mapping of it,
    and the version it holds, which must be ``version`` (else ValueError)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= st.st_size - 8:
            raise ValueError(f"{path}: not a safetensors file")
        header = json.loads(os.pread(fd, n, 8))
        got = int((header.get("__metadata__") or {}).get("version", -1))
        if got != version:
            raise ValueError(f"{path} holds weight version {got}, not the {version} asked for")
        info = header["flat"]
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        key = (st.st_dev, st.st_ino, st.st_size)
        with _LOCK:
            if key not in _MAPS:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                _MAPS[key] = (mm, os.path.dirname(os.path.abspath(path)))
            _trim()
            mm = _MAPS[key][0]
    finally:
        os.close(fd)
    count = (end - begin) // torch.empty((), dtype=dtype).element_size()
    with warnings.catch_warnings():  # read-only on purpose: nothing here writes into it
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + begin)
    return flat, got


def assemble(flat: torch.Tensor, recipe: List[dict]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF tensors of ``recipe`` (see the module's docstring), built from ``flat``."""
    for e in recipe:
        parts = []
        for offset, shape in e["pieces"]:
            numel = 1
            for s in shape:
                numel *= s
            if offset < 0 or offset + numel > flat.numel():
                raise ValueError(f"{e['name']}: a piece lies outside the flat buffer")
            p = flat[offset : offset + numel].view(shape)
            parts.append(p.t() if e["transpose"] else p)
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=e["dim"])
        yield e["name"], t.reshape(e["shape"])


# weight_sync=broadcast: the receiver (one pair per sender, kept) and the buffer a version
# lands in before vLLM loads it (one version of the weights, in the model's dtype)
_PULL: Dict[str, object] = {}


class RealhfWeightLoader:
    """Mixed into vLLM's worker (``--worker-extension-cls``): loads a flat weight file, or
    pulls a version from the trainer's weight sender."""

    def realhf_load_flat(self, path: str, version: int, recipe: str) -> int:
        """Load weight version ``version`` from the flat file ``path`` by ``recipe`` (a JSON
        string, see the module's docstring) in place; returns the version loaded."""
        flat, got = map_file(path, int(version))
        self.reload_weights(
            weights_iterator=assemble(flat, json.loads(recipe)), is_checkpoint_format=True
        )
        return got

    def realhf_pull(
        self, sender: str, version: int, layout: str, numel: int, recipe: str, timeout: float
    ) -> dict:
        """Pull weight version ``version`` from the trainer's weight sender at ``sender``
        (``weight_sync=broadcast``, :mod:`realhf.impl.model.comm.weight_broadcast`: the
        protocol is realhf's own, so this one method needs realhf importable, which
        VLLMServer arranges) into a buffer of ``numel`` elements laid out as ``layout``
        (its digest), then load it by ``recipe`` in place.

        Returns ``{"ok": True, "bytes": n}``, or ``{"ok": False, "error": why}`` with
        ``"superseded_by"`` when the trainer has moved on to a newer version.  vLLM's weights
        change only once the whole version has arrived: a transfer that breaks off leaves
        the last version served."""
        from realhf.impl.model.comm.weight_broadcast import (
            WeightReceiver,
            WeightsSuperseded,
            WeightSyncError,
        )

        dtype = self.model_config.dtype
        buf = _PULL.get("buffer")
        if buf is None or buf.numel() != int(numel) or buf.dtype != dtype:
            _PULL["buffer"] = buf = None  # (the old one goes first)
            _PULL["buffer"] = buf = torch.empty(int(numel), dtype=dtype)
        if "receiver" not in _PULL:
            _PULL["receiver"] = WeightReceiver(f"vllm@{os.getpid()}")
        try:
            n = _PULL["receiver"].receive(sender, int(version), buf, layout, float(timeout))
        except WeightsSuperseded as e:
            return {"ok": False, "error": str(e), "superseded_by": e.newer}
        except WeightSyncError as e:
            return {"ok": False, "error": str(e)}
        self.reload_weights(
            weights_iterator=assemble(buf, json.loads(recipe)), is_checkpoint_format=True
        )
        return {"ok": True, "bytes": n}
