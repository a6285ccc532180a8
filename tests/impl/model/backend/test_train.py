"""TrainEngine: token-mean loss scaling, data-parallel equivalence over 2 gloo ranks,
skipped steps, clipping, learning rates and exact resumption from state_dict."""

import io

import pytest
import torch
import torch.multiprocessing as mp
from backend_testlib import batch, dp_rank_main, lm_loss, lm_weight, optimizer_config, tiny_model

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.model_api import FinetuneSpec
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

WHOLE = MicroBatchSpec()


def _grads_after_one_batch(spec):
    engine = TrainEngine(tiny_model(), optimizer_config())
    stats = engine.train_batch(batch(), spec, lm_loss, lm_weight)
    # The optimizer stepped, but the (unclipped) gradient stays in the flat buffer.
    return engine, stats, engine.flat_grad.clone()


def test_loss_is_the_global_token_mean_whatever_the_micro_batches():
    _, whole, g_whole = _grads_after_one_batch(WHOLE)
    _, cut, g_cut = _grads_after_one_batch(MicroBatchSpec(max_tokens_per_mb=14))
    assert cut["n_mbs"] >= 4 and whole["n_mbs"] == 1
    # Reference: the plain mean NLL over every predicted token of the batch.
    model, b = tiny_model(), batch()
    ids, cu = b.data["packed_input_ids"], b.cu_seqlens("packed_input_ids")
    ref = -gather_packed_shifted_log_probs(model(ids, cu), cu, ids).mean()
    assert whole["loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert cut["loss"] == pytest.approx(ref.item(), rel=1e-6)
    assert (
        whole["n_tokens"]
        == cut["n_tokens"]
        == sum(l - 1 for l in b.flat_seqlens("packed_input_ids"))
    )
    torch.testing.assert_close(g_cut, g_whole, rtol=1e-5, atol=1e-7)
    ref.backward()
    ref_grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    ours = torch.cat(
        [p.grad.flatten() for p in _grads_after_one_batch(WHOLE)[0].model.parameters()]
    )
    torch.testing.assert_close(ours, ref_grad, rtol=1e-5, atol=1e-7)


def test_grads_are_views_of_one_flat_buffer():
    engine, _, _ = _grads_after_one_batch(MicroBatchSpec(max_tokens_per_mb=20))
    base = engine.flat_grad.data_ptr()
    end = base + engine.flat_grad.numel() * engine.flat_grad.element_size()
    for p in engine.model.parameters():
        assert base <= p.grad.data_ptr() < end
    assert engine.flat_grad.abs().sum() > 0


def test_loss_fn_stats_are_weighted_like_the_loss():
    _, stats, _ = _grads_after_one_batch(MicroBatchSpec(max_tokens_per_mb=14))
    assert stats["mean_logp"] == pytest.approx(-stats["loss"], rel=1e-6)


def test_weight_decay_skips_one_dimensional_parameters():
    engine = TrainEngine(tiny_model(), optimizer_config(weight_decay=0.3))
    wd = {id(p): g["weight_decay"] for g in engine.optimizer.param_groups for p in g["params"]}
    for name, p in engine.model.named_parameters():
        assert wd[id(p)] == (0.3 if p.dim() >= 2 else 0.0), name


def test_non_finite_gradient_skips_the_step_and_counts_it():
    engine = TrainEngine(tiny_model(), optimizer_config())
    before = engine.model.flat_params.clone()

    def nan_loss(logits, mb):
        loss, stats = lm_loss(logits, mb)
        return loss * float("nan"), stats

    with pytest.warns(UserWarning, match="skipping optimizer step"):
        stats = engine.train_batch(batch(), WHOLE, nan_loss, lm_weight)
    assert stats["skipped"] == 1.0 and stats["n_skipped_steps"] == 1.0
    assert torch.equal(engine.model.flat_params, before)
    assert engine.optimizer.state == {} or all(not s for s in engine.optimizer.state.values())
    stats = engine.train_batch(batch(), WHOLE, lm_loss, lm_weight)  # recovers: buffer re-zeroed
    assert stats["skipped"] == 0.0 and stats["n_skipped_steps"] == 1.0
    assert torch.isfinite(engine.model.flat_params).all()
    assert not torch.equal(engine.model.flat_params, before)


def test_zero_tokens_skip_the_step():
    engine = TrainEngine(tiny_model(), optimizer_config())
    before = engine.model.flat_params.clone()
    stats = engine.train_batch(batch(), WHOLE, lm_loss, lambda mb: 0)
    assert stats["skipped"] == 1.0 and stats["n_tokens"] == 0.0
    assert torch.equal(engine.model.flat_params, before)


def test_gradient_clipping_bounds_the_global_norm():
    engine = TrainEngine(tiny_model(), optimizer_config(gradient_clipping=1e-3))
    stats = engine.train_batch(batch(), WHOLE, lm_loss, lm_weight)
    assert stats["grad_norm"] > 1e-3
    assert float(engine.flat_grad.norm()) == pytest.approx(1e-3, rel=1e-4)


def test_learning_rate_follows_the_schedule_by_version_step():
    cfg = optimizer_config(
        lr=1.0, lr_scheduler_type="linear", warmup_steps_proportion=0.25, min_lr_ratio=0.0
    )
    engine = TrainEngine(
        tiny_model(), cfg, FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=1)
    )
    lrs = [engine.train_batch(batch(), WHOLE, lm_loss, lm_weight)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([0.5, 1.0, 1.0])  # W = 2 warm-up steps, then decay starts at 1.0
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)
    # Several optimizer steps of one global step share its learning rate.
    s = engine.train_batch(batch(), WHOLE, lm_loss, lm_weight, version_steps=5)
    assert s["lr"] == pytest.approx(1.0 - 3 / 6)
    with pytest.raises(ValueError, match="FinetuneSpec"):
        TrainEngine(tiny_model(), cfg)


