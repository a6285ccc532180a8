"""ppo_actor: the sync PPO dataflow end to end, and the policy moves the right way."""

import pytest
import torch
from alloc_probe import biggest_allocation
from interface_testlib import MB, answer_logprob_sums, on_policy

from realhf.api.core.model_api import Model
from realhf.api.core.registry import InterfaceAbstraction, make_interface
from realhf.base import stats_tracker
from realhf.impl.model.interface import PPOActorInterface

GEN = {"max_new_tokens": 6}
PAIRS = [("Compute 2+3.", "\\boxed{5}"), ("Compute 2+3.", "\\boxed{7}")]


@pytest.fixture(autouse=True)
def _clean_tracker():
    stats_tracker.reset()
    yield
    stats_tracker.reset()


def test_sync_ppo_dataflow_generate_reward_ref_critic_train(make_model, prompts, tokenizer):
    actor_m, ref_m = make_model("actor"), make_model("ref", train=False)
    critic_m = make_model("critic", is_critic=True)
    hp = dict(group_size=2, ppo_n_minibatches=2, gen=GEN, kl_ctl=0.1)
    actor = make_interface(InterfaceAbstraction("ppo_actor", hp))
    critic = make_interface(InterfaceAbstraction("ppo_critic", hp))

    data = actor.generate(actor_m, prompts, MB)
    data.update_(
        make_interface("rw-math").inference(Model("reward", None, tokenizer, "cpu"), data, MB)
    )
    ref = actor.inference(ref_m, data, MB)
    ref.remap_keys_({"logprobs": "packed_ref_logprobs"})
    data.update_(ref)
    data.update_(critic.inference(critic_m, data, MB))
    assert data.seqlens["values"] == data.seqlens["packed_input_ids"]
    assert set(data.data["rewards"].tolist()) <= {5.0, -5.0}

    a0, c0 = actor_m.module.model.flat_params.clone(), critic_m.module.model.flat_params.clone()
    stats = actor.train_step(actor_m, data, MB)
    cstats = critic.train_step(critic_m, data, MB)
    assert not torch.equal(a0, actor_m.module.model.flat_params)
    assert not torch.equal(c0, critic_m.module.model.flat_params)
    assert actor_m.version.global_step == 1 and critic_m.version.global_step == 1
    for key in (
        "ppo_actor/loss",
        "ppo_actor/grad_norm",
        "ppo_actor/importance_weight",
        "ppo_actor/clip_ratio",
        "ppo/task_reward",
        "ppo/ref_kl",
        "ppo/advantages",
        "math_reward/accuracy",
        "gen/seq_len",
    ):
        assert key in stats, key
    assert stats["ppo_actor/skipped_steps"] == 0.0
    # On-policy data: the first minibatch starts at ratio 1; both minibatches stay near it.
    assert stats["ppo_actor/importance_weight"] == pytest.approx(1.0, abs=0.05)
    assert stats["ppo/ref_kl"] == pytest.approx(0.0, abs=1e-5)  # ref == actor's initial weights
    assert "ppo_critic/loss" in cstats and "ppo_critic/value_clip_ratio" in cstats


@pytest.mark.parametrize("reward", [1.0, -1.0])
def test_advantage_sign_moves_the_sequence_logprob(make_model, pa_sample, reward):
    """One sequence, no value, no normalisation: A = reward on every answer token."""
    model = make_model(lr=1e-3)
    actor = PPOActorInterface(disable_value=True, adv_norm=False, kl_ctl=0.0, ppo_n_minibatches=1)
    data = on_policy(actor, model, pa_sample(PAIRS[:1]), rewards=[reward])
    before = answer_logprob_sums(actor, model, data)
    stats = actor.train_step(model, data, MB)
    after = answer_logprob_sums(actor, model, data)
    assert (after[0] - before[0]) * reward > 0.05, (before, after)
    assert stats["ppo_actor/importance_weight"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ppo/advantages"] == pytest.approx(reward)


def test_grpo_group_norm_separates_good_from_bad(make_model, pa_sample):
    model = make_model(lr=1e-3)
    actor = PPOActorInterface(
        group_size=2, group_adv_norm=True, disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1
    )
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=[5.0, -5.0])
    before = answer_logprob_sums(actor, model, data)
    actor.train_step(model, data, MB)
    after = answer_logprob_sums(actor, model, data)
    assert (after[0] - after[1]) - (before[0] - before[1]) > 0.05, (before, after)


