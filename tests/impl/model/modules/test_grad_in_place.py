"""The in-place backward of the embedding and the LM head: the same gradients as
``F.embedding``'s and ``F.linear``'s, tied or not."""

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model.modules.grad_in_place import embed, linear


def _grads(use_ours: bool, dtype, tied: bool, start_grad: bool):
    torch.manual_seed(0)
    w = torch.randn(50, 8, dtype=dtype).requires_grad_()
    if start_grad:  # an engine's buffer view, holding an earlier micro-batch's gradient
        w.grad = torch.full_like(w, 0.25)
    ids = torch.tensor([3, 7, 3, 3, 49, 0, 7])  # repeated tokens
    h = (embed if use_ours else F.embedding)(ids, w)
    out = h * torch.linspace(-1, 1, 8, dtype=dtype)
    if tied:  # the LM head reuses the weight
        out = (linear if use_ours else F.linear)(out, w)
    out.square().sum().backward()
    return w.grad


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("start_grad", [False, True])
def test_gradient_equals_f_embedding(tied, start_grad):
    ours = _grads(True, torch.float64, tied, start_grad)
    ref = _grads(False, torch.float64, tied, start_grad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_linear_input_gradient_and_an_untied_head():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for f in (linear, F.linear):
        x.grad = w.grad = None
        f(x, w).sin().sum().backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_bf16_repeated_tokens_are_summed_in_float32_first():
    torch.manual_seed(1)
    w = torch.zeros(4, 2, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(300, dtype=torch.long)  # one token 300 times
    g = torch.full((300, 2), 1.0 + 2**-7, dtype=torch.bfloat16)
    embed(ids, w).backward(g)
    # 300 * (1 + 2**-7) = 302.34, rounded once to bf16 (302); a running bf16 sum stalls
    # far below (256 + ... steps of 2 that 1.0078 no longer moves)
    assert w.grad[0].tolist() == [302.0, 302.0]
    assert w.grad[1:].abs().sum() == 0


def test_without_gradients_they_are_the_plain_ops():
    w = torch.randn(5, 3)
    ids = torch.tensor([4, 1])
    assert torch.equal(embed(ids, w), w[ids])
    x = torch.randn(2, 3)
    assert torch.equal(linear(x, w), F.linear(x, w))
    wg = w.clone().requires_grad_()
    with torch.no_grad():
        assert not embed(ids, wg).requires_grad and not linear(x, wg).requires_grad
