"""rw and dpo interfaces on a tiny random model: the losses they report are the reference
formulas of the model's own outputs, and a few steps on a fixed batch fit it."""

import math

import pytest
import torch
from interface_testlib import with_keys

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.registry import make_interface
from realhf.base import stats_tracker
from realhf.impl.model.interface import dpo_interface, rw_interface  # noqa: F401  (register)

MB = MicroBatchSpec(max_tokens_per_mb=64)
# (prompt, answer) in pair order: chosen first, then rejected
PAIRS = [
    ("Compute 12+30.", "\\boxed{42}"),
    ("Compute 12+30.", "\\boxed{43}"),
    ("Compute 9*9.", "\\boxed{81}"),
    ("Compute 9*9.", "\\boxed{18}"),
    ("Compute 50-8.", "\\boxed{42}"),
    ("Compute 50-8.", "\\boxed{32}"),
]


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _pairs(pa_sample):
    return pa_sample(PAIRS, group=2)


def _answer_logprob(net, data):
    """log π(answer | prompt) of each sequence, one sequence at a time (fp64 sums)."""
    out = []
    ids, mask = data.data["packed_input_ids"], data.data["prompt_mask"]
    cu = data.cu_seqlens("packed_input_ids").tolist()
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            x = ids[a:b]
            logp = net(x, torch.tensor([0, b - a], dtype=torch.int32)).double().log_softmax(-1)
            out.append(sum(float(logp[t - 1, x[t]]) for t in range(1, b - a) if not mask[a + t]))
    return out


def test_rw_evaluate_and_train_step_use_the_bradley_terry_formula(make_model, pa_sample):
    stats_tracker.reset()
    model = make_model("reward", is_critic=True, lr=1e-3)
    data = _pairs(pa_sample)
    rw = make_interface("rw")
    net = model.module.model
    cu = data.cu_seqlens("packed_input_ids").tolist()
    with torch.no_grad():
        r = [
            float(net(data.data["packed_input_ids"][a:b], torch.tensor([0, b - a]))[-1])
            for a, b in zip(cu[:-1], cu[1:])
        ]
    want = sum(-_log_sigmoid(r[i] - r[i + 1]) for i in (0, 2, 4)) / 3
    acc = sum(r[i] > r[i + 1] for i in (0, 2, 4)) / 3
    ev = rw.evaluate(model, data, MB)
    assert ev["rw_eval/loss"] == pytest.approx(want, abs=1e-5)
    assert ev["rw_eval/pair_acc"] == pytest.approx(acc)
    inf = rw.inference(model, data, MB)
    assert inf.data["rewards"].tolist() == pytest.approx(r, abs=1e-5)
    losses = []
    for _ in range(10):
        st = rw.train_step(model, data, MB)
        losses.append(st["rw/loss"])
    assert losses[0] == pytest.approx(want, abs=1e-5)  # the loss before the first update
    assert losses[-1] < losses[0] - 0.2 and st["rw/n_pairs"] == 3
    assert rw.evaluate(model, data, MB)["rw_eval/pair_acc"] == 1.0
    assert model.version.global_step == 10


