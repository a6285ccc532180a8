"""Policy-loss variants against a per-sequence reference written with plain python loops."""

import math

import pytest
import torch

from realhf.impl.algorithms import policy_loss as P

TOL = dict(rel=1e-6, abs=1e-6)


def _case(seed=0, lens=(3, 5, 1, 4)):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    s1 = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    lp = old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) > 0.25
    mask[s1[2]] = False  # the one-token answer has no valid token
    ref = old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)
    ent = torch.rand(n, generator=g, dtype=torch.float64) * 3
    return lp, old, adv, mask, s1, ref, ent


def _seqs(s1):
    return [list(range(int(s1[i]), int(s1[i + 1]))) for i in range(len(s1) - 1)]


def _clip_loss(rho, a, lo, hi):
    return max(-a * rho, -a * min(max(rho, 1 - lo), 1 + hi))


def _aggregate(per_tok, mask, s1, mode, const=1.0):
    """The reference aggregation: per_tok is a python list of token losses."""
    seqs = [[t for t in s if mask[t]] for s in _seqs(s1)]
    seqs = [s for s in seqs if s]
    if mode == "token-mean":
        toks = [t for s in seqs for t in s]
        return sum(per_tok[t] for t in toks) / len(toks)
    if mode == "seq-mean-token-mean":
        return sum(sum(per_tok[t] for t in s) / len(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(per_tok[t] for t in s) for s in seqs) / len(seqs)
    return sum(sum(per_tok[t] for t in s) for s in seqs) / (const * len(seqs))


@pytest.mark.parametrize("mode", list(P.LossAggMode))
def test_clip_higher_and_every_aggregation_mode(mode):
    lp, old, adv, mask, s1, _, _ = _case()
    shape = P.LossShape(eps_clip_high=0.28, loss_agg_mode=mode, loss_agg_constant=7.0)
    loss, _ = P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=shape, short1cu_seqlens=s1)
    rho = [math.exp(a - b) for a, b in zip(lp.tolist(), old.tolist())]
    per_tok = [_clip_loss(r, a, 0.2, 0.28) for r, a in zip(rho, adv.tolist())]
    assert loss.item() == pytest.approx(_aggregate(per_tok, mask.tolist(), s1, mode, 7.0), **TOL)


def test_clip_higher_clips_only_above_at_its_own_bound():
    rho = torch.tensor([0.7, 1.25, 1.35])
    adv = torch.ones(3)
    pg, clipped, _ = P.clipped_surrogate(rho, adv, 0.2, None, eps_clip_high=0.28)
    assert pg.tolist() == pytest.approx([-0.7, -1.25, -1.28])
    assert clipped.tolist() == [False, False, True]
    pg, clipped, _ = P.clipped_surrogate(rho, -adv, 0.2, None, eps_clip_high=0.28)
    assert pg.tolist() == pytest.approx([0.8, 1.25, 1.35])  # A < 0: the low side clips at 0.8


@pytest.mark.parametrize("mode", list(P.LossAggMode))
def test_micro_batches_weighted_by_their_aggregation_count_give_the_whole_batch_loss(mode):
    # The engine's rule: sum over micro-batches of loss_mb * w_mb / sum(w).
    lp, old, adv, mask, s1, _, _ = _case(seed=1, lens=(3, 5, 2, 4, 6, 2))
    shape = P.LossShape(loss_agg_mode=mode, loss_agg_constant=5.0)
    whole, _ = P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=shape, short1cu_seqlens=s1)
    parts, weights = [], []
    for seqs in ([0, 3], [1, 2, 4, 5]):
        idx = torch.cat([torch.arange(int(s1[i]), int(s1[i + 1])) for i in seqs])
        lens = [int(s1[i + 1] - s1[i]) for i in seqs]
        s1_mb = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
        loss, _ = P.actor_loss_fn(
            lp[idx], old[idx], adv[idx], 0.2, mask[idx], shape=shape, short1cu_seqlens=s1_mb
        )
        parts.append(loss.item())
        weights.append(float(P.AGGREGATIONS[mode].count(mask[idx], s1_mb)))
    combined = sum(p * w for p, w in zip(parts, weights)) / sum(weights)
    assert combined == pytest.approx(whole.item(), **TOL)


def test_gspo_sequence_ratio_value_and_gradient():
    lp, old, adv, mask, s1, _, _ = _case(seed=2)
    lp = lp.clone().requires_grad_(True)
    shape = P.LossShape(
        importance_level="sequence", loss_agg_mode="seq-mean-token-mean", eps_clip_high=0.05
    )
    loss, st = P.actor_loss_fn(lp, old, adv, 0.03, mask, shape=shape, short1cu_seqlens=s1)
    loss.backward()
    # reference: one ratio and one (mean) advantage per answer, mean over answers
    lp_ref = lp.detach().clone().requires_grad_(True)
    losses, n_clipped = [], 0
    for s in _seqs(s1):
        v = [t for t in s if mask[t]]
        if not v:
            continue
        s_i = torch.exp(sum(lp_ref[t] - old[t] for t in v) / len(v))
        a_i = sum(adv[t] for t in v) / len(v)
        plain, clip = -a_i * s_i, -a_i * s_i.clamp(1 - 0.03, 1 + 0.05)
        losses.append(torch.maximum(plain, clip))
        n_clipped += int(plain.item() < clip.item())
    ref = sum(losses) / len(losses)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), **TOL)
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-6, rtol=1e-5)
    assert st["seq_clip_ratio"].item() == pytest.approx(n_clipped / len(losses))


