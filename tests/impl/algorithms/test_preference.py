"""Bradley–Terry, DPO and IPO losses against formulas written here independently (fp64)."""

import math
import random

import pytest
import torch

from realhf.impl.algorithms.preference import (
    PreferenceLoss,
    answer_logprob_sums,
    bradley_terry_loss,
    dpo_loss,
    pair_accuracy,
    sequence_last_values,
    split_pairs,
)


def _log_sigmoid(x: float) -> float:
    # −log(1 + e^−x), written per element with the stable branch for negative x
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _rand(n, seed, scale=3.0):
    rng = random.Random(seed)
    return [rng.uniform(-scale, scale) for _ in range(n)]


def _t(xs):
    return torch.tensor(xs, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bradley_terry_loss_matches_the_formula(seed):
    rc, rr = _rand(9, seed), _rand(9, seed + 100)
    rc[0] = rr[0] = 0.5  # a tie: counts as wrong in the accuracy
    rc[1], rr[1] = 40.0, -40.0  # large margins stay finite
    rc[2], rr[2] = -40.0, 40.0
    want = sum(-_log_sigmoid(c - r) for c, r in zip(rc, rr)) / len(rc)
    loss, st = bradley_terry_loss(_t(rc), _t(rr))
    assert float(loss) == pytest.approx(want, abs=1e-6)
    acc = sum(c > r for c, r in zip(rc, rr)) / len(rc)
    assert float(st["pair_acc"]) == pytest.approx(acc, abs=1e-12)
    assert float(pair_accuracy(_t(rc), _t(rr))) == pytest.approx(acc, abs=1e-12)
    assert float(st["margin"]) == pytest.approx(sum(rc) / 9 - sum(rr) / 9, abs=1e-9)


def test_bradley_terry_gradient_pushes_chosen_up_and_rejected_down():
    rc = _t([0.1, -0.2]).requires_grad_()
    rr = _t([0.3, 0.0]).requires_grad_()
    bradley_terry_loss(rc, rr)[0].backward()
    assert (rc.grad < 0).all() and (rr.grad > 0).all()
    # d/dc of −log σ(c − r) / P is −(1 − σ(c − r)) / P
    want = [-(1 - 1 / (1 + math.exp(-(c - r)))) / 2 for c, r in ((0.1, 0.3), (-0.2, 0.0))]
    assert rc.grad.tolist() == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("beta", [0.05, 0.1, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_and_ipo_match_the_formulas(beta, seed):
    n = 7
    pc, pr = _rand(n, seed, 20), _rand(n, seed + 1, 20)
    qc, qr = _rand(n, seed + 2, 20), _rand(n, seed + 3, 20)
    h = [(a - b) - (c - d) for a, c, b, d in zip(pc, pr, qc, qr)]
    want_dpo = sum(-_log_sigmoid(beta * x) for x in h) / n
    want_ipo = sum((x - 1 / (2 * beta)) ** 2 for x in h) / n
    args = (_t(pc), _t(pr), _t(qc), _t(qr), beta)
    loss, st = dpo_loss(*args, PreferenceLoss.DPO)
    assert float(loss) == pytest.approx(want_dpo, abs=1e-6)
    assert float(dpo_loss(*args, "ipo")[0]) == pytest.approx(want_ipo, abs=1e-6)
    assert float(st["reward_acc"]) == pytest.approx(sum(x > 0 for x in h) / n)
    assert float(st["margin"]) == pytest.approx(beta * sum(h) / n, abs=1e-9)
    assert float(st["chosen_reward"]) == pytest.approx(
        beta * sum(a - b for a, b in zip(pc, qc)) / n, abs=1e-9
    )


def test_dpo_at_the_reference_is_log2_and_ipo_is_the_squared_target():
    z = _t([-3.0, -1.5])
    assert float(dpo_loss(z, z - 1, z, z - 1, 0.1)[0]) == pytest.approx(math.log(2), abs=1e-12)
    assert float(dpo_loss(z, z - 1, z, z - 1, 0.5, "ipo")[0]) == pytest.approx(1.0, abs=1e-12)


def test_dpo_rejects_bad_beta_and_loss():
    z = _t([0.0])
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(z, z, z, z, 0.0)
    with pytest.raises(ValueError):
        dpo_loss(z, z, z, z, 0.1, "kto")


def test_answer_logprob_sums_add_only_the_answer_tokens():
    # two sequences: lengths 5 (prompt 2) and 4 (prompt 3); shifted entries: 4 and 3
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    mask = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    logp = _t([-0.1, -0.2, -0.3, -0.4, -1.0, -2.0, -3.0])
    # sequence 0: entries 1..3 predict tokens 2..4 (answer); sequence 1: entry 2 predicts token 3
    want = [-0.2 - 0.3 - 0.4, -3.0]
    assert answer_logprob_sums(logp, cu, mask).tolist() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="L - 1"):
        answer_logprob_sums(logp[:-1], cu, mask)


def test_split_pairs_and_last_values():
    c, r = split_pairs(_t([1.0, 2.0, 3.0, 4.0]))
    assert c.tolist() == [1.0, 3.0] and r.tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="chosen first"):
        split_pairs(_t([1.0, 2.0, 3.0]))
    values = _t([0.0, 1.0, 2.0, 3.0, 4.0])
    assert sequence_last_values(values, torch.tensor([0, 2, 5])).tolist() == [1.0, 4.0]
