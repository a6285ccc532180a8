"""Block-wise log-probs and entropy equal the full fp32 computation, gradients included,
without a [T, V] float32 tensor; so do the C++ row kernels of the log-probs (each build this
CPU runs), which replace the block-wise torch ops on such CPUs."""

from __future__ import annotations

import pytest
import torch
from alloc_probe import biggest_allocation

from realhf.impl.kernels import simd_cpu, simd_isas
from realhf.impl.model.modules import vocab_chunked as vc

_NO_KERNELS = "the C++ row kernels need AVX2 or AVX-512 and realhf._C"


@pytest.fixture(params=["torch", "cpp"])
def impl(request, monkeypatch):
    """Each test runs on the block-wise torch ops and on the C++ row kernels (the path this
    CPU takes, where it runs them)."""
    if request.param == "torch":
        monkeypatch.setattr(vc, "simd_cpu", lambda: None)
    elif simd_cpu() is None:
        pytest.skip(_NO_KERNELS)
    return request.param


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
def test_blocks_equal_the_full_computation_with_gradients(dtype, t, layout, impl):
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


def test_no_float32_copy_of_the_logits_only_blocks(impl):
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


@pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [151_936, 1000, 37, 5])
def test_row_kernels_equal_the_torch_ops(isa, dtype, V):
    """Each build, at a real vocabulary and at widths that end in a partial vector, against
    float64: the log-sum-exp of the selected rows, and gradient rows ``coef * softmax +
    onehot * add`` written into those rows only."""
    ext = simd_cpu()
    torch.manual_seed(0)
    x = (torch.randn(9, V) * 3).to(dtype)
    rows, t = torch.tensor([8, 0, 3, 4]), 0.7
    z = x[rows].double() / t
    m, s = ext.row_logsumexp(x, rows, t, isa)
    lse = m + s.log()
    # (torch's own float32 logsumexp is ~8e-7 off float64 at 152k entries; so is this)
    assert torch.allclose(lse.double(), torch.logsumexp(z, -1), rtol=0, atol=2e-6)
    g, labels = torch.randn(4).double(), torch.randint(0, V, (4,))
    grad = torch.full_like(x, 7.0)
    ext.row_softmax_grad(x, rows, lse, (-g / t).float(), labels, (g / t).float(), t, grad, isa)
    want = -torch.softmax(z, -1) * (g / t)[:, None]
    want[torch.arange(4), labels] += g / t
    tol = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    assert torch.allclose(grad[rows].double(), want, **tol)
    assert (grad[[1, 2, 5, 6, 7]] == 7.0).all()  # the rows not asked for are untouched


def test_row_kernels_make_rows_with_a_non_finite_logit_nan():
    """torch's ops give NaN (or inf) there; the kernels say NaN, in the statistics and in
    the gradient, so that the trainer's check of the loss and gradient norm sees it."""
    ext = simd_cpu()
    if ext is None:
        pytest.skip(_NO_KERNELS)
    x = torch.randn(3, 100)
    x[1, 7], x[2, 99] = float("nan"), float("inf")
    m, s = ext.row_logsumexp(x, torch.arange(3), 1.0)
    lse = m + s.log()
    assert lse[0].isfinite() and lse[1:].isnan().all()
    grad = torch.zeros_like(x)
    zeros, ones = torch.zeros(3), torch.ones(3)
    ext.row_softmax_grad(x, torch.arange(3), lse, ones, torch.zeros(3, dtype=torch.long), zeros,
                         1.0, grad)  # fmt: skip
    assert grad[0].isfinite().all() and grad[1:].isnan().all()


def test_row_kernels_refuse_rows_and_labels_out_of_range():
    ext = simd_cpu()
    if ext is None:
        pytest.skip(_NO_KERNELS)
    x = torch.randn(3, 10)
    with pytest.raises(IndexError, match=r"rows must lie in \[0, 3\), got 0..3"):
        ext.row_logsumexp(x, torch.tensor([0, 3]), 1.0)
    one = torch.ones(1)
    with pytest.raises(IndexError, match=r"labels must lie in \[0, 10\), got 10..10"):
        ext.row_softmax_grad(x, torch.tensor([1]), one, one, torch.tensor([10]), one, 1.0,
                             torch.zeros_like(x))  # fmt: skip