@pytest.mark.parametrize("mode, cap, floor", [("mask", 1.3, 0.8), ("truncate", 1.3, None)])
def test_behaviour_weight_mask_with_floor_and_truncation(mode, cap, floor):
    lp, mu, adv, mask, s1, _, _ = _case(seed=3)
    g = torch.Generator().manual_seed(9)
    prox = mu + (torch.rand(mu.shape, generator=g, dtype=torch.float64) - 0.5)
    shape = P.LossShape(behav_imp_weight_mode=mode, behav_imp_weight_floor=floor)
    loss, st = P.actor_loss_fn(
        lp, mu, adv, 0.2, mask, proximal_logprobs=prox, behav_imp_weight_cap=cap, shape=shape
    )
    per_tok, keep, n_trunc = {}, [], 0
    for t in range(len(lp)):
        if not mask[t]:
            continue
        w = math.exp(prox[t] - mu[t])
        if mode == "mask" and not floor <= w <= cap:
            continue
        if mode == "truncate":
            n_trunc += w > cap
            w = min(w, cap)
        per_tok[t] = w * _clip_loss(math.exp(lp[t] - prox[t]), adv[t].item(), 0.2, 0.2)
        keep.append(t)
    assert loss.item() == pytest.approx(sum(per_tok.values()) / len(keep), **TOL)
    if mode == "truncate":
        assert st["behave_truncated_ratio"].item() == pytest.approx(n_trunc / len(keep))
        assert st["behave_mask_dropped"].item() == 0
    else:
        assert st["behave_mask_dropped"].item() == int(mask.sum()) - len(keep)
    with pytest.raises(ValueError, match="truncate"):
        P.behaviour_weight(prox, mu, mask, None, "truncate")


@pytest.mark.parametrize("est", list(P.KLEstimator))
def test_kl_loss_and_entropy_terms(est):
    lp, old, adv, mask, s1, ref, ent = _case(seed=4)
    shape = P.LossShape(
        kl_loss_coef=0.3, kl_estimator=est, entropy_coef=0.01, loss_agg_mode="seq-mean-token-sum"
    )
    loss, st = P.actor_loss_fn(
        lp, old, adv, 0.2, mask, shape=shape, short1cu_seqlens=s1, ref_logprobs=ref, entropy=ent
    )

    def k(d):
        return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[est]

    per_tok = [
        _clip_loss(math.exp(lp[t] - old[t]), adv[t].item(), 0.2, 0.2)
        + 0.3 * k((ref[t] - lp[t]).item())
        - 0.01 * ent[t].item()
        for t in range(len(lp))
    ]
    expect = _aggregate(per_tok, mask.tolist(), s1, "seq-mean-token-sum")
    assert loss.item() == pytest.approx(expect, **TOL)
    valid = [t for t in range(len(lp)) if mask[t]]
    kl_mean = sum(k((ref[t] - lp[t]).item()) for t in valid) / len(valid)
    assert st["kl_loss"].item() == pytest.approx(kl_mean, **TOL)
    assert st["entropy"].item() == pytest.approx(sum(ent[t].item() for t in valid) / len(valid))


def test_missing_inputs_and_bad_options_are_named():
    lp, old, adv, mask, s1, ref, _ = _case()
    with pytest.raises(ValueError, match="short1cu_seqlens"):
        P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=P.LossShape(importance_level="sequence"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=P.LossShape(kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=P.LossShape(entropy_coef=0.1))
    with pytest.raises(ValueError, match="loss_agg_mode='x'"):
        P.LossShape(loss_agg_mode="x")
    with pytest.raises(ValueError, match="behav_imp_weight_floor needs proximal"):
        P.actor_loss_fn(lp, old, adv, 0.2, mask, shape=P.LossShape(behav_imp_weight_floor=0.5))


def test_every_choice_has_its_registered_behaviour_and_parses_from_its_string():
    assert list(P.AGGREGATIONS) == list(P.LossAggMode)
    assert list(P.IMPORTANCE_RATIOS) == list(P.ImportanceLevel)
    for mode, agg in P.AGGREGATIONS.items():
        assert agg.mode is mode and agg.summary
    shape = P.LossShape(importance_level="sequence", loss_agg_mode="constant", kl_estimator="k1")
    assert shape.importance_level is P.ImportanceLevel.SEQUENCE
    assert shape.aggregation is P.AGGREGATIONS[P.LossAggMode.CONSTANT]
    assert shape.loss_agg_mode == "constant" and repr(shape.loss_agg_mode) == "'constant'"
    assert shape.per_sequence and not P.LossShape().per_sequence
    with pytest.raises(ValueError, match=r"kl_estimator='k4': use one of \['k1', 'k2', 'k3'\]"):
        P.LossShape(kl_estimator="k4")
