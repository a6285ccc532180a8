"""TrainEngine: token-mean loss scaling, data-parallel equivalence over 2 gloo ranks,
skipped steps, clipping, learning rates and exact resumption from state_dict."""

import copy
import io

import pytest
import torch
import torch.multiprocessing as mp
from backend_testlib import batch, dp_rank_main, lm_loss, lm_weight, optimizer_config, tiny_model
from rank_processes import fresh_context

from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.model_api import FinetuneSpec
from realhf.impl.kernels import simd_cpu, simd_isas
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.backend import train as train_module
from realhf.impl.model.nn.flat_param import flat_view
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
@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.parametrize(
    "dtype, tol",
    # bf16: the ranks' micro-batches differ from one rank's, so their bf16 matmuls round
    # differently, and Adam turns the sign of a tiny noisy gradient into a full lr step:
    # after 3 steps at lr 1e-2 the fp32 master weights differ by 2.8% of the distance
    # they moved (measured); a lost or doubled rank's gradient would be ~100%
    [(torch.float32, 1e-5), (torch.bfloat16, 0.1)],
)
def test_two_gloo_ranks_match_one_rank_on_the_whole_batch(tmp_path, dtype, tol, zero_stage):
    """Uneven shards (3 vs 5 sequences, different token counts) and a token budget that
    gives the ranks different natural micro-batch counts: the synced split and the
    global token-mean scaling must make 2-rank DP equal to 1-rank training (a bf16 model's
    fp32 gradients are what is reduced).  With ZeRO-1 (optimizer state sharded over the
    two ranks) the same holds, each rank holds half the optimizer state, and its
    checkpoint is the one-rank engine's: it resumes on one rank without ZeRO."""
    n_steps, max_tokens = 3, 16
    shards = [[0, 2, 5], [1, 3, 4, 6, 7]]
    out = str(tmp_path / "rank0.pt")
    opt = {"zero_stage": zero_stage}
    mp.start_processes(
        dp_rank_main,
        args=(2, str(tmp_path / "init"), out, n_steps, shards, max_tokens, dtype, opt),
        nprocs=2,
        join=True,
        start_method=fresh_context().get_start_method(),
    )
    dp = torch.load(out)

    engine = TrainEngine(tiny_model().to(dtype), optimizer_config())
    spec = MicroBatchSpec(max_tokens_per_mb=max_tokens)
    single = [engine.train_batch(batch(), spec, lm_loss, lm_weight) for _ in range(n_steps)]
    mine = engine.model.flat_params if engine.master is None else engine.master
    assert not torch.equal(dp["flat"], tiny_model().flat_params)
    if dtype == torch.float32:
        assert (dp["flat"] - mine).abs().max() <= tol
    else:  # relative to how far training moved the weights (a lost rank would be ~1)
        assert (dp["flat"] - mine).norm() <= tol * (mine - tiny_model().flat_params).norm()
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    for s_dp, s_one in zip(dp["stats"], single):
        assert s_dp["loss"] == pytest.approx(s_one["loss"], rel=rel)
        assert s_dp["n_tokens"] == s_one["n_tokens"]
        assert s_dp["grad_norm"] == pytest.approx(s_one["grad_norm"], rel=10 * rel)

    # A resumed engine on the same ranks continues exactly where the trained one goes.
    continued, resumed = dp["after"]
    assert torch.equal(continued, resumed)
    full = engine.optimizer_state_bytes()
    if zero_stage == 0:
        assert dp["opt_bytes"] == full
        return
    # ZeRO-1: rank 0 holds its half of the moments (and of the fp32 master weights).
    assert full / 2 <= dp["opt_bytes"] <= full / 2 + 64
    # The sharded state has the one-rank layout: one rank without ZeRO resumes from it.
    ref = engine.state_dict()
    got = dp["state"]
    assert [g["params"] for g in got["optimizer"]["param_groups"]] == [
        g["params"] for g in ref["optimizer"]["param_groups"]
    ]
    assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    one = TrainEngine(tiny_model().to(dtype), optimizer_config())
    with torch.no_grad():
        one.model.flat_params.copy_(dp["flat"])
    one.load_state_dict(got)
    assert one.n_steps == n_steps
    one.train_batch(batch(), spec, lm_loss, lm_weight)
    engine.train_batch(batch(), spec, lm_loss, lm_weight)
    a, b = one.model.flat_params.float(), engine.model.flat_params.float()
    if dtype == torch.float32:
        assert (a - b).abs().max() <= tol
    else:
        assert (a - b).norm() <= tol * (b - tiny_model().flat_params).norm()


