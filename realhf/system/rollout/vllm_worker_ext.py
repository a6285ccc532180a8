"""Loading our flat weight buffer into vLLM, inside vLLM's worker process: from a flat file
in shared memory (``weight_sync=shm``) or pulled from the trainer (``weight_sync=broadcast``).

vLLM usually runs from a venv of its own, which has torch but not all of realhf's
dependencies; so this module imports only torch and the standard library when vLLM loads
it, and realhf's own flat-file reader and weight receiver at their first use (their imports
are among vLLM's dependencies).  The vLLM backend (:mod:`realhf.system.rollout.vllm_backend`)
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
import math
import os
from typing import Dict, Iterator, List, Tuple

import torch

__all__ = ["RealhfWeightLoader", "assemble", "map_file"]


def map_file(path: str, version: int) -> torch.Tensor:
    """The flat file ``path`` (which must hold ``version``) as a read-only 1-D tensor over
    a mapping of it, kept for the file's next version: realhf's reader
    (:func:`realhf.impl.model.conversion.flat_file.map_version`), imported here, in vLLM's
    process, at the first load."""
    from realhf.impl.model.conversion.flat_file import map_version

    return map_version(path, version)


def assemble(flat: torch.Tensor, recipe: List[dict]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF tensors of ``recipe`` (see the module's docstring), built from ``flat``."""
    for e in recipe:
        parts = []
        for offset, shape in e["pieces"]:
            numel = math.prod(shape)
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
        flat = map_file(path, int(version))
        self.reload_weights(
            weights_iterator=assemble(flat, json.loads(recipe)), is_checkpoint_format=True
        )
        return int(version)

    def realhf_pull(
        self, sender: str, version: int, layout: str, numel: int, recipe: str, timeout: float
    ) -> dict:
        """Pull weight version ``version`` from the trainer's weight sender at ``sender``
        (``weight_sync=broadcast``, :mod:`realhf.impl.model.comm.weight_broadcast`) into a
        buffer of ``numel`` elements laid out as ``layout`` (its digest), then load it by
        ``recipe`` in place.

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
