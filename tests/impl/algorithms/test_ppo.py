"""PPO maths against hand-computed values (see the comments for the arithmetic)."""

import math

import pytest
import torch

from realhf.impl.algorithms import ppo as F


def test_packed_rewards_kl_and_terminal_score():
    # shifted lengths 2 and 3
    s1cu = torch.tensor([0, 2, 5])
    lp = torch.tensor([-1.0, -2.0, -1.0, -1.0, -3.0])
    ref = torch.tensor([-1.5, -2.0, -0.5, -1.0, -1.0])
    score = torch.tensor([3.0, -10.0])
    no_eos = torch.tensor([False, True])
    # lp - ref = [0.5, 0, -0.5, 0, -2]  ->  kl = -0.5 * that
    kl, tot = F.get_packed_rewards(0.5, 5.0, lp, ref, score, s1cu, no_eos)
    assert kl.tolist() == pytest.approx([-0.25, 0.0, 0.25, 0.0, 1.0])
    assert tot.tolist() == pytest.approx([-0.25, 3.0, 0.25, 0.0, -4.0])  # -10 clipped to -5
    _, tot = F.get_packed_rewards(
        0.5, 5.0, lp, ref, score, s1cu, no_eos, mask_no_eos_with_zero=True
    )
    assert tot.tolist() == pytest.approx([-0.25, 3.0, 0.25, 0.0, 1.0])
    mask = torch.tensor([False, True, True, True, True])
    kl, tot = F.get_packed_rewards(0.5, 5.0, lp, ref, score, s1cu, no_eos, loss_mask=mask)
    assert kl[0].item() == 0.0 and tot[0].item() == 0.0
    with pytest.raises(ValueError, match=r"must both be \[B\] = \[2\]"):
        F.get_packed_rewards(0.5, 5.0, lp, ref, score[:1], s1cu, no_eos)
    with pytest.raises(ValueError, match="length 0"):
        no_eos3 = torch.zeros(3, dtype=torch.bool)
        F.get_packed_rewards(0.5, 5.0, lp, ref, torch.zeros(3), torch.tensor([0, 2, 2, 5]), no_eos3)


def test_gae_two_sequences_one_truncated():
    # seq A ends with EOS: rewards [1, 2], values [0.5, 1, 3]; gamma 0.9, lam 0.8 (gamma*lam = 0.72)
    #   t=1: delta = 2 + 0 - 1 = 1            A1 = 1
    #   t=0: delta = 1 + 0.9*1 - 0.5 = 1.4    A0 = 1.4 + 0.72*1 = 2.12
    # seq B truncated (bootstraps from V3 = 4): rewards [0.5, 0, 1], values [1, 2, 0.5, 4]
    #   t=2: delta = 1 + 0.9*4 - 0.5 = 4.1    A2 = 4.1
    #   t=1: delta = 0 + 0.9*0.5 - 2 = -1.55  A1 = -1.55 + 0.72*4.1 = 1.402
    #   t=0: delta = 0.5 + 0.9*2 - 1 = 1.3    A0 = 1.3 + 0.72*1.402 = 2.30944
    rewards = torch.tensor([1.0, 2.0, 0.5, 0.0, 1.0])
    values = torch.tensor([0.5, 1.0, 3.0, 1.0, 2.0, 0.5, 4.0])
    adv, ret = F.compute_gae(
        rewards, values, torch.tensor([0, 2, 5]), torch.tensor([False, True]), 0.9, 0.8
    )
    assert adv.tolist() == pytest.approx([2.12, 1.0, 2.30944, 1.402, 4.1], abs=1e-5)
    assert ret.tolist() == pytest.approx([2.62, 2.0, 3.30944, 3.402, 4.6], abs=1e-5)
    adv64, _ = F.compute_gae(
        rewards.double(), values.double(), torch.tensor([0, 2, 5]), torch.tensor([0, 1]), 0.9, 0.8
    )
    assert adv64.dtype == torch.float64 and adv64.tolist() == pytest.approx(adv.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match=r"values must be \[T' \+ B\] = \[7\]"):
        F.compute_gae(
            rewards, values[:6], torch.tensor([0, 2, 5]), torch.tensor([False, True]), 0.9, 0.8
        )


