"""Block-wise log-probs and entropy equal the full fp32 computation, gradients included,
without a [T, V] float32 tensor."""

from __future__ import annotations

import pytest
import torch
from alloc_probe import biggest_allocation

from realhf.impl.model.modules import vocab_chunked as vc


def _full(logits, rows, labels, t):
    z = logits[rows].float() / t
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _shifted_rows(T):
    # the first 29 of every position but the last of sequences of 5, 11, 2, 9 and 10 tokens:
    # runs of consecutive rows that the 3-row blocks below cut anywhere (slices on a CPU)
    ends = torch.tensor([5, 16, 18, 27, T]) - 1
    keep = torch.ones(T, dtype=torch.bool)
    keep[ends] = False
    return keep.nonzero()[:, 0][:29]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1.0, 0.7])
@pytest.mark.parametrize("layout", ["shuffled", "shifted"])
def test_blocks_equal_the_full_computation_with_gradients(dtype, t, layout):
    torch.manual_seed(0)
    T, V = 37, 1000
    base = (torch.randn(T, V) * 3).to(dtype)
    # a subset out of order (indexed row by row), or the shifted positions of packed
    # sequences (runs of consecutive rows)
    rows = torch.randperm(T)[:29] if layout == "shuffled" else _shifted_rows(T)
    labels = torch.randint(0, V, (29,))
    w1, w2 = torch.randn(29), torch.randn(29)
    # blocks of 3 rows (4 bytes x 1000 entries x 3): ten blocks, the last one short
    a = base.clone().requires_grad_()
    lp = vc.token_log_probs(a, labels, rows=rows, temperature=t, block_bytes=12_000)
    h = vc.token_entropy(a, rows=rows, temperature=t, block_bytes=12_000)
    ((lp * w1).sum() + (h * w2).sum()).backward()
    b = base.clone().requires_grad_()
    lp_ref, h_ref = _full(b, rows, labels, t)
    ((lp_ref * w1).sum() + (h_ref * w2).sum()).backward()
    assert lp.dtype == h.dtype == torch.float32 and a.grad.dtype == dtype
    # bf16: each function's gradient is rounded to bf16 before the two are summed (~2^-8
    # relative, at gradients up to ~3); the reference rounds once
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(h, h_ref, atol=1e-5)
    assert torch.allclose(a.grad.float(), b.grad.float(), atol=tol)
    others = torch.ones(T, dtype=torch.bool)
    others[rows] = False
    assert not a.grad[others].any()  # rows not asked for get no gradient


def test_no_float32_copy_of_the_logits_only_blocks():
    """bf16 logits [1024, 8192]: a float32 copy would be 32 MiB.  Forward allocates one
    block's worth (2 MiB blocks); backward the gradient itself, in bf16 (16 MiB)."""
    T, V, block = 1024, 8192, 2 << 20
    logits = torch.randn(T, V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    out = {}

    def forward():
        out["lp"] = vc.token_log_probs(logits, labels, block_bytes=block)
        out["h"] = vc.token_entropy(logits, block_bytes=block)

    assert biggest_allocation(forward) <= block
    assert biggest_allocation(lambda: (out["lp"].sum() + out["h"].sum()).backward()) <= T * V * 2
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[:, None])[:, 0]
    assert torch.allclose(out["lp"], ref, atol=1e-5)


def test_a_bad_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vc.token_log_probs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0)
