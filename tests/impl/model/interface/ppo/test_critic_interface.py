"""ppo_critic: values per token, the clipped value loss falls, value normalisation."""

import pytest
import torch
from interface_testlib import MB, on_policy

from realhf.base import stats_tracker
from realhf.impl.model.interface import PPOActorInterface, PPOCriticInterface

PAIRS = [
    ("Compute 2+3.", "\\boxed{5}"),
    ("Compute 2+3.", "\\boxed{7}"),
    ("Compute 9-1.", "\\boxed{8}"),
]


@pytest.fixture(autouse=True)
def _clean_tracker():
    stats_tracker.reset()
    yield
    stats_tracker.reset()


def _batch(make_model, pa_sample):
    """On-policy behaviour log-probs and rewards +1, -1, +1 (each answer ends with EOS)."""
    return on_policy(PPOActorInterface(), make_model(), pa_sample(PAIRS), rewards=[1.0, -1.0, 1.0])


def test_inference_gives_one_value_per_token(make_model, pa_sample):
    critic_m = make_model("critic", train=False, is_critic=True)
    critic = PPOCriticInterface(value_norm=False)
    data = pa_sample(PAIRS)
    out = critic.inference(critic_m, data, MB)
    assert out.keys == {"values"} and out.seqlens["values"] == data.seqlens["packed_input_ids"]
    ids, cu = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        torch.testing.assert_close(out.data["values"], critic_m.module.model(ids, cu).float())


def test_value_loss_falls_towards_the_returns(make_model, pa_sample):
    critic_m = make_model("critic", is_critic=True, lr=1e-3)
    critic = PPOCriticInterface(
        value_norm=False, kl_ctl=0.0, ppo_n_minibatches=1, value_eps_clip=10.0
    )
    data = _batch(make_model, pa_sample)
    losses = []
    for _ in range(5):
        step = data.select(data.keys)  # fresh values from the current critic each step
        step.update_(critic.inference(critic_m, step, MB))
        losses.append(critic.train_step(critic_m, step, MB)["ppo_critic/loss"])
    assert losses[-1] < 0.7 * losses[0] and losses == sorted(losses, reverse=True), losses
    assert critic_m.version.global_step == 5


def test_value_norm_tracks_returns_and_round_trips(make_model, pa_sample):
    critic_m = make_model("critic", is_critic=True)
    critic = PPOCriticInterface(kl_ctl=0.0, ppo_n_minibatches=1, value_norm_beta=0.5)
    data = _batch(make_model, pa_sample)
    data.update_(critic.inference(critic_m, data, MB))
    critic.train_step(critic_m, data, MB)
    mean, std = critic.rms.mean_std()
    # gamma = lambda = 1, no KL: every valid return equals its sequence reward (+1, -1, +1),
    # weighted by answer-token counts; one debiased EMA update gives exactly their mean.
    lens = [
        (~m).sum().item()
        for m in data.data["prompt_mask"].split(data.flat_seqlens("packed_input_ids"))
    ]
    expected = (lens[0] - lens[1] + lens[2]) / sum(lens)
    assert float(mean) == pytest.approx(expected, rel=1e-6)
    other = PPOCriticInterface(kl_ctl=0.0)
    other.load_state_dict(critic.state_dict())
    assert torch.equal(torch.stack(other.rms.mean_std()), torch.stack(critic.rms.mean_std()))
    # Inference denormalises: raw outputs scaled by std and shifted by mean.
    out = critic.inference(critic_m, data.select(["packed_input_ids"]), MB).data["values"]
    ids, cu = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        raw = critic_m.module.model(ids, cu).double()
    torch.testing.assert_close(out.double(), raw * std + mean, rtol=1e-5, atol=1e-5)


def test_disable_value_is_rejected():
    with pytest.raises(ValueError, match="disable_value"):
        PPOCriticInterface(disable_value=True)