def test_global_advantage_normalisation():
    adv = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mask = torch.tensor([True, True, True, False])
    std = math.sqrt(2.0 / 3.0)
    out = F.normalize_advantages(adv, mask)
    assert out.tolist() == pytest.approx([-1 / (std + 1e-5), 0.0, 1 / (std + 1e-5), 0.0])


def test_group_normalisation_per_block_of_sequences():
    # 4 sequences (shifted lengths 1, 2, 1, 1), groups of 2
    s1cu = torch.tensor([0, 1, 3, 4, 5])
    adv = torch.tensor([1.0, 3.0, 5.0, 2.0, 2.0])
    out = F.group_normalize_advantages(adv, torch.ones(5, dtype=torch.bool), s1cu, group_size=2)
    std = math.sqrt(8.0 / 3.0)  # group 0 tokens [1, 3, 5]: mean 3
    assert out.tolist() == pytest.approx([-2 / (std + 1e-5), 0.0, 2 / (std + 1e-5), 0.0, 0.0])
    # a masked token leaves its group's statistics: group 0 is then [1, 3], mean 2, std 1
    mask = torch.tensor([True, True, False, True, True])
    out = F.group_normalize_advantages(adv, mask, s1cu, group_size=2)
    assert out.tolist() == pytest.approx([-1 / (1 + 1e-5), 1 / (1 + 1e-5), 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="4 sequences cannot be cut into groups of group_size=3"):
        F.group_normalize_advantages(adv, mask, s1cu, group_size=3)


def _actor_case():
    # ratios rho = [1.5, 0.5, 1.1, 5, x] (mu_b = 0), A = [1, -2, 0.5, -1, 7], eps 0.2, last masked
    #   t0: max(-1.5, -1.2) = -1.2 (clipped)    t1: max(1.0, 1.6) = 1.6 (clipped)
    #   t2: max(-0.55, -0.55) = -0.55           t3: max(5, 1.2) = 5; dual clip c=3 -> 3
    rho = torch.tensor([1.5, 0.5, 1.1, 5.0, 9.0])
    lp = torch.log(rho).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5, -1.0, 7.0])
    mask = torch.tensor([True, True, True, True, False])
    return lp, torch.zeros(5), adv, mask


def test_actor_loss_clip_and_dual_clip():
    lp, old, adv, mask = _actor_case()
    loss, st = F.actor_loss_fn(lp, old, adv, 0.2, mask)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 0.55 + 5.0) / 4)
    assert st["clip_ratio"].item() == pytest.approx(0.5) and st["n_valid_tokens"].item() == 4
    assert st["importance_weight"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 5.0) / 4)
    loss.backward()
    # only unclipped tokens carry gradient: d/dlp (-A rho)/4 = -A rho / 4
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5 * 1.1 / 4, 1.0 * 5.0 / 4, 0.0])
    lp, old, adv, mask = _actor_case()
    loss, st = F.actor_loss_fn(lp, old, adv, 0.2, mask, c_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 0.55 + 3.0) / 4)
    assert st["dual_clip_ratio"].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="c_clip must be > 1"):
        F.actor_loss_fn(lp, old, adv, 0.2, mask, c_clip=0.5)


def test_actor_loss_early_stop_zeroes_the_loss_and_its_gradient():
    lp, old, adv, mask = _actor_case()  # mean ratio over valid tokens = 2.025
    loss, st = F.actor_loss_fn(lp, old, adv, 0.2, mask, early_stop_imp_ratio=2.0)
    loss.backward()
    assert loss.item() == 0.0 and st["early_stopped"].item() == 1.0 and not lp.grad.any()
    loss, st = F.actor_loss_fn(lp, old, adv, 0.2, mask, early_stop_imp_ratio=3.0)
    assert loss.item() != 0.0 and st["early_stopped"].item() == 0.0


