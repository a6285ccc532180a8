"""The generation engine's C++ RMSNorm and RoPE (each build this CPU runs: AVX-512,
AVX2) against the torch ops they replace, and when they are used: under
``torch.inference_mode()`` only."""

from __future__ import annotations

import pytest
import torch

from realhf.impl.kernels import simd_cpu, simd_isas
from realhf.impl.model.modules import norm as norm_mod
from realhf.impl.model.modules import rotary as rotary_mod
from realhf.impl.model.modules.norm import _rms_forward, rms_norm
from realhf.impl.model.modules.rotary import apply_rope, rope_cos_sin

#: the builds of the kernels this CPU runs; none (and the tests skip, saying why) without
#: AVX2 or AVX-512, or without realhf._C
ISAS = pytest.mark.parametrize(
    "isa",
    simd_isas()
    or [pytest.param("", marks=pytest.mark.skip("neither AVX2 nor AVX-512, or no realhf._C"))],
)


def _inv_freq(d):
    return 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))


@ISAS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (3, 896), (5, 24), (2, 7, 40), (1, 128), (4, 3)])
def test_rms_norm_in_inference_mode_equals_the_torch_ops(isa, dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype)
    want = _rms_forward(x, w, 1e-6)[0]
    with torch.inference_mode():
        widest = rms_norm(x, w, 1e-6)
    assert torch.equal(widest, simd_cpu().rms_norm(x, w, 1e-6))  # the fused kernel ran
    got = simd_cpu().rms_norm(x, w, 1e-6, isa=isa)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        # the reciprocal RMS may differ in its last float32 bit: a bf16 result then moves
        # by one unit at most, and only where x * rstd lies at a rounding boundary
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7).all()
        assert (got != want).float().mean() < 1e-3
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@ISAS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, d", [(6, 64), (16, 128), (3, 40), (2, 8), (2, 12)])
def test_rope_in_inference_mode_equals_the_torch_ops_bit_for_bit(isa, dtype, heads, d):
    """q and k as the engine rotates them: a strided view of the fused projection; head
    sizes whose half is not a multiple of the vector width (40, 12, 8 for 16 lanes; 12
    for 8) split a block at the half."""
    torch.manual_seed(1)
    T = 19
    y = torch.randn(T, heads * d + 32).to(dtype)
    qk = y[:, : heads * d].view(T, heads, d)
    cos, sin = rope_cos_sin(torch.arange(T) * 5, _inv_freq(d), dtype)
    want = qk * cos + qk.roll(d // 2, -1) * sin
    with torch.inference_mode():
        got = apply_rope(qk, cos, sin)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(simd_cpu().rope(qk, cos, sin, isa=isa), want)


def test_the_kernels_refuse_a_build_this_cpu_does_not_run():
    ext = simd_cpu()
    if ext is None:
        pytest.skip("neither AVX2 nor AVX-512, or no realhf._C")
    x, w = torch.randn(2, 16), torch.randn(16)
    with pytest.raises(ValueError, match="unknown instruction set 'sse'"):
        ext.rms_norm(x, w, 1e-6, isa="sse")
    if "avx512" not in simd_isas():
        with pytest.raises(ValueError, match="does not run avx512; the widest it runs is avx2"):
            ext.rms_norm(x, w, 1e-6, isa="avx512")


def test_outside_inference_mode_the_torch_ops_run(monkeypatch):
    """Training and the trainers' no-grad passes never reach the C++ kernels (their
    results must be those of the autograd path), and neither do tensors they do not take."""

    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"the C++ {name} ran")

    monkeypatch.setattr(norm_mod, "simd_cpu", lambda: Refuse())
    monkeypatch.setattr(rotary_mod, "simd_cpu", lambda: Refuse())
    x, w = torch.randn(4, 32), torch.randn(32)
    cos, sin = rope_cos_sin(torch.arange(4), _inv_freq(32), torch.float32)
    with torch.no_grad():
        rms_norm(x, w, 1e-6)
        apply_rope(x.view(4, 1, 32), cos, sin)
    rms_norm(x.requires_grad_(), w, 1e-6).sum().backward()
    with torch.inference_mode():  # float16, and a non-contiguous x: torch's ops
        rms_norm(x.detach().half(), w.half(), 1e-6)
        rms_norm(torch.randn(32, 4).t(), w, 1e-6)
        cos16, sin16 = rope_cos_sin(torch.arange(4), _inv_freq(32), torch.float16)
        apply_rope(x.detach().half().view(4, 1, 32), cos16, sin16)
