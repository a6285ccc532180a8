"""``act(gate) * up`` of a gated MLP (SwiGLU and kin), saving only ``gate`` and ``up``.

Through plain autograd the product saves three ``[T, intermediate]`` tensors for backward:
``gate`` (for the activation's gradient), ``act(gate)`` and ``up`` (for the product's).
The activation is cheap to recompute, so :func:`gated_act` keeps ``gate`` and ``up`` and
recomputes ``act(gate)`` in backward, with the same ops, hence the same gradients to the
last bit.  At the 0.5B shape (intermediate 4864, 24 layers) that is 0.25 GiB less held at
the start of a 1,148-token backward pass, where a bf16 training step peaks.
"""

from __future__ import annotations

from typing import Callable

import torch

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


def gated_act(act: Callable, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``; with gradients, ``act(gate)`` is recomputed in backward."""
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return act(gate) * up
    return _GatedAct.apply(gate, up, act)
