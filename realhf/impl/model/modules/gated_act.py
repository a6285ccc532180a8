"""``act(gate) * up`` of a gated MLP (SwiGLU and kin), saving only ``gate`` and ``up``.

Through plain autograd the product saves three ``[T, intermediate]`` tensors for backward:
``gate`` (for the activation's gradient), ``act(gate)`` and ``up`` (for the product's).
The activation is cheap to recompute, so :func:`gated_act` keeps ``gate`` and ``up`` and
recomputes ``act(gate)`` in backward, with the same ops, hence the same gradients to the
last bit.  At the 0.5B shape (intermediate 4864, 24 layers) that is 0.25 GiB less held at
the start of a 1,148-token backward pass, where a bf16 training step peaks.

For silu (SwiGLU: Qwen, Llama) on a CPU with realhf's vector kernels, forward and backward
are one C++ pass each (``realhf._C.silu_mul`` / ``silu_mul_backward``,
``csrc/gated_act_simd.h``) instead of ~10 torch passes over ``[T, intermediate]`` tensors
per layer.  They round where torch's ops round, so their results differ from torch's only
where the two sigmoids differ in their last float32 bits (a bf16 ulp at most).  Without
gradients the forward pass also reads the two halves of a fused ``[T, 2F]`` gate/up product
in place (the generation engine's packed products), as one call instead of torch's silu and
product.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from realhf.impl.kernels import simd_cpu

__all__ = ["gated_act"]


class _GatedAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act: Callable) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return act(gate) * up

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g = gate.detach().requires_grad_()
            a = ctx.act(g)
            (d_gate,) = torch.autograd.grad(a, g, grad_out * up)
        d_up = grad_out * a.detach() if ctx.needs_input_grad[1] else None
        return d_gate, d_up, None


class _SiluMulCpp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, ext) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.ext = ext
        return ext.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate, d_up = ctx.ext.silu_mul_backward(gate, up, grad_out.contiguous())
        return d_gate, d_up if ctx.needs_input_grad[1] else None, None


def _silu_ext(act: Callable, gate: torch.Tensor, up: torch.Tensor, rows: bool = False):
    """``realhf._C`` where its silu kernels take these tensors, else None.  ``rows``: the
    forward pass alone, which also takes ``[T, F]`` tensors whose rows are contiguous."""
    if (
        act is not F.silu
        or gate.device.type != "cpu"
        or gate.dtype not in (torch.float32, torch.bfloat16)
        or up.dtype != gate.dtype
        or up.shape != gate.shape
    ):
        return None
    if not (gate.is_contiguous() and up.is_contiguous()) and not (
        rows and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
    ):
        return None
    return simd_cpu()


def gated_act(act: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``; with gradients, ``act(gate)`` is recomputed in backward."""
    grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    ext = _silu_ext(act, gate, up, rows=not grad)
    if not grad:
        return act(gate) * up if ext is None else ext.silu_mul(gate, up)
    if ext is not None:
        return _SiluMulCpp.apply(gate, up, ext)
    return _GatedAct.apply(gate, up, act)