def test_rw_lm_coef_adds_the_chosen_answers_language_model_loss(make_model, pa_sample):
    stats_tracker.reset()
    data = _pairs(pa_sample)
    lm = make_model("actor", train=False).module.model
    model = make_model("reward", is_critic=True, critic_lm_logits=True, lr=1e-3)
    net = model.module.model
    cu = data.cu_seqlens("packed_input_ids").tolist()
    mask = data.data["prompt_mask"]
    with torch.no_grad():
        r = [
            float(net(data.data["packed_input_ids"][a:b], torch.tensor([0, b - a]))[-1, 0])
            for a, b in zip(cu[:-1], cu[1:])
        ]
    bt = sum(-_log_sigmoid(r[i] - r[i + 1]) for i in (0, 2, 4)) / 3
    # mean NLL of the chosen answers' tokens (EOS included), from the plain LM of the same
    # weights: the critic's logits are the LM's
    logp = _answer_logprob(lm, data)
    n_tok = [int((~mask[a + 1 : b].bool()).sum()) for a, b in zip(cu[:-1], cu[1:])]
    nll = -sum(logp[i] for i in (0, 2, 4)) / sum(n_tok[i] for i in (0, 2, 4))
    rw = make_interface("rw", lm_coef=2.0)
    assert rw.evaluate(model, data, MB)["rw_eval/loss"] == pytest.approx(bt, abs=1e-5)
    st = rw.train_step(model, data, MB)
    assert st["rw/bt_loss"] == pytest.approx(bt, abs=1e-5)
    assert st["rw/lm_loss"] == pytest.approx(nll, abs=1e-5)
    assert st["rw/loss"] == pytest.approx(bt + 2.0 * nll, abs=1e-5)
    for _ in range(10):
        last = rw.train_step(model, data, MB)
    assert last["rw/lm_loss"] < st["rw/lm_loss"] - 1.0 and last["rw/bt_loss"] < bt - 0.1
    inf = rw.inference(model, data, MB)  # rewards are column 0 of the two-headed output
    assert inf.data["rewards"].shape == (6,)


def test_rw_lm_coef_needs_a_model_with_logits(make_model, pa_sample):
    with pytest.raises(ValueError, match="critic_lm_logits=True"):
        make_interface("rw", lm_coef=1.0).train_step(
            make_model("reward", is_critic=True), _pairs(pa_sample), MB
        )
    with pytest.raises(ValueError, match="lm_coef=-1"):
        make_interface("rw", lm_coef=-1)


def test_rw_refuses_items_that_are_not_pairs(make_model, pa_sample):
    model = make_model("reward", is_critic=True)
    with pytest.raises(ValueError, match="items of 2 sequences"):
        make_interface("rw").train_step(model, pa_sample(PAIRS[:3], group=3), MB)


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_dpo_train_step_matches_the_formula_and_raises_the_margin(make_model, pa_sample, loss):
    stats_tracker.reset()
    beta = 0.5
    data = _pairs(pa_sample)
    dpo = make_interface("dpo", beta=beta, loss=loss)
    ref = make_model("ref", train=False)
    ref_lp = dpo.inference(ref, data, MB)  # ref_inf: next-token log-probs, L - 1 per sequence
    assert ref_lp.seqlens["logprobs"] == [
        [l - 1 for l in x] for x in data.seqlens["packed_input_ids"]
    ]
    train = with_keys(data, packed_ref_logprobs=ref_lp.data["logprobs"])
    actor = make_model("actor", lr=1e-2)
    # perturb the policy so that it differs from the reference before the first step
    with torch.no_grad():
        for p in actor.module.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    pi, q = _answer_logprob(actor.module.model, data), _answer_logprob(ref.module.model, data)
    h = [(pi[i] - q[i]) - (pi[i + 1] - q[i + 1]) for i in (0, 2, 4)]
    if loss == "dpo":
        want = sum(-_log_sigmoid(beta * x) for x in h) / 3
    else:
        want = sum((x - 1 / (2 * beta)) ** 2 for x in h) / 3
    st = dpo.train_step(actor, train, MB)
    assert st["dpo/loss"] == pytest.approx(want, abs=1e-5)
    assert st["dpo/margin"] == pytest.approx(beta * sum(h) / 3, abs=1e-5)
    for _ in range(5):
        last = dpo.train_step(actor, train, MB)
    assert last["dpo/margin"] > st["dpo/margin"] and last["dpo/loss"] < st["dpo/loss"]


def test_dpo_options_are_checked():
    with pytest.raises(ValueError, match="beta"):
        make_interface("dpo", beta=0)
    with pytest.raises(ValueError, match="loss='kto'"):
        make_interface("dpo", loss="kto")
