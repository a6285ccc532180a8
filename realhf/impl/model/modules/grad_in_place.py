"""The two vocabulary-sized weights, whose backward adds into ``weight.grad`` in place.

The token embedding and the LM head are ``[vocab, hidden]``: 272 MB in bf16 at a 152k
vocabulary and hidden 896, a third of a 0.5B model.  Through plain autograd each of their
gradients is first a fresh ``[vocab, hidden]`` tensor that is then added into
``weight.grad``:

- the head's is made at the very start of the backward pass, when every activation, the
  logits and their gradient are alive: the moment a training step peaks;
- ``F.embedding``'s backward builds a dense one for the few rows a batch uses;
- with tied embeddings, the head's is kept until the lookup's arrives at the end of the
  backward pass, and the two are summed out of place (a third copy) before being added.

:func:`embed` and :func:`linear` return no gradient for the weight through autograd:
their backward adds it straight into ``weight.grad`` (created as zeros when absent), the
head's with one in-place ``addmm_``, the lookup's into the rows the batch used (repeated
tokens summed in at least float32 first, one rounding per row).  Nothing
``[vocab, hidden]``-sized is allocated.  A weight that takes no gradient (frozen, or
inference) takes the plain ops.  Not for ``torch.autograd.grad``: the weight's gradient is
in ``weight.grad``, not returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["embed", "linear"]


def _grad_of(weight: torch.Tensor) -> torch.Tensor:
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad


class _EmbedIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        rows, where = torch.unique(ids.reshape(-1), return_inverse=True)
        dtype = torch.promote_types(grad_out.dtype, torch.float32)  # (bf16 sums in fp32)
        acc = grad_out.new_zeros(rows.numel(), weight.shape[1], dtype=dtype)
        acc.index_add_(0, where, grad_out.reshape(-1, weight.shape[1]).to(dtype))
        with torch.no_grad():
            grad = _grad_of(weight)
            grad.index_add_(0, rows, acc.to(grad.dtype))
        return None, None


class _LinearIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        g = grad_out.reshape(-1, weight.shape[0])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.detach()).view_as(x)
        with torch.no_grad():
            grad = _grad_of(weight)
            # Into the transposed view: [hidden, T] @ [T, vocab] reads the logits' gradient
            # in its own layout (no reordered copy of it, which grad.addmm_(g.t(), x) makes).
            xt = x.reshape(-1, weight.shape[1]).t().to(grad.dtype)
            grad.t().addmm_(xt, g.to(grad.dtype))
        return grad_x, None


def embed(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight[ids]``; with gradients, accumulated in place (see the module docstring)."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight)
    return _EmbedIntoGrad.apply(ids, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias); with gradients, the weight's accumulated in place."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.linear(x, weight)
    return _LinearIntoGrad.apply(x, weight)