def test_zero1_on_one_rank_is_plain_adamw_and_checkpoints_interchange():
    """With one rank the shard is the whole buffer: ZeRO-1 steps equal plain AdamW, and
    each engine resumes from the other's state dict."""
    spec = MicroBatchSpec(max_tokens_per_mb=16)
    plain = TrainEngine(tiny_model(), optimizer_config())
    zero = TrainEngine(tiny_model(), optimizer_config(zero_stage=1))
    assert zero.zero is not None and plain.zero is None
    for _ in range(3):
        s_plain = plain.train_batch(batch(), spec, lm_loss, lm_weight)
        s_zero = zero.train_batch(batch(), spec, lm_loss, lm_weight)
        assert s_zero["grad_norm"] == pytest.approx(s_plain["grad_norm"], rel=1e-6)
    assert (zero.model.flat_params - plain.model.flat_params).abs().max() <= 1e-6
    assert zero.optimizer_state_bytes() == plain.optimizer_state_bytes()
    for src, dst_cfg in ((plain, {"zero_stage": 1}), (zero, {})):
        dst = TrainEngine(tiny_model(), optimizer_config(**dst_cfg))
        with torch.no_grad():
            dst.model.flat_params.copy_(src.model.flat_params)
        dst.load_state_dict(copy.deepcopy(src.state_dict()))
        ref = TrainEngine(tiny_model(), optimizer_config(**({} if dst_cfg else {"zero_stage": 1})))
        with torch.no_grad():
            ref.model.flat_params.copy_(src.model.flat_params)
        ref.load_state_dict(copy.deepcopy(src.state_dict()))
        dst.train_batch(batch(), spec, lm_loss, lm_weight)
        ref.train_batch(batch(), spec, lm_loss, lm_weight)
        assert (dst.model.flat_params - ref.model.flat_params).abs().max() <= 1e-6


def test_zero_stage_other_than_0_or_1_is_refused():
    with pytest.raises(ValueError, match="zero_stage=2.*not implemented"):
        optimizer_config(zero_stage=2)


# ---- mixed precision: a bf16 model trains fp32 master weights ----------------------------


def _bf16_engine(**opt):
    return TrainEngine(tiny_model().to(torch.bfloat16), optimizer_config(**opt))


_NO_KERNELS = "the C++ AdamW step needs AVX2 or AVX-512 and realhf._C"


@pytest.fixture(params=["torch", "cpp"])
def step_impl(request, monkeypatch):
    """A bf16 engine's optimizer step through torch's fused AdamW, and through the C++
    pass (the path a CPU with realhf's vector kernels takes)."""
    if request.param == "torch":
        monkeypatch.setattr(train_module, "simd_cpu", lambda: None)
    elif simd_cpu() is None:
        pytest.skip(_NO_KERNELS)
    return request.param


def _applied_grads(engine):
    """The fp32 gradients each step applies (the engine frees them after the step)."""
    applied = []
    step = engine._optimizer_step

    def keep(*args):
        applied.append(engine.master_grad.clone())
        return step(*args)

    engine._optimizer_step = keep
    return applied


def test_bf16_model_keeps_fp32_master_weights_gradient_and_adam_state():
    engine = _bf16_engine()
    assert engine.master.dtype == engine.master_grad.dtype == torch.float32
    assert engine.model.dtype == engine.flat_grad.dtype == torch.bfloat16
    applied = _applied_grads(engine)
    engine.train_batch(batch(), MicroBatchSpec(max_tokens_per_mb=14), lm_loss, lm_weight)
    for p, state in engine.optimizer.state.items():
        assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # the model holds the master weights rounded to bf16
    assert torch.equal(engine.model.flat_params, engine.master.to(torch.bfloat16))
    assert engine.flat_grad.abs().sum() == 0 and applied[0].abs().sum() > 0
    # The next step starts its fp32 gradient from zero: it is that of a fresh engine on
    # the same (bf16) weights.
    fresh = TrainEngine(copy.deepcopy(engine.model), optimizer_config())
    fresh_applied = _applied_grads(fresh)
    for e in (engine, fresh):
        e.train_batch(batch(), MicroBatchSpec(max_tokens_per_mb=14), lm_loss, lm_weight)
    torch.testing.assert_close(applied[1], fresh_applied[0], rtol=0, atol=0)
    assert TrainEngine(tiny_model(), optimizer_config()).master is None  # fp32: none needed


