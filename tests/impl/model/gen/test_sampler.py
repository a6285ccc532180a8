"""The batched sampler: greedy, temperature, top-k, top-p, stop masks, batch independence."""

import pytest
import torch

from realhf.impl.model.gen.sampler import SamplingBatch, sample


def _batch(B, *, temperature=1.0, greedy=False, top_p=1.0, top_k=-1, uniforms=None, stop_mask=None):
    def full(x, dtype):
        return torch.full((B,), x, dtype=dtype)

    return SamplingBatch(
        temperature=full(temperature, torch.float32),
        greedy=full(greedy, torch.bool),
        top_p=full(top_p, torch.float32),
        top_k=full(top_k, torch.long),
        uniforms=uniforms if uniforms is not None else torch.rand(B),
        stop_mask=stop_mask,
        all_greedy=greedy,
        any_truncation=top_p < 1.0 or top_k > 0,
    )


def _quantile_counts(logits, n=2000, **kw):
    """Sample one row with n evenly spaced uniforms: the histogram is the exact CDF."""
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    toks, lps = sample(logits.expand(n, -1), _batch(n, uniforms=u, **kw))
    return torch.bincount(toks, minlength=logits.shape[-1]).float() / n, toks, lps


def test_greedy_is_argmax_with_logprob_at_temperature_one():
    logits = torch.randn(5, 11)
    toks, lps = sample(logits, _batch(5, greedy=True))
    assert torch.equal(toks, logits.argmax(-1))
    ref = torch.log_softmax(logits, -1).gather(-1, toks[:, None])[:, 0]
    torch.testing.assert_close(lps, ref)


def test_greedy_rows_mixed_with_sampled_rows():
    logits = torch.randn(4, 9)
    b = _batch(4, temperature=0.7)
    b.greedy = torch.tensor([True, False, True, False])
    toks, lps = sample(logits, b)
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()
    torch.testing.assert_close(lps[0], torch.log_softmax(logits[0], -1)[toks[0]])
    torch.testing.assert_close(lps[1], torch.log_softmax(logits[1] / 0.7, -1)[toks[1]])


def test_temperature_sampling_follows_the_tempered_distribution():
    logits = torch.randn(1, 13) * 2
    freq, toks, lps = _quantile_counts(logits, temperature=0.5)
    probs = torch.softmax(logits[0] / 0.5, -1)
    # Inverse-CDF with evenly spaced uniforms reproduces the probabilities to 1/n.
    assert (freq - probs).abs().max() < 2e-3
    torch.testing.assert_close(lps, torch.log_softmax(logits[0] / 0.5, -1)[toks])


def test_top_k_restricts_and_renormalises():
    logits = torch.randn(1, 20)
    freq, toks, lps = _quantile_counts(logits, top_k=3)
    top = logits[0].topk(3).indices
    assert set(toks.tolist()) == set(top.tolist())
    p = torch.softmax(logits[0], -1)
    expect = torch.zeros(20)
    expect[top] = p[top] / p[top].sum()
    assert (freq - expect).abs().max() < 2e-3
    # Logprobs are those before truncation (SGLang's convention).
    torch.testing.assert_close(lps, torch.log_softmax(logits[0], -1)[toks])


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    p = torch.softmax(logits[0], -1)
    top_p = float(p[:2].sum()) + 1e-3  # nucleus = first three tokens
    freq, toks, _ = _quantile_counts(logits, top_p=top_p)
    assert set(toks.tolist()) == {0, 1, 2}
    expect = torch.zeros(6)
    expect[:3] = p[:3] / p[:3].sum()
    assert (freq - expect).abs().max() < 2e-3


def test_top_p_always_keeps_the_most_likely_token():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    _, toks, _ = _quantile_counts(logits, n=100, top_p=0.01)
    assert set(toks.tolist()) == {0}


def test_top_k_one_with_temperature_is_greedy():
    logits = torch.randn(8, 30)
    toks, _ = sample(logits, _batch(8, temperature=1.5, top_k=1))
    assert torch.equal(toks, logits.argmax(-1))


def test_stop_mask_bans_tokens_and_shapes_logprobs():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 10.0
    mask = torch.zeros(1, 5, dtype=torch.bool)
    mask[0, 2] = True
    toks, lps = sample(logits, _batch(1, greedy=True, stop_mask=mask))
    assert toks.item() != 2
    torch.testing.assert_close(lps, torch.tensor([torch.log(torch.tensor(0.25)).item()]))
    freq, _, _ = _quantile_counts(logits, stop_mask=mask.expand(2000, -1))
    assert freq[2] == 0


def test_uniform_near_one_stays_in_range():
    logits = torch.randn(3, 7)
    u = torch.tensor([0.0, 0.9999999, 1.0 - 2**-24])
    toks, _ = sample(logits, _batch(3, top_k=2, uniforms=u))
    assert ((toks >= 0) & (toks < 7)).all()
    for i in range(3):
        assert toks[i] in logits[i].topk(2).indices


