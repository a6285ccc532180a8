"""The advantage-estimator registry: every estimator against hand-computed values on a tiny
packed batch, with fake batch operations (no collective, no SequenceSample)."""

import pytest
import torch

from realhf.impl.algorithms import advantages as A
from realhf.impl.algorithms.choices import Choice

# two prompts of G=2 answers; answer i has LENS[i] shifted entries, the first one a prompt
# position (out of the loss)
G = 2
LENS = [3, 2, 2, 3]
SCORES = [1.0, -1.0, 3.0, 1.0]


class FakeOps:
    """Records what the estimator asked for; normalises with this batch's own moments."""

    def __init__(self):
        self.checked, self.normalized = [], 0

    def normalize(self, x, loss_mask):
        self.normalized += 1
        return A.F.normalize_advantages(x, loss_mask)

    def check_groups(self, user):
        self.checked.append(user)


def _inputs(**kw):
    short1 = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
    mask = torch.ones(sum(LENS), dtype=torch.bool)
    mask[short1[:-1]] = False
    base = dict(
        score=torch.tensor(SCORES),
        kl_rewards=torch.zeros(sum(LENS)),
        gae_advantages=torch.arange(sum(LENS), dtype=torch.float32),
        loss_mask=mask,
        short1cu_seqlens=short1,
        no_eos=torch.zeros(len(LENS), dtype=torch.bool),
        group_size=G,
    )
    base.update(kw)
    return A.AdvantageInputs(**base)


STARTS = [0, 3, 5, 7]


def _answers(x):
    """Per answer, its values on the valid (answer) entries."""
    return [x[s + 1 : s + n].tolist() for s, n in zip(STARTS, LENS)]


def test_every_name_has_one_registered_estimator():
    assert list(A.ESTIMATORS) == list(A.AdvEstimator)
    for name, est in A.ESTIMATORS.items():
        assert est.name is name and est.summary
        assert (est.group_fn is None) != (est.compute is None)
        # an estimator that compares the answers of a group can only use outcome scores
        assert est.outcome or est.min_group_size == 1
    assert A.estimator("rloo") is A.ESTIMATORS[A.AdvEstimator.RLOO]
    with pytest.raises(ValueError, match=r"adv_estimator='ppo': use one of \['gae', 'grpo'"):
        A.estimator("ppo")


@pytest.mark.parametrize(
    "name, per_answer",
    [
        # group means 0 and 2; sample stds sqrt(2) and sqrt(2)
        ("grpo", [1 / 2**0.5, -1 / 2**0.5, 1 / 2**0.5, -1 / 2**0.5]),
        ("drgrpo", [1.0, -1.0, 1.0, -1.0]),
        # the other answer of the group is the baseline
        ("rloo", [2.0, -2.0, 2.0, -2.0]),
    ],
)
def test_group_estimators_give_every_valid_token_its_answers_advantage(name, per_answer):
    ops = FakeOps()
    raw, adv = A.estimator(name).advantages(_inputs(), ops)
    assert ops.checked == [f"adv_estimator={name}"] and ops.normalized == 0
    assert torch.equal(raw, adv)
    for got, want, n in zip(_answers(adv), per_answer, LENS):
        assert got == pytest.approx([want] * (n - 1), rel=1e-5)
    assert adv[~_inputs().loss_mask].abs().max().item() == 0.0


@pytest.mark.parametrize(
    "adv_norm, group_adv_norm, checked, normalized",
    [(False, False, [], 0), (True, False, [], 1), (True, True, ["group_adv_norm"], 0)],
)
def test_gae_only_normalises_as_asked(adv_norm, group_adv_norm, checked, normalized):
    ops = FakeOps()
    inp = _inputs(adv_norm=adv_norm, group_adv_norm=group_adv_norm)
    raw, adv = A.estimator("gae").advantages(inp, ops)
    assert torch.equal(raw, inp.gae_advantages)
    assert (ops.checked, ops.normalized) == (checked, normalized)
    if not adv_norm:
        assert torch.equal(adv, raw)


@pytest.mark.parametrize("name", ["reinforce++", "reinforce++-baseline"])
def test_reinforce_pp_is_the_discounted_reward_to_go_normalised(name):
    ops = FakeOps()
    kl = torch.full((sum(LENS),), -0.1)
    raw, adv = A.estimator(name).advantages(_inputs(kl_rewards=kl, discount=0.5), ops)
    assert ops.normalized == 1
    assert ops.checked == ([] if name == "reinforce++" else [f"adv_estimator={name}"])
    scores = SCORES if name == "reinforce++" else [1.0, -1.0, 1.0, -1.0]
    for s, n, r in zip(STARTS, LENS, scores):
        rewards = [-0.1] * (n - 1) + [-0.1 + r]
        want, acc = [], 0.0
        for x in reversed(rewards):
            acc = x + 0.5 * acc
            want.append(acc)
        assert raw[s : s + n].tolist() == pytest.approx(want[::-1], rel=1e-5)
    valid = raw[_inputs().loss_mask].double()
    want_adv = (valid - valid.mean()) / (valid.std(unbiased=False) + 1e-5)
    assert adv[_inputs().loss_mask].double().tolist() == pytest.approx(want_adv.tolist(), rel=1e-5)


def test_an_estimator_gives_either_its_group_function_or_its_computation():
    with pytest.raises(TypeError, match="exactly one of group_fn, compute"):
        A.Estimator(A.AdvEstimator.GAE, "x", outcome=False, min_group_size=1, kl_in_reward=True)


def test_a_choice_is_its_string_and_names_the_field_when_wrong():
    assert A.AdvEstimator("grpo") == "grpo" and f"{A.AdvEstimator.REINFORCE_PP}" == "reinforce++"
    assert repr(A.AdvEstimator.GRPO) == "'grpo'" and issubclass(A.AdvEstimator, Choice)
    with pytest.raises(ValueError, match=r"ppo.adv_estimator='x': use one of"):
        A.AdvEstimator.parse("x", "ppo.adv_estimator")