def test_gradient_checkpointing_passthrough_gives_the_same_gradients():
    plain = TrainEngine(tiny_model(), optimizer_config())
    ckpt = TrainEngine(tiny_model(), optimizer_config(), gradient_checkpointing=True)
    assert ckpt.model.gradient_checkpointing and not plain.model.gradient_checkpointing
    plain.train_batch(batch(), WHOLE, lm_loss, lm_weight)
    ckpt.train_batch(batch(), WHOLE, lm_loss, lm_weight)
    torch.testing.assert_close(ckpt.flat_grad, plain.flat_grad, rtol=1e-5, atol=1e-7)


def test_state_dict_round_trip_continues_identically():
    cfg = optimizer_config(lr_scheduler_type="cosine", warmup_steps_proportion=0.2)
    ft = FinetuneSpec(total_train_epochs=1, dataset_size=6, train_batch_size=1)
    spec = MicroBatchSpec(max_tokens_per_mb=20)
    batches = [batch(seed=s) for s in range(4)]
    a = TrainEngine(tiny_model(), cfg, ft)
    for b in batches[:2]:
        a.train_batch(b, spec, lm_loss, lm_weight)
    buf = io.BytesIO()
    torch.save({"weights": a.model.flat_params.clone(), "engine": a.state_dict()}, buf)
    rest_a = [a.train_batch(b, spec, lm_loss, lm_weight) for b in batches[2:]]

    buf.seek(0)
    saved = torch.load(buf)
    b_engine = TrainEngine(tiny_model(seed=7), cfg, ft)  # different init, overwritten below
    b_engine.model.load_flat(saved["weights"])
    b_engine.load_state_dict(saved["engine"])
    rest_b = [b_engine.train_batch(b, spec, lm_loss, lm_weight) for b in batches[2:]]
    assert torch.equal(a.model.flat_params, b_engine.model.flat_params)
    assert rest_a == rest_b
    with pytest.raises(KeyError, match="n_steps"):
        b_engine.load_state_dict({"optimizer": saved["engine"]["optimizer"]})


def test_rejects_a_non_realmodel():
    with pytest.raises(TypeError, match="ReaLModel"):
        TrainEngine(torch.nn.Linear(2, 2), optimizer_config())


@pytest.mark.slow
def test_two_gloo_ranks_match_one_rank_on_the_whole_batch(tmp_path):
    """Uneven shards (3 vs 5 sequences, different token counts) and a token budget that
    gives the ranks different natural micro-batch counts: the synced split and the
    global token-mean scaling must make 2-rank DP equal to 1-rank training."""
    n_steps, max_tokens = 3, 16
    shards = [[0, 2, 5], [1, 3, 4, 6, 7]]
    out = str(tmp_path / "rank0.pt")
    mp.spawn(
        dp_rank_main,
        args=(2, str(tmp_path / "init"), out, n_steps, shards, max_tokens),
        nprocs=2,
        join=True,
    )
    dp = torch.load(out)

    engine = TrainEngine(tiny_model(), optimizer_config())
    spec = MicroBatchSpec(max_tokens_per_mb=max_tokens)
    single = [engine.train_batch(batch(), spec, lm_loss, lm_weight) for _ in range(n_steps)]
    assert (dp["flat"] - engine.model.flat_params).abs().max() <= 1e-5
    assert not torch.equal(dp["flat"], tiny_model().flat_params)
    for s_dp, s_one in zip(dp["stats"], single):
        assert s_dp["loss"] == pytest.approx(s_one["loss"], rel=1e-5)
        assert s_dp["n_tokens"] == s_one["n_tokens"]
        assert s_dp["grad_norm"] == pytest.approx(s_one["grad_norm"], rel=1e-4)
