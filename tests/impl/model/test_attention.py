"""Packed causal attention: every implementation equals a naive reference."""

from __future__ import annotations

import math

import pytest
import torch

from realhf.impl.model.modules.attention import (
    _length_buckets,
    packed_causal_attention,
    select_attn_impl,
)


def naive(q, k, v, cu, window=None):
    """Explicit softmax attention per sequence, GQA by repeating k/v heads."""
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for t in range(s, e):
            lo = s if window is None else max(s, t - window + 1)
            kk = k[lo : t + 1].repeat_interleave(rep, 1)  # [n, H, D]
            vv = v[lo : t + 1].repeat_interleave(rep, 1)
            scores = torch.einsum("hd,nhd->hn", q[t], kk) / math.sqrt(q.shape[-1])
            out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv)
    return out


def _qkv(seqlens, nq=4, nkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(seqlens)
    q, k, v = (torch.randn(T, h, d, generator=g) for h in (nq, nkv, nkv))
    cu = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("impl", ["sdpa_bucketed", "sdpa_per_seq", "sdpa_masked"])
@pytest.mark.parametrize("window", [None, 3])
def test_matches_naive(impl, window):
    q, k, v, cu = _qkv([5, 1, 9, 0, 4])
    got = packed_causal_attention(q, k, v, cu, impl=impl, sliding_window=window)
    assert (got - naive(q, k, v, cu, window)).abs().max() <= 1e-5


def test_auto_on_cpu_is_bucketed():
    q, _, _, _ = _qkv([2])
    assert select_attn_impl(q) == "sdpa_bucketed"
    with pytest.raises(ValueError, match="unknown"):
        select_attn_impl(q, "bogus")


def test_flash_without_package_says_how_to_fix():
    from realhf.impl.model.modules.attention import flash_attn_available

    if flash_attn_available():
        pytest.skip("flash_attn is installed; the missing-package error cannot occur")
    q, k, v, cu = _qkv([3])
    with pytest.raises(RuntimeError, match="flash_attn is not installed"):
        packed_causal_attention(q, k, v, cu, impl="flash")


def test_backward_flows_to_qkv():
    q, k, v, cu = _qkv([4, 6])
    for t in (q, k, v):
        t.requires_grad_(True)
    packed_causal_attention(q, k, v, cu).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_buckets_bound_padding_and_cover_every_sequence():
    lens = [30, 1, 0, 24, 25, 7, 100, 8, 6, 5, 0, 31]
    buckets = _length_buckets(lens)
    assert sorted(i for b in buckets for i in b) == [i for i, n in enumerate(lens) if n > 0]
    for b in buckets:  # padded to the longest member: at most 1.25x the shortest
        assert max(lens[i] for i in b) <= 1.25 * min(lens[i] for i in b)
    assert [100] in [[lens[i] for i in b] for b in buckets]  # a lone long one stays alone


@pytest.mark.parametrize("seqlens", [[7, 1, 12, 0, 9, 10, 3, 3, 40], [1], [0, 5, 0]])
def test_bucketed_equals_per_sequence_with_gradients(seqlens):
    """Padding at the end of a causal sequence changes nothing, forward or backward."""
    q, k, v, cu = _qkv(seqlens, seed=1)
    q, k, v = (t.double() for t in (q, k, v))
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    results = []
    for impl in ("sdpa_per_seq", "sdpa_bucketed"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = packed_causal_attention(*leaves, cu, impl=impl)
        (out * g).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-12)


def _reference_grads(q, k, v, g, scale):
    """fp64 SDPA with the kv heads repeated: output and gradients of (out * g).sum()."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(rep, 1) for t in leaves[1:])
    out = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], kk, vv, is_causal=True, scale=scale
    )
    (out * g.double()).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b, n", [(5, 9), (3, 1), (2, 128)])
def test_short_causal_attention_backward_matches_the_reference(monkeypatch, dtype, tol, b, n):
    from realhf.impl.model.modules import attention

    # one sequence per slice of the backward, so that the slices are exercised too
    monkeypatch.setattr(attention, "_SHORT_BWD_BYTES", 4 * 6 * n * n)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, n, 16, generator=gen).to(dtype) for h in (6, 2, 2))
    g = torch.randn(b, 6, n, 16, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attention.causal_sdpa(*leaves, scale=0.3)
    assert out.grad_fn.name() == "_ShortCausalAttentionBackward"
    (out * g).sum().backward()
    ref = _reference_grads(q, k, v, g, scale=0.3)
    for got, want in zip([out.detach()] + [t.grad for t in leaves], ref):
        assert got.dtype == dtype
        # (a one-token sequence's q and k gradients are 0: the bound has a floor of tol)
        assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max())


def test_causal_sdpa_takes_torch_for_long_sequences_and_no_grad():
    from realhf.impl.model.modules.attention import _SHORT_LEN, causal_sdpa

    q, k, v = (torch.randn(1, h, _SHORT_LEN + 1, 8, requires_grad=True) for h in (4, 2, 2))
    assert causal_sdpa(q, k, v).grad_fn.name() != "_ShortCausalAttentionBackward"
    with torch.no_grad():
        assert causal_sdpa(q[..., :4, :], k[..., :4, :], v[..., :4, :]).grad_fn is None