def test_decoupled_loss_with_proximal_recompute(make_model, pa_sample):
    model = make_model(lr=1e-3)
    actor = PPOActorInterface(
        group_size=2,
        group_adv_norm=True,
        disable_value=True,
        kl_ctl=0.0,
        ppo_n_minibatches=1,
        recompute_logprob=True,
        use_decoupled_loss=True,
        behav_imp_weight_cap=5.0,
    )
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=[1.0, -1.0])
    # Behaviour log-probs from "an older policy": shifted, so the behaviour weight is not 1.
    data.data["packed_logprobs"] = data.data["packed_logprobs"] - 0.1
    prox = actor.inference(model, data, MB)
    prox.remap_keys_({"logprobs": "proximal_logprobs"})
    data.update_(prox)
    before = answer_logprob_sums(actor, model, data)
    stats = actor.train_step(model, data, MB)
    after = answer_logprob_sums(actor, model, data)
    assert stats["ppo_actor/behave_imp_weight"] == pytest.approx(
        torch.exp(torch.tensor(0.1)).item(), rel=1e-4
    )
    assert stats["ppo_actor/importance_weight"] == pytest.approx(
        1.0, abs=1e-5
    )  # ratio against proximal
    assert (after[0] - after[1]) - (before[0] - before[1]) > 0.05, (before, after)


def test_one_step_decoupled_loss_takes_proximal_logprobs_from_the_train_forward(
    make_model, pa_sample
):
    # With one optimizer step per batch the proximal policy is the one the train step runs:
    # skipping the actor_inf pass must give the same update and the same statistics.
    hp = dict(
        group_size=2,
        group_adv_norm=True,
        disable_value=True,
        kl_ctl=0.0,
        ppo_n_minibatches=1,
        use_decoupled_loss=True,
        behav_imp_weight_cap=5.0,
    )
    results = []
    for recompute in (True, False):
        stats_tracker.reset()
        model = make_model(lr=1e-3)
        actor = PPOActorInterface(recompute_logprob=recompute, **hp)
        assert actor.hp.proximal_from_train_forward is not recompute
        data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=[1.0, -1.0])
        data.data["packed_logprobs"] = data.data["packed_logprobs"] - 0.1
        if recompute:
            prox = actor.inference(model, data, MB)
            prox.remap_keys_({"logprobs": "proximal_logprobs"})
            data.update_(prox)
        stats = actor.train_step(model, data, MB)
        results.append((model.module.model.flat_params.clone(), stats))
    (p_re, s_re), (p_fw, s_fw) = results
    torch.testing.assert_close(p_fw, p_re, atol=1e-6, rtol=1e-5)
    for k in ("ppo_actor/behave_imp_weight", "ppo_actor/importance_weight", "ppo_actor/loss"):
        assert s_fw[k] == pytest.approx(s_re[k], rel=1e-4, abs=1e-6), k
    # several optimizer steps per batch still need the recompute pass
    assert PPOActorInterface(
        ppo_n_minibatches=2, use_decoupled_loss=True
    ).hp.needs_proximal_recompute


def test_success_rate_filter_masks_solved_groups(make_model, pa_sample):
    model = make_model()
    actor = PPOActorInterface(
        group_size=2, disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1, success_rate_ub=0.9
    )
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=[5.0, 5.0])  # all solved
    before = model.module.model.flat_params.clone()
    stats = actor.train_step(model, data, MB)
    assert stats["ppo/n_filtered_groups"] == 1.0
    assert stats["ppo/kept_seq_ratio"] == 0.0
    assert stats["ppo_actor/skipped_steps"] == 1.0  # nothing left to train on
    assert torch.equal(before, model.module.model.flat_params)


