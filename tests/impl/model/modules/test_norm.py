"""RMSNorm that keeps only its input and the reciprocal RMS for backward: the values of the
HuggingFace formula, its gradients, and fewer bytes saved."""

import pytest
import torch

from realhf.impl.model.modules.norm import rms_norm


def plain(x, w, eps):
    """The formula as plain autograd sees it (HF llama / qwen)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize(
    "dtype, shape, wshape",
    [
        (torch.bfloat16, (64, 96), (96,)),
        (torch.float32, (64, 96), (96,)),
        (torch.bfloat16, (10, 4, 32), (32,)),  # per-head q/k norms
    ],
)
def test_rms_norm_equals_the_plain_formula_with_gradients(dtype, shape, wshape):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=g).to(dtype)
    w0 = (1 + 0.1 * torch.randn(wshape, generator=g)).to(dtype)
    gy = torch.randn(shape, generator=g).to(dtype)
    results = []
    for fn in (plain, rms_norm):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = fn(x, w, 1e-6)
        y.backward(gy)
        results.append((y.detach(), x.grad, w.grad))
    (y, gx, gw), (y_ref, gx_ref, gw_ref) = results[1], results[0]
    assert torch.equal(y, y_ref)  # the same forward ops
    # Backward: the analytic gradient in fp32, against autograd's (fp32 inside too).
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **tol)
    with torch.no_grad():
        assert torch.equal(rms_norm(x0, w0, 1e-6), y_ref)


def test_rms_norm_gradient_is_exact_in_fp64_arithmetic():
    """The backward formula itself, checked by finite differences (torch.autograd.gradcheck
    on a float64 copy of the function: the module's cast to fp32 would hide small errors)."""
    from realhf.impl.model.modules import norm

    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    # A float64 `float()`: the function computes in the input's precision throughout.
    orig = torch.Tensor.float
    try:
        torch.Tensor.float = lambda t: t.double()
        assert torch.autograd.gradcheck(lambda a, b: norm._RMSNorm.apply(a, b, 1e-6), (x, w))
    finally:
        torch.Tensor.float = orig


def test_rms_norm_saves_its_input_in_its_dtype_and_one_value_per_row():
    def saved_bytes(fn):
        sizes = []
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: sizes.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            fn(x, w, 1e-6)
        return sum(sizes)

    ours, theirs = saved_bytes(rms_norm), saved_bytes(plain)
    # x (bf16), the weight and the fp32 reciprocal RMS per row
    assert ours == 32 * 64 * 2 + 64 * 2 + 32 * 4
    assert theirs >= 32 * 64 * (4 + 2)  # an fp32 copy and the normalised value