def test_actor_loss_terms_are_local_sums_and_the_finish_takes_the_given_ratio():
    lp, old, adv, mask = _actor_case()
    t = F.actor_loss_terms(lp, old, adv, 0.2, mask)
    assert t.loss_sum.item() == pytest.approx(-1.2 + 1.6 - 0.55 + 5.0) and t.n_valid.item() == 4
    assert t.ratio_totals().tolist() == pytest.approx([1.5 + 0.5 + 1.1 + 5.0, 4.0])
    assert t.ratio_totals().dtype == torch.float64 and not t.ratio_sum.requires_grad
    # the same micro-batch, but other ranks pulled the global mean ratio to 9 / 6 = 1.5
    loss, st = F.actor_loss_from_terms(t, torch.tensor([9.0, 6.0], dtype=torch.float64), 1.4)
    assert st["importance_weight"].item() == pytest.approx(1.5)
    assert st["early_stopped"].item() == 1.0 and loss.item() == 0.0
    loss, st = F.actor_loss_from_terms(t, torch.tensor([9.0, 6.0], dtype=torch.float64), 1.6)
    assert loss.item() == pytest.approx((-1.2 + 1.6 - 0.55 + 5.0) / 4)
    assert st["early_stopped"].item() == 0.0 and st["n_valid_tokens"].item() == 4
    # the pieces: clipped / dual-clipped surrogate and the behaviour weight
    rho = torch.tensor([1.5, 0.5, 1.1, 5.0])
    pg, clipped, dual = F.clipped_surrogate(rho, adv[:4], 0.2, 3.0)
    assert pg.tolist() == pytest.approx([-1.2, 1.6, -0.55, 3.0])
    assert clipped.tolist() == [True, True, False, False]
    assert dual.tolist() == [False, False, False, True]
    w, dropped = F.behaviour_weight(
        torch.log(torch.tensor([1.0, 2.0, 10.0])),
        torch.zeros(3),
        torch.tensor([True, True, False]),
        cap=1.5,
    )
    assert w.tolist() == pytest.approx([1.0, 2.0, 1.0])  # masked token: weight 1
    assert dropped.tolist() == [False, True, False]


def test_normalisation_from_given_moments_equals_the_whole_batch():
    from realhf.impl.model.utils.functional import masked_moments

    x = torch.tensor([1.0, 2.0, 3.0, 50.0, 7.0, -4.0])
    mask = torch.tensor([True, True, True, False, True, True])
    m = masked_moments(x[:3], mask[:3]) + masked_moments(x[3:], mask[3:])
    assert m.tolist() == pytest.approx([9.0, 79.0, 5.0])
    parts = [F.normalize_advantages(x[s], mask[s], moments=m) for s in (slice(0, 3), slice(3, 6))]
    assert torch.cat(parts).tolist() == pytest.approx(F.normalize_advantages(x, mask).tolist())
    a, b = F.ExponentialRunningMeanStd(beta=0.5), F.ExponentialRunningMeanStd(beta=0.5)
    a.update(x, mask)
    b.update_from_moments(m)
    assert torch.equal(torch.stack(a.mean_std()), torch.stack(b.mean_std()))
    b.update_from_moments(torch.zeros(3, dtype=torch.float64))  # empty batch: no-op
    assert torch.equal(torch.stack(a.mean_std()), torch.stack(b.mean_std()))


