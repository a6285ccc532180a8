import warnings

import numpy as np
import pytest
import torch

from realhf.impl import kernels as K

needs_cpp = pytest.mark.skipif(
    K._C is None,
    reason="realhf._C not built; run `pip install --no-build-isolation -e .`",
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or K._C_cuda is None,
    reason="needs a CUDA device and realhf._C_cuda (built with a CUDA toolkit and CUDA torch)",
)


def _packed_batch(seed, n_seqs, max_len, dtype=torch.float64, device="cpu", cu_dtype=torch.int32):
    """Random packed GAE inputs; lengths include 0 and 1 on purpose."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (n_seqs,), generator=g)
    lens[: min(n_seqs, 2)] = torch.tensor([0, 1])[: min(n_seqs, 2)]
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(cu_dtype)
    T = int(lens.sum())
    rewards = torch.randn(T, generator=g, dtype=torch.float64).to(dtype)
    values = torch.randn(T + n_seqs, generator=g, dtype=torch.float64).to(dtype)
    bootstrap = torch.rand(n_seqs, generator=g) < 0.5
    return [x.to(device) for x in (rewards, values, cu, bootstrap)]


# ----------------------------------------------------------------------------- GAE


def test_gae_hand_computed():
    # Sequence 0: 3 steps, finished (no bootstrap); sequence 1: empty; sequence 2: one
    # step, truncated, so it bootstraps from its last value 4.0.
    rewards = torch.tensor([1.0, 1.0, 1.0, 2.0])
    values = torch.tensor([0.5, 0.5, 0.5, 9.0, 7.0, 1.0, 4.0])
    cu = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    boot = torch.tensor([False, False, True])
    gamma, lam = 0.5, 0.5
    # seq 0: t=2: d=1-0.5=0.5, A=0.5; t=1: d=1+0.25-0.5=0.75, A=0.75+0.25*0.5=0.875;
    #        t=0: d=0.75, A=0.75+0.25*0.875=0.96875. seq 2: d=2+0.5*4-1=3.
    want_adv = [0.96875, 0.875, 0.5, 3.0]
    want_ret = [1.46875, 1.375, 1.0, 4.0]
    for fn in (K.gae_packed, K.gae_packed_reference, K.gae_packed_naive):
        adv, ret = fn(rewards, values, cu, boot, gamma, lam)
        assert adv.tolist() == want_adv and ret.tolist() == want_ret, fn.__name__


@pytest.mark.parametrize("seed", range(8))
def test_gae_reference_matches_naive_loop(seed):
    args = _packed_batch(seed, n_seqs=int(1 + seed * 5), max_len=20)
    gamma, lam = 0.99, 0.95
    for a, b in zip(
        K.gae_packed_reference(*args, gamma, lam), K.gae_packed_naive(*args, gamma, lam)
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed,n_seqs,max_len", [(0, 1, 1), (1, 7, 3), (2, 64, 50), (3, 2000, 100)])
def test_gae_kernel_matches_reference(dtype, cu_dtype, seed, n_seqs, max_len):
    args = _packed_batch(seed, n_seqs, max_len, dtype=dtype, cu_dtype=cu_dtype)
    got = K.gae_packed(*args, 1.0, 0.9)
    want = K.gae_packed_reference(*args, 1.0, 0.9)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b)


@needs_cpp
def test_gae_kernel_low_precision_and_empty_batch():
    args = _packed_batch(5, 40, 30, dtype=torch.bfloat16)
    adv, ret = K.gae_packed(*args, 0.99, 0.95)
    ref = K.gae_packed_reference(args[0].float(), args[1].float(), *args[2:], 0.99, 0.95)
    assert adv.dtype == torch.bfloat16
    torch.testing.assert_close(adv.float(), ref[0].bfloat16().float())
    empty = (
        torch.zeros(0),
        torch.zeros(0),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.bool),
    )
    assert [x.numel() for x in K.gae_packed(*empty, 1.0, 1.0)] == [0, 0]
    only_empty_seqs = (
        torch.zeros(0),
        torch.ones(3),
        torch.zeros(4, dtype=torch.int32),
        torch.ones(3, dtype=torch.bool),
    )
    assert [x.numel() for x in K.gae_packed(*only_empty_seqs, 1.0, 1.0)] == [0, 0]


def test_gae_errors_say_what_is_wrong():
    r, v, cu, b = _packed_batch(0, 4, 5, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"values must have T \+ B"):
        K.gae_packed(r, v[:-1], cu, b, 1.0, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T"):
        K.gae_packed(r, v, cu + 1, b, 1.0, 1.0)
    with pytest.raises(ValueError, match="bootstrap has 3 entries for 4 sequences"):
        K.gae_packed(r, v, cu, b[:3], 1.0, 1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens decreases at sequence 1: \[3, 1\]"):
        bad = torch.tensor([0, 3, 1, int(r.numel()), int(r.numel())], dtype=torch.int32)
        K.gae_packed(r, v, bad, b, 1.0, 1.0)
    with pytest.raises(ValueError, match="share a float dtype"):
        K.gae_packed(r, v.double(), cu, b, 1.0, 1.0)


# ----------------------------------------------------------------------------- intervals


def _random_intervals(rng, size, n, disjoint):
    if disjoint:
        cuts = np.sort(rng.choice(size + 1, size=2 * n, replace=False))
        iv = cuts.reshape(n, 2)
        empty = rng.random(n) < 0.1  # a few empty ones
        iv[empty, 1] = iv[empty, 0]
        return iv[rng.permutation(n)]  # any order
    s = rng.integers(0, size, size=n)
    e = np.minimum(size, s + rng.integers(0, 300, size=n))
    return np.stack([s, e], 1)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size,n", [(10, 3), (5000, 200), (3_000_000, 4000)])
def test_slice_and_set_match_reference(dtype, size, n):
    rng = np.random.default_rng(size + n)
    src = torch.randn(size).to(dtype)
    # Slice: overlapping and empty intervals are fine.
    iv = _random_intervals(rng, size, n, disjoint=False)
    torch.testing.assert_close(
        K.slice_intervals(src, iv), K.slice_intervals_reference(src, iv), rtol=0, atol=0
    )
    # Set: disjoint intervals, then slicing them back gives the pieces.
    iv = _random_intervals(rng, size, min(n, size // 2), disjoint=True)
    pieces = torch.randn(int((iv[:, 1] - iv[:, 0]).sum())).to(dtype)
    dst, dst_ref = src.clone(), src.clone()
    assert K.set_intervals(pieces, dst, iv) is dst
    K.set_intervals_reference(pieces, dst_ref, iv)
    assert torch.equal(dst, dst_ref)
    assert torch.equal(K.slice_intervals(dst, torch.from_numpy(iv)), pieces)


@needs_cpp
def test_large_copies_take_the_streaming_path():
    # Over 32 MiB moved: the kernel switches to non-temporal stores; odd offsets exercise
    # the unaligned head and tail of every piece.
    rng = np.random.default_rng(3)
    src = torch.randn(1 << 24)
    bounds = np.concatenate(
        [[0], np.sort(rng.choice(src.numel(), 2999, replace=False)), [src.numel()]]
    )
    iv = np.stack([np.minimum(bounds[:-1] + 1, bounds[1:]), bounds[1:]], 1)[rng.permutation(3000)]
    assert (iv[:, 1] - iv[:, 0]).sum() * 4 > 32 << 20
    sliced = K.slice_intervals(src, iv)
    assert torch.equal(sliced, K.slice_intervals_reference(src, iv))
    dst, dst_ref = torch.zeros_like(src), torch.zeros_like(src)
    K.set_intervals(sliced, dst, iv)
    K.set_intervals_reference(sliced, dst_ref, iv)
    assert torch.equal(dst, dst_ref)


@needs_cpp
def test_slice_into_out_and_list_intervals():
    src = torch.arange(20.0)
    out = torch.empty(6)
    assert K.slice_intervals(src, [(2, 5), (10, 12), (12, 12), (0, 1)], out=out) is out
    assert out.tolist() == [2, 3, 4, 10, 11, 0]
    assert K.slice_intervals(src, []).numel() == 0
    with pytest.raises(ValueError, match="out must hold 7"):
        K.slice_intervals(src, [(2, 5), (10, 14)], out=out)


def test_interval_errors_name_the_interval():
    src = torch.zeros(10)
    with pytest.raises(
        ValueError, match=r"interval 1 = \[4, 11\) must satisfy 0 <= start <= end <= 10"
    ):
        K.slice_intervals(src, [(0, 2), (4, 11)])
    with pytest.raises(ValueError, match=r"interval 0 = \[5, 3\)"):
        K.set_intervals(torch.zeros(0), src, [(5, 3)])
    with pytest.raises(ValueError, match="src has 3 elements but the intervals cover 2"):
        K.set_intervals(torch.zeros(3), src, [(0, 2)])
    with pytest.raises(ValueError, match="src is torch.float16"):
        K.set_intervals(torch.zeros(2, dtype=torch.float16), src, [(0, 2)])
    with pytest.raises(ValueError, match=r"shape \[N, 2\]"):
        K.slice_intervals(src, [1, 2, 3])


def test_merge_intervals():
    iv = [(0, 2), (2, 4), (5, 6), (6, 6), (6, 9), (1, 2), (2, 3)]
    want = [(0, 4), (5, 9), (1, 3)]
    assert K.merge_intervals(iv) == want
    assert K.merge_intervals_reference(iv) == want
    assert K.merge_intervals(torch.tensor(iv)).tolist() == [list(p) for p in want]
    assert K.merge_intervals([]) == []
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 50))
        ends = np.cumsum(rng.integers(0, 3, size=n + 1))  # many touching intervals
        iv = [(int(ends[i]), int(ends[i + 1])) for i in range(n)]
        rng.shuffle(iv[: n // 2])
        merged = K.merge_intervals(iv)
        assert merged == K.merge_intervals_reference(iv)
        src = torch.arange(float(ends[-1]) + 1)
        assert torch.equal(K.slice_intervals(src, merged), K.slice_intervals(src, iv))


# ----------------------------------------------------------------------------- fallback


def test_fallback_warns_once_and_matches(monkeypatch):
    args = _packed_batch(3, 20, 10, dtype=torch.float32)
    monkeypatch.setattr(K, "_C", None)
    monkeypatch.setattr(K, "_warned", False)
    assert K.backend("cpu") == "reference"
    with pytest.warns(RuntimeWarning, match="pure-PyTorch references"):
        adv, ret = K.gae_packed(*args, 0.9, 0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        out = K.slice_intervals(torch.arange(10.0), [(1, 3), (7, 9)])
        dst = K.set_intervals(torch.ones(2), torch.zeros(10), [(4, 6)])
        merged = K.merge_intervals([(0, 1), (1, 2)])
    assert out.tolist() == [1, 2, 7, 8] and dst[4:6].tolist() == [1, 1] and merged == [(0, 2)]
    for a, b in zip((adv, ret), K.gae_packed_naive(*args, 0.9, 0.8)):
        torch.testing.assert_close(a, b)


@needs_cpp
def test_backend_reports_cpp():
    assert K.backend("cpu") == "cpp"


@pytest.mark.gpu
@needs_cuda
def test_cuda_kernels_match_reference():
    args = _packed_batch(7, 500, 200, dtype=torch.float32, device="cuda")
    for a, b in zip(K.gae_packed(*args, 0.99, 0.95), K.gae_packed_reference(*args, 0.99, 0.95)):
        torch.testing.assert_close(a, b)
    rng = np.random.default_rng(0)
    src = torch.randn(1_000_000, device="cuda", dtype=torch.bfloat16)
    iv = _random_intervals(rng, src.numel(), 3000, disjoint=True)
    sliced = K.slice_intervals(src, iv)
    assert torch.equal(sliced, K.slice_intervals_reference(src, iv))
    dst = torch.zeros_like(src)
    K.set_intervals(sliced, dst, iv)
    assert torch.equal(K.slice_intervals(dst, iv), sliced)
