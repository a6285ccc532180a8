"""The generation engine's C++ RMSNorm and RoPE (AVX-512) against the torch ops they
replace, and when they are used: under ``torch.inference_mode()`` only."""

from __future__ import annotations

import pytest
import torch

from realhf.impl.kernels import avx512_cpu
from realhf.impl.model.modules import norm as norm_mod
from realhf.impl.model.modules import rotary as rotary_mod
from realhf.impl.model.modules.norm import _rms_forward, rms_norm
from realhf.impl.model.modules.rotary import apply_rope, rope_cos_sin

needs_avx512 = pytest.mark.skipif(
    avx512_cpu() is None, reason="no AVX-512 on this CPU, or realhf._C not built"
)


def _inv_freq(d):
    return 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (3, 896), (5, 24), (2, 7, 40), (1, 128)])
def test_rms_norm_in_inference_mode_equals_the_torch_ops(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    w = (torch.randn(shape[-1]) * 0.5 + 1).to(dtype)
    want = _rms_forward(x, w, 1e-6)[0]
    with torch.inference_mode():
        got = rms_norm(x, w, 1e-6)
    direct = avx512_cpu().rms_norm(x, w, 1e-6)
    assert torch.equal(got, direct)  # the fused kernel ran
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.bfloat16:
        # the reciprocal RMS may differ in its last float32 bit: a bf16 result then moves
        # by one unit at most, and only where x * rstd lies at a rounding boundary
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7).all()
        assert (got != want).float().mean() < 1e-3
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, d", [(6, 64), (16, 128), (3, 40), (2, 8)])
def test_rope_in_inference_mode_equals_the_torch_ops_bit_for_bit(dtype, heads, d):
    """q and k as the engine rotates them: a strided view of the fused projection; head
    sizes whose half is not a multiple of 16 (40, 8) split a 16-lane block at the half."""
    torch.manual_seed(1)
    T = 19
    y = torch.randn(T, heads * d + 32).to(dtype)
    qk = y[:, : heads * d].view(T, heads, d)
    cos, sin = rope_cos_sin(torch.arange(T) * 5, _inv_freq(d), dtype)
    want = qk * cos + qk.roll(d // 2, -1) * sin
    with torch.inference_mode():
        got = apply_rope(qk, cos, sin)
    assert torch.equal(got, want) and got.is_contiguous()
    assert torch.equal(avx512_cpu().rope(qk, cos, sin), want)


def test_outside_inference_mode_the_torch_ops_run(monkeypatch):
    """Training and the trainers' no-grad passes never reach the C++ kernels (their
    results must be those of the autograd path), and neither do tensors they do not take."""

    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"the C++ {name} ran")

    monkeypatch.setattr(norm_mod, "avx512_cpu", lambda: Refuse())
    monkeypatch.setattr(rotary_mod, "avx512_cpu", lambda: Refuse())
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