@pytest.mark.parametrize("chunk", [None, 1000])
def test_bf16_gradients_accumulate_in_fp32_across_micro_batches(chunk, monkeypatch):
    """The fp32 gradient of a bf16 model is the sum of its micro-batches' gradients, each
    rounded to bf16 once: not a running bf16 sum (also when added a chunk at a time)."""
    if chunk is not None:
        monkeypatch.setattr(train_module, "_ACCUMULATE_CHUNK", chunk)
    engine = _bf16_engine()
    applied = _applied_grads(engine)
    spec = MicroBatchSpec(max_tokens_per_mb=14)
    engine.train_batch(batch(), spec, lm_loss, lm_weight)
    mbs = batch().split(spec)[0]
    total = sum(lm_weight(mb) for mb in mbs)
    model = tiny_model().to(torch.bfloat16)
    ref = torch.zeros(model.flat_params.numel())
    for mb in mbs:
        model.zero_grad()
        loss, _ = lm_loss(model(mb.data["packed_input_ids"], mb.cu_seqlens("packed_input_ids")), mb)
        (loss * (lm_weight(mb) / total)).backward()
        for name, p in model.named_parameters():  # in the flat buffer's layout
            flat_view(ref, model.param_spec[name]).add_(p.grad.float())
    torch.testing.assert_close(applied[0], ref, rtol=0, atol=0)


def test_bf16_updates_below_half_an_ulp_are_kept_by_the_master_weights():
    """At lr 1e-5 every Adam update (~lr) is far below half a bf16 ulp of weights of size
    ~0.02 (2**-13 ~ 1.2e-4): plain bf16 AdamW would never move; the master weights
    accumulate them and the rounded model follows."""
    engine = _bf16_engine(lr=1e-5, weight_decay=0.0)
    start_master = engine.master.clone()
    start = engine.model.flat_params.clone()
    for _ in range(30):
        engine.train_batch(batch(), WHOLE, lm_loss, lm_weight)
    moved = (engine.master - start_master).abs()
    assert moved.max() > 2e-4  # 30 steps of ~1e-5
    assert not torch.equal(engine.model.flat_params, start)
    # the same steps on plain bf16 AdamW (no master) leave most weights where they were
    plain = tiny_model().to(torch.bfloat16)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-5, weight_decay=0.0)
    b = batch()
    ids, cu = b.data["packed_input_ids"], b.cu_seqlens("packed_input_ids")
    for _ in range(30):
        opt.zero_grad()
        lm_loss(plain(ids, cu), b)[0].backward()
        opt.step()
    big = start.float().abs() > 0.01
    lost = (plain.flat_params == start)[big].float().mean()
    kept = (engine.model.flat_params == start)[big].float().mean()
    assert lost > 0.9 and kept < lost - 0.3, (lost, kept)


