"""realhf's float32 decode product (``realhf._C.decode_linear``, csrc/decode_linear_simd.h):
x @ W.T + b from W packed in blocks of 16 output rows, per instruction set, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.kernels import simd_cpu, simd_isas
from realhf.impl.model.nn.packed_linear import pack_blocks

_NO_KERNELS = "the decode kernel needs AVX2 or AVX-512 and realhf._C"
ISA = pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)


@ISA
@pytest.mark.parametrize("n_out,k", [(16, 5), (37, 64), (1152, 896), (9, 4864)])
@pytest.mark.parametrize("rows", [1, 6, 7, 16, 17, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_equals_torch_to_float32_rounding(isa, n_out, k, rows, with_bias):
    """Every row count (one pass of the registers, several, a partial one), output widths
    with and without a partial last block, with and without a bias; x with a row stride."""
    g = torch.Generator().manual_seed(n_out * 1000 + k + rows)
    w = torch.randn(n_out, k, generator=g)
    b = torch.randn(n_out, generator=g) if with_bias else None
    x = torch.randn(rows, 2 * k, generator=g)[:, :k]  # (not contiguous)
    packed, b_padded = pack_blocks(w, b)
    assert packed.shape == ((n_out + 15) // 16, k, 16)
    y = simd_cpu().decode_linear(x, packed, b_padded, n_out, isa)
    assert y.shape == (rows, n_out) and y.is_contiguous()
    # Against float64: each output is one float32 sum over k, whose rounding errors walk
    # like u * sqrt(k / 2) * |the terms| (u = 2^-24): bound it at 4x that.
    xd, wd = x.double(), w.double()
    want = F.linear(xd, wd, None if b is None else b.double())
    terms = (xd[:, None, :] * wd[None]).norm(dim=-1)
    bound = 4 * 2**-24 * k**0.5 * terms + 2**-23 * want.abs()
    assert ((y.double() - want).abs() <= bound).all()
    # torch's float32 product is within the same bound
    assert ((F.linear(x, w, b).double() - want).abs() <= bound).all()


@pytest.mark.skipif(simd_cpu() is None, reason=_NO_KERNELS)
def test_decode_linear_refuses_mismatched_arguments():
    ext = simd_cpu()
    w = torch.randn(20, 8)
    packed, _ = pack_blocks(w, None)
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="x has 9 columns but packed was made from 8"):
        ext.decode_linear(torch.randn(3, 9), packed, None, 20)
    with pytest.raises(ValueError, match="n_out 33 does not fit 2 packed blocks"):
        ext.decode_linear(x, packed, None, 33)
    with pytest.raises(RuntimeError, match="x must be a float32 CPU tensor"):
        ext.decode_linear(x.bfloat16(), packed, None, 20)
    with pytest.raises(RuntimeError, match="packed must be a contiguous float32"):
        ext.decode_linear(x, w, None, 20)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU tensor"):
        ext.decode_linear(x, packed, torch.zeros(20), 20)
    assert ext.decode_linear(x[:0], packed, None, 20).shape == (0, 20)
