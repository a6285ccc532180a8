"""How one HuggingFace tensor maps to one or more ReaLModel parameters.

A :class:`WeightRule` names the HF tensor, the ReaLModel parameters it becomes,
its expected HF shape, and the layout change between the two:

- ``copy``: same tensor;
- ``transpose``: gpt2's ``Conv1D`` stores ``[in, out]``, we store ``[out, in]``;
- ``split``: one HF tensor is several of ours, cut along dim 0 (biases);
- ``split_transpose``: cut along HF dim 1, then transpose (gpt2 ``c_attn``);
- ``flatten``: HF's ``[out, *in]`` kernel is our ``[out, prod(in)]`` matrix (a vision
  tower's patch convolution, whose stride equals its kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import torch

KINDS = ("copy", "transpose", "split", "split_transpose", "flatten")


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One HF tensor <-> ``ours`` (several only for split kinds)."""

    hf_name: str
    ours: Tuple[str, ...]
    hf_shape: Tuple[int, ...]
    kind: str = "copy"
    sizes: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"WeightRule.kind={self.kind!r}; use one of {KINDS}")
        if self.kind.startswith("split") and len(self.sizes) != len(self.ours):
            raise ValueError(f"WeightRule {self.hf_name}: sizes {self.sizes} vs ours {self.ours}")
        if not self.kind.startswith("split") and len(self.ours) != 1:
            raise ValueError(f"WeightRule {self.hf_name}: kind {self.kind} maps to one tensor")

    def to_ours(self, t: torch.Tensor) -> List[torch.Tensor]:
        """Convert the HF tensor into our parameters, in ``ours`` order."""
        if self.kind == "copy":
            return [t]
        if self.kind == "transpose":
            return [t.t()]
        if self.kind == "flatten":
            return [t.reshape(t.shape[0], -1)]
        if self.kind == "split":
            return list(torch.split(t, list(self.sizes), dim=0))
        return [p.t() for p in torch.split(t, list(self.sizes), dim=1)]

    def to_hf(self, ts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_ours`; returns a contiguous tensor."""
        # Contiguous: safetensors writes a tensor's storage as is and refuses strided views.
        if self.kind == "copy":
            return ts[0].contiguous()
        if self.kind == "transpose":
            return ts[0].t().contiguous()
        if self.kind == "flatten":
            return ts[0].reshape(self.hf_shape).contiguous()
        if self.kind == "split":
            return torch.cat(list(ts), dim=0).contiguous()
        return torch.cat([t.t() for t in ts], dim=1).contiguous()

    def hf_recipe(self, layout: Dict[str, Tuple[int, Sequence[int]]]) -> dict:
        """:meth:`to_hf` as data: how to build this HF tensor from views of a flat buffer in
        which each of ``ours`` lies at ``layout[name] = (offset, shape)``.  The HF tensor is
        ``cat([p.t() if transpose else p for p in pieces], dim)`` reshaped to ``shape``
        (read by :func:`realhf.system.rollout.vllm_worker_ext.assemble`, in a process that
        has no realhf)."""
        return {
            "name": self.hf_name,
            "pieces": [[int(layout[n][0]), [int(s) for s in layout[n][1]]] for n in self.ours],
            "transpose": self.kind in ("transpose", "split_transpose"),
            "dim": 1 if self.kind == "split_transpose" else 0,
            "shape": list(self.hf_shape),
        }


def copy_rule(hf_name: str, ours: str, shape: Sequence[int]) -> WeightRule:
    """A same-layout rule."""
    return WeightRule(hf_name, (ours,), tuple(shape))