def test_a_nan_reward_is_masked_like_a_filtered_group(make_model, pa_sample):
    # NaN is math_reward's "no verdict" for a row it could not grade (a bad dataset row).
    model = make_model()
    actor = PPOActorInterface(group_size=2, disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1)
    nan = float("nan")
    data = on_policy(actor, model, pa_sample(PAIRS * 2, group=2), rewards=[nan, nan, 5.0, -5.0])
    stats = actor.train_step(model, data, MB)
    assert stats["ppo/n_unscored_seqs"] == 2.0
    assert stats["ppo/kept_seq_ratio"] == 0.5
    assert all(v == v for v in stats.values()), stats  # no NaN leaked into the loss or stats
    data = on_policy(actor, model, pa_sample(PAIRS, group=2), rewards=[nan, nan])
    before = model.module.model.flat_params.clone()
    assert actor.train_step(model, data, MB)["ppo_actor/skipped_steps"] == 1.0
    assert torch.equal(before, model.module.model.flat_params)


def test_mask_too_long_drops_truncated_answers(make_model, pa_sample):
    model = make_model(lr=1e-2)
    actor = PPOActorInterface(
        disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1, adv_norm=False, mask_too_long=True
    )
    data = on_policy(
        actor, model, pa_sample(PAIRS, group=1), rewards=[1.0, 1.0], no_eos=[False, True]
    )
    stats = actor.train_step(model, data, MB)
    n_answer_first = int(
        (~data.data["prompt_mask"][: data.flat_seqlens("packed_input_ids")[0]]).sum()
    )
    assert stats["ppo/n_valid_tokens"] == n_answer_first
    assert stats["ppo/no_eos_ratio"] == 0.5


def test_adaptive_kl_moves_beta_and_round_trips(make_model, pa_sample):
    model, ref_m = make_model(), make_model("ref", train=False)
    with torch.no_grad():
        ref_m.module.model.flat_params.add_(torch.randn_like(ref_m.module.model.flat_params) * 0.5)
    actor = PPOActorInterface(
        disable_value=True,
        ppo_n_minibatches=1,
        kl_ctl=0.2,
        adaptive_kl_ctl=True,
        adaptive_kl_target=0.01,
        adaptive_kl_horizon=10.0,
    )
    data = on_policy(actor, model, pa_sample(PAIRS), rewards=[1.0, -1.0])
    ref = actor.inference(ref_m, data, MB)
    ref.remap_keys_({"logprobs": "packed_ref_logprobs"})
    data.update_(ref)
    stats = actor.train_step(model, data, MB)
    assert stats["ppo/ref_kl"] > 0.01
    assert actor.kl_ctl.value == pytest.approx(
        0.2 * (1 + 0.2 * 2 / 10.0)
    )  # clipped error 0.2, 2 sequences
    other = PPOActorInterface(kl_ctl=0.2, adaptive_kl_ctl=True)
    other.load_state_dict(actor.state_dict())
    assert other.kl_ctl.value == actor.kl_ctl.value


def test_errors_are_clear(make_model, pa_sample):
    model = make_model()
    actor = PPOActorInterface(disable_value=True, kl_ctl=0.0, ppo_n_minibatches=4)
    data = on_policy(actor, model, pa_sample(PAIRS), rewards=[1.0, -1.0])
    with pytest.raises(ValueError, match="ppo_n_minibatches=4"):
        actor.train_step(model, data, MB)
    with pytest.raises(KeyError, match="packed_ref_logprobs"):
        PPOActorInterface(disable_value=True, ppo_n_minibatches=1).train_step(model, data, MB)
    with pytest.raises(KeyError, match="values"):
        PPOActorInterface(kl_ctl=0.0, ppo_n_minibatches=1).train_step(model, data, MB)
    with pytest.raises(TypeError, match="TrainEngine"):
        actor.train_step(make_model(train=False), data, MB)
    with pytest.raises(ValueError, match="group_size=2"):
        PPOActorInterface(
            group_size=2, group_adv_norm=True, disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1
        ).train_step(model, data, MB)


