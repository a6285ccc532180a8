"""The gated MLP product that recomputes its activation: same values and gradients, bit for
bit, for one saved tensor less; and silu's C++ passes (each build this CPU runs), equal to
torch's ops to float32 rounding."""

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.kernels import simd_cpu, simd_isas
from realhf.impl.model.modules import gated_act as gated_act_module
from realhf.impl.model.modules.gated_act import _silu_ext, gated_act

_NO_KERNELS = "the C++ silu passes need AVX2 or AVX-512 and realhf._C"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_recomputes_the_activation_with_the_same_gradients(act, dtype, monkeypatch):
    from realhf.impl.model.nn.layers import _ACTIVATIONS

    monkeypatch.setattr(gated_act_module, "simd_cpu", lambda: None)  # torch's ops

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
    assert saved(lambda a, b: gated_act(F.gelu, a, b)) == 2
    assert saved(lambda a, b: F.silu(a) * b) == 3


def _torch_silu_mul(gate, up, grad):
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = F.silu(gate) * up
    out.backward(grad)
    return out.detach(), gate.grad, up.grad


@pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5,), (3, 37), (96, 4864)])
def test_cpp_silu_passes_equal_torch_ops(isa, dtype, shape):
    """Forward and backward against torch's silu, product and silu_backward: float32 to a
    few ulps (absolute where a gradient cancels to ~0), bf16 equal but for elements where
    the sigmoids' last float32 bits move a rounding (at most one bf16 ulp, ~1e-5 of them)."""
    ext = simd_cpu()
    g = torch.Generator().manual_seed(sum(shape))
    gate, up, grad = ((torch.randn(shape, generator=g) * s).to(dtype) for s in (4.0, 1.0, 1.0))
    gate.view(-1)[:4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # sigmoid's ends
    out = ext.silu_mul(gate, up, isa)
    d_gate, d_up = ext.silu_mul_backward(gate, up, grad, isa)
    ref = _torch_silu_mul(gate, up, grad)
    for got, want in zip((out, d_gate, d_up), ref):
        assert got.dtype == dtype and got.shape == want.shape
        got, want = got.reshape(-1), want.reshape(-1)
        # at sigmoid's ends both are 0 or within 1e-30 of it (torch's exp overflows at -90)
        torch.testing.assert_close(got[:4], want[:4], rtol=2**-7, atol=1e-30)
        got, want = got[4:], want[4:]
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            off = got != want
            assert off.float().mean() <= 1e-4
            torch.testing.assert_close(got[off], want[off], rtol=2**-7, atol=1e-6)


@pytest.mark.skipif(simd_cpu() is None, reason=_NO_KERNELS)
def test_gated_act_takes_the_cpp_passes_for_silu_on_this_cpu():
    """Contiguous silu inputs take the C++ passes, with and without gradients; another
    activation takes torch's ops, and so do the halves of a fused gate/up product (not
    contiguous) with gradients; without gradients they take the C++ forward (the engine's
    packed products)."""
    gate = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(6, 40, dtype=torch.bfloat16, requires_grad=True)
    out = gated_act(F.silu, gate, up)
    assert type(out.grad_fn).__name__ == "_SiluMulCppBackward"
    out.backward(torch.ones_like(out))
    ref = _torch_silu_mul(gate.detach(), up.detach(), torch.ones_like(out))
    torch.testing.assert_close(out.detach(), ref[0], rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(gate.grad, ref[1], rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(up.grad, ref[2], rtol=2**-7, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(gated_act(F.silu, gate, up), out.detach())
    assert type(gated_act(F.gelu, gate, up).grad_fn).__name__ == "_GatedActBackward"
    both = torch.randn(6, 80, requires_grad=True)
    halves = gated_act(F.silu, *both.chunk(2, dim=-1))
    assert type(halves.grad_fn).__name__ == "_GatedActBackward"
    gate, up = both.detach().bfloat16().chunk(2, dim=-1)
    assert _silu_ext(F.silu, gate, up) is None and _silu_ext(F.silu, gate, up, rows=True)
    with torch.no_grad():
        got = gated_act(F.silu, gate, up)
    assert got.is_contiguous()
    assert torch.equal(got, simd_cpu().silu_mul(gate.contiguous(), up.contiguous()))


@pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_silu_forward_reads_the_halves_of_a_fused_product_in_place(isa, dtype):
    """The halves of a fused ``[T, 2F]`` product (rows contiguous, row stride 2F) give what
    their contiguous copies give, to the bit, at widths with and without a vector tail."""
    ext = simd_cpu()
    for T, F2 in ((2, 10), (3, 74), (16, 2 * 4864)):
        both = torch.randn(T, F2, generator=torch.Generator().manual_seed(F2)).to(dtype) * 3
        gate, up = both.chunk(2, dim=-1)
        assert not gate.is_contiguous()
        got = ext.silu_mul(gate, up, isa)
        assert got.shape == gate.shape and got.is_contiguous()
        assert torch.equal(got, ext.silu_mul(gate.contiguous(), up.contiguous(), isa))


@pytest.mark.skipif(simd_cpu() is None, reason=_NO_KERNELS)
def test_cpp_silu_passes_refuse_mismatched_inputs():
    ext, x = simd_cpu(), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="up must be a contiguous CPU tensor of gate's shape"):
        ext.silu_mul(x, x[:, :4].contiguous())
    with pytest.raises(RuntimeError, match="gate must be a contiguous float32 or bfloat16"):
        ext.silu_mul(x.half(), x.half())
    with pytest.raises(RuntimeError, match="or \\[T, F\\] ones of that kind with contiguous rows"):
        ext.silu_mul(x.t(), x.t())  # (rows not contiguous)
    with pytest.raises(RuntimeError, match="of one shape and dtype"):
        ext.silu_mul(x[:, :4], x[:, 4:].bfloat16())
    with pytest.raises(RuntimeError, match="grad_out must be"):
        ext.silu_mul_backward(x, x, x.bfloat16())
