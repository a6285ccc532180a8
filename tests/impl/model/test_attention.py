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