@pytest.mark.slow
def test_two_gloo_ranks_stay_in_step_and_identical(tmp_path, actor_hf_dir):
    """Uneven per-rank batches through actor, critic and SFT train steps: every collective
    inside (advantage norm, KL mean, early stop, minibatch checks, grad all-reduce, stats
    export) must line up, and the data-parallel replicas must end identical."""
    from interface_testlib import ASSETS, dp_rank_main
    from rank_processes import fresh_context

    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    ctx = fresh_context()
    procs = [
        ctx.Process(
            target=dp_rank_main, args=(r, 2, str(tmp_path / "init"), outs[r], actor_hf_dir, ASSETS)
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0, "a data-parallel rank failed or hung (see its stderr above)"
    r0, r1 = (torch.load(o) for o in outs)
    for key in ("actor", "critic", "sft"):
        assert torch.equal(r0[key], r1[key]), key
    assert r0["stats"] == r1["stats"]
    a_stats = r0["stats"][0]
    assert a_stats["ppo/n_seqs"] == 10 and a_stats["ppo_actor/skipped_steps"] == 0.0


def test_recompute_without_decoupling_anchors_on_the_recomputed_logprobs(make_model, pa_sample):
    model = make_model()
    actor = PPOActorInterface(
        disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1, recompute_logprob=True
    )
    data = on_policy(actor, model, pa_sample(PAIRS), rewards=[1.0, -1.0])
    prox = actor.inference(model, data, MB)
    prox.remap_keys_({"logprobs": "proximal_logprobs"})
    data.update_(prox)
    data.data["packed_logprobs"] = torch.full_like(data.data["packed_logprobs"], -50.0)  # ignored
    stats = actor.train_step(model, data, MB)
    assert stats["ppo_actor/importance_weight"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ppo_actor/behave_imp_weight"] == 1.0


def test_inference_divides_logits_by_the_temperature(make_model, pa_sample):
    from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

    model = make_model(train=False)
    data = pa_sample(PAIRS)
    out = PPOActorInterface(gen={"temperature": 0.5}).inference(model, data, MB)
    ids, cu = data.data["packed_input_ids"], data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        ref = gather_packed_shifted_log_probs(model.module.model(ids, cu), cu, ids, temperature=0.5)
    torch.testing.assert_close(out.data["logprobs"], ref)


@pytest.mark.slow
def test_a_152k_vocabulary_step_never_holds_float32_logits(tmp_path, tokenizer, pa_sample):
    """Qwen2.5's vocabulary (151,936) on a one-layer bf16 model: the largest single
    allocation of the log-prob inference and of a PPO train step is about the bf16 logits
    (or their gradient), never a float32 [T, V] copy (log-softmax, its gradient), which is
    twice that."""
    from tiny_models import make_tiny_hf_model

    from realhf.api.cli_args import OptimizerConfig
    from realhf.api.core.data_api import MicroBatchSpec
    from realhf.api.core.model_api import FinetuneSpec
    from realhf.impl.model import ReaLModel
    from realhf.impl.model.backend import TrainEngine

    V = 151936
    path = make_tiny_hf_model(
        "qwen2", tmp_path / "m", vocab_size=V, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, seed=3,
    )  # fmt: skip
    net = ReaLModel.from_hf(path).to(torch.bfloat16)
    ft = FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=4)
    engine = TrainEngine(net, OptimizerConfig(lr=1e-3, weight_decay=0.0), ft)
    model = Model("actor", engine, tokenizer, device="cpu")
    actor = PPOActorInterface(disable_value=True, kl_ctl=0.0, ppo_n_minibatches=1)
    pairs = [(f"Compute {a}+{b}, then add {c}.", f"\\boxed{{{a + b + c}}}") for a, b, c in
             [(12, 30, 7), (5, 61, 19), (40, 2, 88), (9, 9, 9)] * 2]  # fmt: skip
    whole = MicroBatchSpec()  # one micro-batch: its logits are [T, V]
    data = on_policy(actor, model, pa_sample(pairs), rewards=[1.0, -1.0] * 4)
    actor.train_step(model, data, whole)  # Adam's moments are made at the first step
    T = data.data["packed_input_ids"].numel()
    # Measured: 1.03x the bf16 logits; a float32 log-softmax of them in place of the
    # vocabulary-chunked one: 1.93x (a float32 [T, V] is 2x, less the shifted-out rows).
    bound = 1.5 * T * V * 2
    assert T >= 150 and bound > 2 * V * 32 * 4  # above the head's own fp32 master weights
    assert biggest_allocation(lambda: actor.inference(model, data, whole)) < bound
    assert biggest_allocation(lambda: actor.train_step(model, data, whole)) < bound