def test_row_result_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    u = torch.rand(6)
    b = _batch(6, temperature=0.9, uniforms=u)
    b.top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0])
    b.top_k = torch.tensor([-1, -1, 5, -1, -1, 10])
    b.any_truncation = True
    full, _ = sample(logits, b)
    for i in range(6):
        one = _batch(
            1,
            temperature=0.9,
            top_p=float(b.top_p[i]),
            top_k=int(b.top_k[i]),
            uniforms=u[i : i + 1],
        )
        tok, _ = sample(logits[i : i + 1], one)
        assert tok.item() == full[i].item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_logits_are_upcast(dtype):
    logits = torch.randn(4, 17).to(dtype)
    toks, lps = sample(logits, _batch(4, greedy=True))
    assert lps.dtype == torch.float32
    assert torch.equal(toks, logits.float().argmax(-1))


def _flat_inverse_cdf(probs, u):
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx


def test_a_large_vocabulary_samples_by_blocks_as_by_one_cumulative_sum():
    # Above 4 blocks the inverse CDF goes block sums first, then one block: the same
    # token as one cumulative sum over the row (float64, so no boundary is within rounding).
    from realhf.impl.model.gen.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(0)
    V = 10 * 1024 + 37  # a partial last block
    probs = torch.rand(64, V, generator=g, dtype=torch.float64)
    probs[probs < 0.3] = 0.0  # zeros are never chosen
    probs[:8, : V - 5] = 0.0  # mass only in the partial last block
    probs[8:16, 1:], probs[8:16, 0] = 0.0, 0.5  # only in the first entry
    u = torch.rand(64, generator=g, dtype=torch.float64)
    got = _inverse_cdf(probs, u)
    assert torch.equal(got, _flat_inverse_cdf(probs, u))
    assert (probs.gather(-1, got[:, None]) > 0).all()
    assert (got[8:16] == 0).all() and (got[:8] >= V - 5).all()


def test_a_large_vocabulary_with_a_uniform_near_one_takes_the_last_token_with_mass():
    from realhf.impl.model.gen.sampler import _inverse_cdf

    V = 8 * 1024 + 3
    probs = torch.rand(3, V)
    probs[:, 5000:] = 0.0
    got = _inverse_cdf(probs, torch.tensor([1.0, 1.0 - 2**-24, 0.9999999]))
    assert (got <= 4999).all() and (probs.gather(-1, got[:, None]) > 0).all()
    assert got[0] == 4999  # u = 1: the last entry with mass


@pytest.mark.parametrize("scale", [8.0, 0.01])  # a peaked nucleus (a few tokens), a flat one
def test_top_p_over_a_large_vocabulary_samples_the_nucleus(scale):
    # Peaked rows take the partial sort of their most likely tokens; flat rows (a nucleus
    # of thousands) sort the whole row.  Either way the tokens come from the nucleus, in
    # proportion to their probabilities.
    g = torch.Generator().manual_seed(1)
    V, top_p = 6000, 0.6
    logits = torch.randn(1, V, generator=g) * scale
    p = torch.softmax(logits[0].double(), -1)
    ps, order = p.sort(descending=True, stable=True)
    n_keep = int(((ps.cumsum(0) - ps) < top_p).sum())
    nucleus = order[:n_keep]
    freq, toks, lps = _quantile_counts(logits, n=4000, top_p=top_p)
    assert set(toks.tolist()) <= set(nucleus.tolist())
    expect = torch.zeros(V, dtype=torch.float64)
    expect[nucleus] = p[nucleus] / p[nucleus].sum()
    assert (freq.double() - expect).abs().max() < 2e-3
    torch.testing.assert_close(lps, torch.log_softmax(logits[0], -1)[toks])
    if scale == 0.01:
        assert n_keep > 256  # the flat case is past the candidates


def test_mixed_batch_skips_argmax_only_when_told_there_are_no_greedy_rows():
    logits = torch.randn(4, 50)
    b = _batch(4, temperature=1.0)
    b.unit_temperature = True
    b.any_greedy = False
    t1, l1 = sample(logits, b)
    b.any_greedy, b.unit_temperature = True, False
    t2, l2 = sample(logits, b)
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2)


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties"])
def test_the_nucleus_found_by_its_threshold_is_the_sorted_one(kind):
    from realhf.impl.model.gen.sampler import _nucleus_mask

    g = torch.Generator().manual_seed(3)
    V, R = 5000, 6
    if kind == "ties":  # many equal probabilities: ties are kept in vocabulary order
        logits = torch.randint(0, 4, (R, V), generator=g).float()
    else:
        logits = torch.randn(R, V, generator=g) * (0.05 if kind == "flat" else 6.0)
    probs = torch.softmax(logits, -1)
    top_p = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
    got = _nucleus_mask(probs, top_p)
    vals, order = probs.sort(dim=-1, descending=True, stable=True)
    inside = (vals.cumsum(-1) - vals) < top_p[:, None]
    want = torch.zeros_like(got).scatter_(-1, order, inside)
    assert torch.equal(got, want), (got.sum(-1), want.sum(-1))
