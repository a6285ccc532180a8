"""Normalisation layers whose weights live in the model's flat buffer.

They take their parameters from the owning layer (views into the flat buffer),
so they are plain functions here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    The variance is taken in float32 and the normalised value cast back to the
    input dtype before scaling, exactly as the HuggingFace llama/qwen kernels do,
    so bf16 results round the same way.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    kind: str,
) -> torch.Tensor:
    """Apply ``kind`` (``"rms"`` or ``"layer"``) normalisation over the last dim."""
    if kind == "rms":
        return rms_norm(x, weight, eps)
    # torch's layer_norm computes its statistics in float32 for half inputs already.
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
