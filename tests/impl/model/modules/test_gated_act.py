"""The gated MLP product that recomputes its activation: same values and gradients, bit for
bit, for one saved tensor less."""

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model.modules.gated_act import gated_act


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_recomputes_the_activation_with_the_same_gradients(act, dtype):
    from realhf.impl.model.nn.layers import _ACTIVATIONS

    f = _ACTIVATIONS[act]
    torch.manual_seed(3)
    gate0, up0 = torch.randn(2, 6, 16, dtype=dtype), torch.randn(2, 6, 16, dtype=dtype)
    g = torch.randn(2, 6, 16, dtype=dtype)
    results = []
    for fn in (lambda a, b: gated_act(f, a, b), lambda a, b: f(a) * b):
        gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        out = fn(gate, up)
        out.backward(g)
        results.append((out.detach(), gate.grad, up.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)  # the same ops: bit for bit


def test_gated_act_saves_two_tensors_where_autograd_saves_three():

    def saved(fn):
        packed = []
        gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            fn(gate, up)
        return len(packed)

    assert saved(lambda a, b: gated_act(F.silu, a, b)) == 2
    assert saved(lambda a, b: F.silu(a) * b) == 3