def test_decoupled_loss_weights_and_caps_behaviour_ratio():
    # behaviour weights w = exp(pi_prox - mu_b) = [1, 2, 0.5, 10, 1]; rho as before w.r.t. pi_prox
    _, _, adv, mask = _actor_case()
    w = torch.tensor([1.0, 2.0, 0.5, 10.0, 1.0])
    rho = torch.tensor([1.5, 0.5, 1.1, 5.0, 9.0])
    mu_b = torch.tensor([-1.0, -0.3, -2.0, -0.7, -1.0])
    prox = mu_b + torch.log(w)
    lp = prox + torch.log(rho)
    loss, st = F.actor_loss_fn(lp, mu_b, adv, 0.2, mask, proximal_logprobs=prox)
    assert loss.item() == pytest.approx((-1.2 * 1 + 1.6 * 2 - 0.55 * 0.5 + 5.0 * 10) / 4, rel=1e-5)
    loss, st = F.actor_loss_fn(
        lp, mu_b, adv, 0.2, mask, proximal_logprobs=prox, behav_imp_weight_cap=5.0
    )
    assert loss.item() == pytest.approx((-1.2 + 1.6 * 2 - 0.55 * 0.5) / 3, rel=1e-5)
    assert st["behave_mask_dropped"].item() == 1 and st["n_valid_tokens"].item() == 3
    assert st["behave_imp_weight"].item() == pytest.approx((1 + 2 + 0.5) / 3, rel=1e-5)
    # without proximal log-probs the decoupled loss is classic PPO on mu_b
    l_classic, _ = F.actor_loss_fn(lp, prox, adv, 0.2, mask)
    l_same, _ = F.actor_loss_fn(lp, prox, adv, 0.2, mask, proximal_logprobs=prox)
    assert l_classic.item() == pytest.approx(l_same.item())
    with pytest.raises(ValueError, match="behav_imp_weight_cap needs proximal_logprobs"):
        F.actor_loss_fn(lp, mu_b, adv, 0.2, mask, behav_imp_weight_cap=5.0)


def test_critic_loss_hand_computed():
    # t0: V moves 0.2 (< eps 0.5): 0.5*(1-1.5)^2 = 0.125 both terms
    # t1: V=2, V_old=0 -> clipped 0.5; plain 0.5*0.25 = 0.125, clipped 0.5*4 = 2 -> 2 (clip wins)
    v = torch.tensor([1.0, 2.0, 0.0], requires_grad=True)
    old = torch.tensor([0.8, 0.0, 0.0])
    ret = torch.tensor([1.5, 2.5, 9.0])
    mask = torch.tensor([True, True, False])
    loss, st = F.critic_loss_fn(v, old, ret, 0.5, mask)
    assert loss.item() == pytest.approx((0.125 + 2.0) / 2) and st["clip_ratio"].item() == 0.5
    loss.backward()
    assert v.grad.tolist() == pytest.approx(
        [(1.0 - 1.5) / 2, 0.0, 0.0]
    )  # clipped term has no grad in V


def test_value_normaliser_ema_debiased_floor_clip_and_state():
    n = F.ExponentialRunningMeanStd(beta=0.5)
    n.update(torch.tensor([1.0, 3.0]))  # mean 2, mean_sq 5, debias 0.5 -> mean 2, var 1
    m, s = n.mean_std()
    assert (m.item(), s.item()) == pytest.approx((2.0, 1.0))
    n.update(torch.tensor([4.0, 100.0]), mask=torch.tensor([True, False]))
    # rm = .5*1 + .5*4 = 2.5; rsq = .5*2.5 + .5*16 = 9.25; debias .75
    mean, msq = 2.5 / 0.75, 9.25 / 0.75
    m, s = n.mean_std()
    assert (m.item(), s.item()) == pytest.approx((mean, math.sqrt(msq - mean * mean)))
    x = torch.tensor([mean + s.item(), 1e6])
    assert n.normalize(x).tolist() == pytest.approx([1.0, 5.0])  # clipped at 5
    assert n.denormalize(torch.tensor([1.0])).item() == pytest.approx(mean + s.item())
    restored = F.ExponentialRunningMeanStd(beta=0.5)
    restored.load_state_dict(n.state_dict())
    assert restored.mean_std()[0].item() == pytest.approx(mean)
    flat = F.ExponentialRunningMeanStd()
    flat.update(torch.tensor([1.0, 1.0]))
    assert flat.mean_std()[0].item() == pytest.approx(1.0)
    assert flat.mean_std()[1].item() == pytest.approx(0.1)  # var floored at 1e-2
    d = F.ExponentialRunningMeanStd()  # default beta: one update is fully debiased
    d.update(torch.tensor([1.0, 3.0]))
    assert [t.item() for t in d.mean_std()] == pytest.approx([2.0, 1.0])


