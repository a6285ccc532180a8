"""Normalisation layers whose weights live in the model's flat buffer.

They take their parameters from the owning layer (views into the flat buffer),
so they are plain functions here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from realhf.impl.kernels import simd_cpu

#: dtypes the C++ inference kernels (RMSNorm, RoPE) take
FUSED_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    The variance is taken in float32 and the normalised value cast back to the
    input dtype before scaling, exactly as the HuggingFace llama/qwen kernels do,
    so bf16 results round the same way.

    For backward it keeps only ``x`` (in its own dtype) and the fp32 reciprocal RMS
    per row, and recomputes the rest: plain autograd over these operations kept an
    fp32 copy of ``x`` and the normalised value as well, 6 bytes per element more in
    bf16 (at qwen3-0.6b with its q/k norms, a quarter of a layer's activations).

    Under ``torch.inference_mode()`` (the generation engine) on a CPU with AVX2 or
    AVX-512, a float32 or bfloat16 ``x`` goes through one C++ pass
    (``realhf._C.rms_norm``) instead of six ops: the same roundings, the sum of squares in
    another order (float32 results may differ in the last bit). Training and the
    trainers' no-grad passes keep these ops.
    """
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        ext = simd_cpu() if torch.is_inference_mode_enabled() else None
        if ext is not None and _fusable(x, weight):
            return ext.rms_norm(x, weight, eps)
        return _rms_forward(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in FUSED_DTYPES
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == x.shape[-1:]
    )


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        h = x.float()
        xhat = h * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            # as autograd reduces ``weight * n`` over the broadcast dimensions
            grad_w = (gy * xhat.to(x.dtype)).sum_to_size(weight.shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (gy * weight).float()
            # d(h * rstd)/dh with rstd = (mean(h^2) + eps)^-1/2
            grad_h = rstd * g - rstd.pow(3) * h * (g * h).mean(-1, keepdim=True)
            grad_x = grad_h.to(x.dtype)
        return grad_x, grad_w, None


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
