"""Decode/prefill attention against the slot cache, checked against plain softmax attention."""

import math

import pytest
import torch

from realhf.impl.model.gen.cache_attention import (
    DecodeAttention,
    PrefillAttention,
    numba_available,
    prefill_attention,
    select_decode_impl,
)
from realhf.impl.model.gen.kv_cache import SlotKVCache

N_Q, N_KV, D = 4, 2, 16


def _ref_attn(q, k, v, window=None):
    """q [n_q, d] for the last position; k, v [n_kv, L, d]."""
    g = q.shape[0] // k.shape[0]
    L = k.shape[1]
    lo = 0 if window is None else max(0, L - window)
    kk = k[:, lo:].repeat_interleave(g, 0)
    vv = v[:, lo:].repeat_interleave(g, 0)
    w = torch.softmax((q[:, None, :] * kk).sum(-1) / math.sqrt(q.shape[-1]), -1)
    return (w[..., None] * vv).sum(1)


def _impls():
    return ["padded"] + (["numba"] if numba_available() else [])


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("window", [None, 5])
def test_decode_matches_reference_for_scattered_slots(impl, window):
    torch.manual_seed(0)
    cache = SlotKVCache(
        n_layers=2,
        n_kv_heads=N_KV,
        head_dim=D,
        n_slots=8,
        slot_len=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.k.normal_()
    cache.v.normal_()
    slots = torch.tensor([6, 1, 3])  # not contiguous, not sorted
    lens = torch.tensor([9, 1, 20])
    q = torch.randn(3, N_Q, D)
    k_new, v_new = torch.randn(3, N_KV, D), torch.randn(3, N_KV, D)
    attn = DecodeAttention(slots, lens, sliding_window=window, impl=impl)
    out = attn(q, k_new, v_new, cache.k[1], cache.v[1])
    # the new key/value landed at position lens - 1 of each slot
    for b in range(3):
        torch.testing.assert_close(cache.k[1, slots[b], :, lens[b] - 1], k_new[b])
        torch.testing.assert_close(cache.v[1, slots[b], :, lens[b] - 1], v_new[b])
    for b in range(3):
        s, L = slots[b].item(), lens[b].item()
        ref = _ref_attn(q[b], cache.k[1, s, :, :L], cache.v[1, s, :, :L], window)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", _impls())
def test_decode_contiguous_slots(impl):
    torch.manual_seed(1)
    kc = torch.randn(4, N_KV, 16, D)
    vc = torch.randn(4, N_KV, 16, D)
    slots, lens = torch.arange(4), torch.tensor([3, 16, 1, 7])
    q = torch.randn(4, N_Q, D)
    k_new = kc[torch.arange(4), :, lens - 1].clone()
    v_new = vc[torch.arange(4), :, lens - 1].clone()
    out = DecodeAttention(slots, lens, sliding_window=None, impl=impl)(q, k_new, v_new, kc, vc)
    for b in range(4):
        ref = _ref_attn(q[b], kc[b, :, : lens[b]], vc[b, :, : lens[b]])
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-4)


def test_select_decode_impl():
    cpu32 = torch.empty(1)
    assert select_decode_impl(cpu32, "auto") == ("numba" if numba_available() else "padded")
    assert select_decode_impl(cpu32.bfloat16(), "auto") == "padded"
    with pytest.raises(ValueError, match="unknown"):
        select_decode_impl(cpu32, "flash")
    with pytest.raises(ValueError, match="float32 CPU"):
        select_decode_impl(cpu32.half(), "numba")


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    "lens, padded", [([9, 1, 1], False), ([5, 1, 7], True), ([5, 4, 7], True), ([6], False)]
)
def test_prefill_is_causal_per_prompt(window, lens, padded):
    torch.manual_seed(2)
    T = sum(lens)
    q, k, v = torch.randn(T, N_Q, D), torch.randn(T, N_KV, D), torch.randn(T, N_KV, D)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    assert PrefillAttention(bounds, sliding_window=window, device="cpu").padded == padded
    out = prefill_attention(q, k, v, bounds, sliding_window=window)
    for s, e in zip(bounds[:-1], bounds[1:]):
        for t in range(s, e):
            ref = _ref_attn(
                q[t], k[s : t + 1].transpose(0, 1), v[s : t + 1].transpose(0, 1), window
            )
            torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-4)


def test_cache_write_places_tokens_at_slot_and_position():
    cache = SlotKVCache(
        n_layers=3,
        n_kv_heads=N_KV,
        head_dim=D,
        n_slots=4,
        slot_len=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    k, v = torch.randn(3, N_KV, D), torch.randn(3, N_KV, D)
    cache.write(2, torch.tensor([3, 3, 0]), torch.tensor([0, 1, 5]), k, v)
    torch.testing.assert_close(cache.k[2, 3, :, 0], k[0])
    torch.testing.assert_close(cache.k[2, 3, :, 1], k[1])
    torch.testing.assert_close(cache.v[2, 0, :, 5], v[2])


def test_cache_slots_are_lowest_first_and_checked():
    cache = SlotKVCache(
        n_layers=1,
        n_kv_heads=1,
        head_dim=2,
        n_slots=3,
        slot_len=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert [cache.alloc(), cache.alloc()] == [0, 1]
    cache.free(0)
    assert cache.alloc() == 0
    assert cache.alloc() == 2 and cache.n_free == 0
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.alloc()
    cache.free(1)
    with pytest.raises(RuntimeError, match="not allocated"):
        cache.free(1)
    assert cache.nbytes == 2 * 1 * 3 * 1 * 4 * 2 * 4
    assert cache.bytes_per_token == cache.nbytes // 12


def test_new_cache_is_finite_even_in_reused_memory():
    # The padded decode path multiplies masked positions by weight 0, and
    # 0 * NaN is NaN: a cache that reused freed memory holding NaNs made the
    # engine emit token 0 (seen only when the whole suite ran in one process).
    kw = dict(
        n_layers=2,
        n_kv_heads=N_KV,
        head_dim=D,
        n_slots=4,
        slot_len=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for _ in range(3):
        junk = torch.full((2, 4, N_KV, 16, D), float("nan"))
        del junk
        cache = SlotKVCache(**kw)
        assert torch.count_nonzero(cache.k) == 0 and torch.count_nonzero(cache.v) == 0
    slots, lens = torch.tensor([0, 2]), torch.tensor([3, 1])
    attn = DecodeAttention(slots, lens, sliding_window=None, impl="padded")
    out = attn(
        torch.randn(2, N_Q, D),
        torch.randn(2, N_KV, D),
        torch.randn(2, N_KV, D),
        cache.k[0],
        cache.v[0],
    )
    assert torch.isfinite(out).all()