def test_kl_controllers():
    f = F.FixedKLController(0.1)
    f.update(100.0, 10)
    assert f.value == 0.1
    a = F.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    a.update(12.0, 1000)  # error 1 clipped to 0.2 -> x(1 + 0.02)
    assert a.value == pytest.approx(0.102)
    a.update(6.6, 1000)  # error 0.1 -> x1.01
    assert a.value == pytest.approx(0.102 * 1.01)
    a.update(0.0, 1000)  # error -1 clipped to -0.2 -> x0.98
    assert a.value == pytest.approx(0.102 * 1.01 * 0.98)
    with pytest.raises(ValueError, match="target > 0"):
        F.AdaptiveKLController(0.1, target=0.0)


_DIST_CHILD = """
import json, sys, torch, torch.distributed as dist
from realhf.impl.algorithms import ppo as F
from realhf.impl.model.interface.helpers import all_reduce_sum
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.ppo.ppo_interface import policy_loss
from realhf.impl.model.utils.functional import masked_moments
rank, init_file = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
g = dist.group.WORLD
full = torch.tensor([1.0, 2.0, 3.0, 50.0, 7.0, -4.0])
full_mask = torch.tensor([True, True, True, False, True, True])
half = slice(0, 3) if rank == 0 else slice(3, 6)
# the reductions the interfaces run around the pure functions (ppo_data, critic_interface)
moments = all_reduce_sum(masked_moments(full[half], full_mask[half]), g)
out = {"adv": F.normalize_advantages(full[half], full_mask[half], moments=moments).tolist()}
n = F.ExponentialRunningMeanStd(beta=0.5)
n.update_from_moments(moments)
out["value_norm"] = [t.item() for t in n.mean_std()]
# rank 0: ratios [1, 1], rank 1: [4]; locally only rank 1 exceeds 1.9, the token mean over
# both ranks (6 / 3 = 2) exceeds it too, so both ranks stop
rho = torch.ones(2) if rank == 0 else torch.full((1,), 4.0)
hp = PPOHyperparameters(eps_clip=10.0, early_stop_imp_ratio=1.9)
loss, st = policy_loss(hp, torch.log(rho), torch.zeros_like(rho), torch.ones_like(rho),
                       torch.ones_like(rho, dtype=torch.bool), None, g)
out["early_stopped"] = st["early_stopped"].item()
out["importance_weight"] = st["importance_weight"].item()
out["loss"] = loss.item()
print(json.dumps(out))
dist.destroy_process_group()
from realhf.base import shutdown
shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)
"""


@pytest.mark.slow
def test_statistics_all_reduce_over_two_gloo_ranks(tmp_path):
    import json
    import subprocess
    import sys

    init = tmp_path / "pg_init"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DIST_CHILD, str(r), str(init)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    full = torch.tensor([1.0, 2.0, 3.0, 50.0, 7.0, -4.0])
    mask = torch.tensor([True, True, True, False, True, True])
    expect = F.normalize_advantages(full, mask).tolist()
    assert outs[0]["adv"] + outs[1]["adv"] == pytest.approx(expect, abs=1e-6)
    valid = full[mask].double()
    for o in outs:
        assert o["value_norm"] == pytest.approx(
            [valid.mean().item(), valid.std(unbiased=False).item()]
        )
        assert o["early_stopped"] == 1.0 and o["importance_weight"] == pytest.approx(2.0)
        assert o["loss"] == 0.0