def test_bf16_state_dict_restores_the_master_weights_exactly():
    spec = MicroBatchSpec(max_tokens_per_mb=20)
    batches = [batch(seed=s) for s in range(4)]
    a = _bf16_engine()
    for b in batches[:2]:
        a.train_batch(b, spec, lm_loss, lm_weight)
    buf = io.BytesIO()  # a snapshot: the optimizer's state_dict holds live tensors
    torch.save({"weights": a.model.flat_params.clone(), "engine": a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert saved["engine"]["master"].dtype == torch.float32
    rest_a = [a.train_batch(b, spec, lm_loss, lm_weight) for b in batches[2:]]
    b_engine = TrainEngine(tiny_model(seed=7).to(torch.bfloat16), optimizer_config())
    b_engine.model.load_flat(saved["weights"])
    b_engine.load_state_dict(saved["engine"])
    rest_b = [b_engine.train_batch(b, spec, lm_loss, lm_weight) for b in batches[2:]]
    assert torch.equal(a.master, b_engine.master) and rest_a == rest_b


def test_weights_loaded_into_a_bf16_model_are_not_overwritten_by_stale_masters():
    engine = _bf16_engine()
    engine.train_batch(batch(), WHOLE, lm_loss, lm_weight)
    new = tiny_model(seed=3).to(torch.bfloat16).flat_params
    engine.model.load_flat(new)  # e.g. a reload of the role's weights
    engine.train_batch(batch(), WHOLE, lm_loss, lm_weight, version_steps=0)
    # one step from the loaded weights, not from the old master copy
    step = (engine.model.flat_params.float() - new.float()).abs().max()
    assert step < 0.05, step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_gradients_released_between_steps_frees_the_buffer_and_changes_nothing(dtype, zero_stage):
    """A call on the trained model that does not train (generation, inference, a save)
    runs with the gradient buffer of the model's dtype freed; it comes back zeroed and the
    next steps are those of an engine that never released it."""
    engines = [
        TrainEngine(tiny_model().to(dtype), optimizer_config(zero_stage=zero_stage))
        for _ in range(2)
    ]
    spec = MicroBatchSpec(max_tokens_per_mb=14)
    for e in engines:
        e.train_batch(batch(), spec, lm_loss, lm_weight)
    released, kept = engines
    storage = released.flat_grad.untyped_storage()
    with released.gradients_released():
        assert storage.nbytes() == 0
        b = batch(seed=3)
        ids, cu = b.data["packed_input_ids"], b.cu_seqlens("packed_input_ids")
        with torch.no_grad():  # the model itself still runs
            torch.testing.assert_close(released.model(ids, cu), kept.model(ids, cu))
    assert storage.nbytes() >= released.flat_grad.numel() * released.flat_grad.element_size()
    assert released.flat_grad.abs().sum() == 0
    for p in released.model.parameters():  # the grads are views of the regrown buffer
        assert p.grad.untyped_storage().data_ptr() == storage.data_ptr()
    for step in range(2):
        for e in engines:
            e.train_batch(batch(seed=4 + step), spec, lm_loss, lm_weight)
        assert torch.equal(released.model.flat_params, kept.model.flat_params)


@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_bf16_step_of_one_micro_batch_needs_no_fp32_gradient_buffer(
    chunk, clip, monkeypatch, step_impl
):
    """One micro-batch on one rank: the fp32 sum would hold the bf16 gradient converted, so
    the step converts it a run of parameters at a time instead (runs of ~``chunk``
    elements; a larger parameter, here the embedding and the MLP matrices of 2,048, a slice
    of ``chunk`` at a time from the second step on; the grad norm in pieces of ``chunk``).
    The weights, moments and grad norms are those of the path through the fp32 buffer, to
    the bit, with clipping too, and the fp32 buffer is never allocated."""
    if chunk is not None:
        monkeypatch.setattr(train_module, "_ACCUMULATE_CHUNK", chunk)
        monkeypatch.setattr(train_module, "_NORM_PIECE", chunk)
    direct, ref = (_bf16_engine(gradient_clipping=clip) for _ in range(2))
    results = []
    for engine, flag in ((direct, True), (ref, False)):
        monkeypatch.setattr(train_module, "_DIRECT_STEP", flag)
        stats = [engine.train_batch(batch(seed=s), WHOLE, lm_loss, lm_weight) for s in (1, 2)]
        assert all(st["n_mbs"] == 1 for st in stats)
        states = [engine.optimizer.state[p] for p in engine._optimized_params()]
        moments = torch.cat([t.flatten() for st in states for t in st.values()])
        results.append((engine.master.clone(), moments, [st["grad_norm"] for st in stats]))
        empty = engine._grad_storage.untyped_storage().nbytes() == 0
        assert empty == flag  # (the reference's fp32 sum is kept after its step)
    (w, m, norms), (w_ref, m_ref, norms_ref) = results
    assert torch.equal(w, w_ref) and torch.equal(m, m_ref) and norms == norms_ref
    if clip:
        assert min(norms) > clip  # the clipping was exercised
    assert torch.equal(direct.model.flat_params, direct.master.to(torch.bfloat16))


@pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [5, 37, 2 * 65536 + 19])
def test_cpp_adamw_step_equals_torch_adamw(isa, grad_dtype, n):
    """Three steps of the C++ pass (spans of 64k elements and a masked tail) against torch's
    fused AdamW on the same float32 state: equal to a few float32 ulps (they round their
    scalars and order their products differently), and the bf16 copy is the master weights
    rounded."""
    ext = simd_cpu()
    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-4
    ref = [t.clone() for t in (p, m, v)]
    low = torch.empty(n, dtype=torch.bfloat16)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        ext.adamw_step(p, m, v, grad, low, step=float(step), grad_coef=0.5, isa=isa, **hp)
        train_module._functional_adamw(
            [ref[0]],
            [grad.float() * 0.5],
            [ref[1]],
            [ref[2]],
            [],
            [torch.tensor(float(step - 1))],
            fused=True,
            amsgrad=False,
            maximize=False,
            **hp,
        )
        assert torch.equal(low, p.to(torch.bfloat16))
    torch.testing.assert_close(p, ref[0], rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(m, ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, ref[2], rtol=1e-5, atol=1e-7)
    assert not torch.equal(p, torch.randn(n, generator=torch.Generator().manual_seed(n)))


@pytest.mark.parametrize(
    "isa", simd_isas() or [pytest.param("", marks=pytest.mark.skip(_NO_KERNELS))]
)
@pytest.mark.parametrize("n", [0, 5, 37, 2 * 65536 + 19])
def test_cpp_sum_of_squares_of_a_gradient(isa, n):
    """The gradient norm's sum of squares: float64's to float32 accumulation, the same for
    a bf16 gradient and its float32 conversion, and for any thread count, to the bit."""
    ext = simd_cpu()
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    got = ext.sum_squares(x, isa)
    assert got == pytest.approx(x.double().square().sum().item(), rel=1e-5, abs=0)
    assert ext.sum_squares(x.float(), isa) == got
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ext.sum_squares(x, isa) == got
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        ext.sum_squares(x.half(), isa)


@pytest.mark.skipif(simd_cpu() is None, reason=_NO_KERNELS)
def test_cpp_adamw_step_refuses_what_it_cannot_take():
    ext, p = simd_cpu(), torch.zeros(8)
    with pytest.raises(RuntimeError, match="grad must be a contiguous float32 or bfloat16"):
        ext.adamw_step(p, p.clone(), p.clone(), p.half(), None, 1e-3, 0.9, 0.95, 0.0, 1e-8, 1.0)
    with pytest.raises(RuntimeError, match="of one size"):
        ext.adamw_step(p, p[:4].clone(), p.clone(), p, None, 1e-3, 0.9, 0.95, 0.0, 1e-8, 1.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ext.adamw_step(p, p.clone(), p.clone(), p, None, 1e-3, 0.9, 0.95, 0.0, 1e-8, 0.0)


@pytest.mark.skipif(simd_cpu() is None, reason=_NO_KERNELS)
@pytest.mark.parametrize("spec", [WHOLE, MicroBatchSpec(max_tokens_per_mb=14)])
def test_bf16_engine_steps_in_cpp_as_with_torch_adamw(spec, monkeypatch):
    """A bf16 engine on this CPU steps with the C++ pass (one micro-batch: from the bf16
    gradient; several: from the fp32 sum): after three steps with clipping its master
    weights and moments are torch's AdamW's to float32 rounding, the model holds its master
    weights rounded, the weights' version moved (so a cached copy of them knows), and the
    state has torch's layout: the torch path resumes from it."""
    engines, first = {}, {}
    for name in ("cpp", "torch"):
        if name == "torch":
            monkeypatch.setattr(train_module, "simd_cpu", lambda: None)
        engine = _bf16_engine(gradient_clipping=1e-3)
        assert (engine._master_kernel() is not None) == (name == "cpp")
        for s in (1, 2, 3):
            before = engine.model.trained_flat._version
            engine.train_batch(batch(seed=s), spec, lm_loss, lm_weight)
            assert engine.model.trained_flat._version > before
            if s == 1:
                first[name] = engine.master.clone()
        engines[name] = engine
    cpp, ref = engines["cpp"], engines["torch"]
    assert torch.equal(cpp.model.flat_params, cpp.master.to(torch.bfloat16))
    # One step from the same gradient: float32 rounding apart (lr 1e-2).
    torch.testing.assert_close(first["cpp"], first["torch"], rtol=0, atol=1e-6)
    # Then a weight one bf16 ulp apart changes the next gradients a little, and Adam turns
    # the sign of a tiny gradient into a full step: relative to how far training moved.
    start = tiny_model().flat_params
    # (measured 0.0016-0.0018 of it; a lost step or clipping would be ~1)
    assert (cpp.master - ref.master).norm() <= 0.02 * (ref.master - start).norm()
    for p_cpp, p_ref in zip(cpp._optimized_params(), ref._optimized_params()):
        a, b = cpp.optimizer.state[p_cpp], ref.optimizer.state[p_ref]
        assert list(a) == list(b) and a["step"] == b["step"] == 3
        assert a["step"].dtype == b["step"].dtype and a["step"].shape == b["step"].shape
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-2, atol=1e-7)
    resumed = _bf16_engine(gradient_clipping=1e-3)  # (torch's path: simd_cpu is patched)
    with torch.no_grad():
        resumed.model.flat_params.copy_(cpp.model.flat_params)
    resumed.load_state_dict(copy.deepcopy(cpp.state_dict()))
    assert torch.equal(resumed.master, cpp.master)
    resumed.train_batch(batch(seed=4), spec, lm_loss, lm_weight)
    assert resumed.optimizer.state[resumed._optimized_params()[0]]["step"] == 4
