"""ReaLModel itself: flat buffer, forward contracts, the attn_fn (KV-cache) hook,
gradient checkpointing, dtypes and device/dtype moves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from realhf.impl.model import ReaLModel, ReaLModelConfig
from realhf.impl.model.nn import layer_interval, packed_position_ids


def tiny_config(**overrides) -> ReaLModelConfig:
    kw = dict(
        family="qwen2",
        n_layers=2,
        hidden_dim=64,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim=16,
        intermediate_dim=96,
        vocab_size=128,
        n_positions=256,
        use_attention_bias=True,
    )
    kw.update(overrides)
    return ReaLModelConfig(**kw)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return ReaLModel(tiny_config()).eval()


# ---- flat buffer -----------------------------------------------------------


def test_every_parameter_is_a_view_of_the_flat_buffer(model):
    flat = model.flat_params
    assert flat.dim() == 1 and flat.is_contiguous()
    assert sum(p.numel() for p in model.parameters()) == flat.numel()
    base = flat.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        spec = model.param_spec[name]
        assert p.untyped_storage().data_ptr() == base
        assert p.data_ptr() == flat[spec.offset :].data_ptr()
        assert tuple(p.shape) == spec.shape
    assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]
    assert set(model.state_dict()) == set(model.param_spec)


def test_layout_is_reverse_layer_order_with_contiguous_layers(model):
    n = model.config.n_layers
    ivs = [layer_interval(model.param_spec, i) for i in range(n + 2)]
    assert ivs[-1][0] == 0  # head first
    assert ivs[0][1] == model.flat_params.numel()  # embedding last
    for later, earlier in zip(ivs[1:], ivs[:-1]):
        assert later[1] == earlier[0]


def test_writing_the_flat_buffer_changes_the_parameters(model):
    spec = model.param_spec["1.attn.c_attn.q_attn.weight"]
    with torch.no_grad():
        model.flat_params[spec.offset] = 123.0
    assert model.get_parameter("1.attn.c_attn.q_attn.weight")[0, 0] == 123.0


def test_load_flat_and_state_dict_round_trip(model):
    other = ReaLModel(tiny_config())
    other.load_flat(model.flat_params.clone())
    assert torch.equal(other.flat_params, model.flat_params)
    third = ReaLModel(tiny_config())
    third.load_state_dict(model.state_dict())
    assert torch.equal(third.flat_params, model.flat_params)
    with pytest.raises(ValueError, match="1-D tensor of"):
        other.load_flat(torch.zeros(3))


def test_tied_head_has_no_separate_weight():
    m = ReaLModel(tiny_config(tied_embedding=True))
    head = m.config.head_layer_idx
    assert f"{head}.weight" not in m.param_spec
    untied = ReaLModel(tiny_config())
    assert untied.param_spec[f"{head}.weight"].shape == (128, 64)
    critic = ReaLModel(tiny_config(tied_embedding=True), is_critic=True)
    assert critic.config.is_critic
    assert critic.param_spec[f"{head}.weight"].shape == (1, 64)
    assert critic.param_spec[f"{head}.bias"].shape == (1,)


def test_to_dtype_keeps_views_and_values(model):
    ref = model.flat_params.clone()
    params = list(model.parameters())
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.flat_params.dtype == torch.bfloat16
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    base = model.flat_params.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in model.parameters())
    assert torch.allclose(model.flat_params.float(), ref, atol=1e-2, rtol=1e-2)


def test_deepcopy_keeps_parameters_in_the_copy_flat_buffer(model):
    import copy

    clone = copy.deepcopy(model)
    assert torch.equal(clone.flat_params, model.flat_params)
    assert clone.flat_params.data_ptr() != model.flat_params.data_ptr()
    base = clone.flat_params.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in clone.parameters())
    assert clone.training == model.training


def test_meta_device_builds_spec_without_memory():
    m = ReaLModel(tiny_config(), device="meta")
    assert m.flat_params.is_meta and len(m.param_spec) > 0


# ---- forward ---------------------------------------------------------------


def _batch(seqlens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (sum(seqlens),), generator=g)
    cu = torch.tensor([0] + list(seqlens)).cumsum(0).to(torch.int32)
    return ids, cu


def test_packed_equals_each_sequence_alone(model):
    ids, cu = _batch([5, 11, 1, 8])
    with torch.no_grad():
        packed = model(ids, cu)
        alone = torch.cat(
            [model(ids[s:e], torch.tensor([0, e - s])) for s, e in zip(cu[:-1], cu[1:])]
        )
    assert packed.shape == (ids.numel(), 128)
    assert (packed - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("is_critic", [False, True])
def test_output_rows_are_those_rows_of_the_full_output(is_critic):
    """The head at some packed rows (any order, repeats) equals those rows of the full
    output: what a generation's prefill samples from."""
    torch.manual_seed(0)
    m = ReaLModel(tiny_config(), is_critic=is_critic).eval()
    ids, cu = _batch([5, 11, 1, 8])
    rows = torch.tensor([4, 15, 16, 24, 0, 15])
    with torch.no_grad():
        full, some = m(ids, cu), m(ids, cu, output_rows=rows)
    assert some.shape == (len(rows),) + full.shape[1:]
    torch.testing.assert_close(some, full[rows], atol=1e-6, rtol=0)


def test_default_position_ids():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert packed_position_ids(cu, 5).tolist() == [0, 1, 2, 0, 1]


def test_bad_inputs_raise_clear_errors(model):
    ids, cu = _batch([4, 4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, torch.tensor([0, 4, 7]))
    with pytest.raises(ValueError, match="1-D"):
        model(ids[None], cu)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, cu, position_ids=torch.arange(3))
    with pytest.raises(ValueError, match="output_rows must be a 1-D integer tensor"):
        model(ids, cu, output_rows=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="output_rows must be a 1-D integer tensor"):
        model(ids, cu, output_rows=torch.tensor([[1, 2]]))


def _causal_attn_fn(cu):
    def attn_fn(layer_idx, q, k, v):
        outs = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qq, kk, vv = (t[s:e].transpose(0, 1) for t in (q, k, v))
            rep = qq.shape[0] // kk.shape[0]
            kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
        return torch.cat(outs)

    return attn_fn


def test_trivial_attn_fn_gives_identical_logits(model):
    ids, cu = _batch([6, 13, 2])
    seen = []
    inner = _causal_attn_fn(cu)

    def attn_fn(layer_idx, q, k, v):
        seen.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return inner(layer_idx, q, k, v)

    with torch.no_grad():
        ref = model(ids, cu)
        hooked = model(ids, cu, attn_fn=attn_fn)
    assert torch.allclose(ref, hooked, atol=1e-6, rtol=0)
    T = ids.numel()
    assert seen == [(i, (T, 4, 16), (T, 2, 16), (T, 2, 16)) for i in range(2)]


def test_attn_fn_with_wrong_output_shape_is_rejected(model):
    ids, cu = _batch([4])
    with pytest.raises(ValueError, match="attn_fn for layer 0 returned shape"):
        model(ids, cu, attn_fn=lambda i, q, k, v: q[:, :1])


@pytest.mark.parametrize("family_kw", [{}, {"qk_layernorm": True, "family": "qwen3"}])
def test_kv_cache_decode_step_equals_full_forward(family_kw):
    """Prefill a prefix into a dict cache, then compute each sequence's last token
    alone at position L-1 attending to the cache: equals the full forward."""
    torch.manual_seed(0)
    model = ReaLModel(tiny_config(**family_kw)).eval()
    seqlens = [9, 4]
    ids, cu = _batch(seqlens, seed=3)
    with torch.no_grad():
        full = model(ids, cu)

    prefix_lens = [L - 1 for L in seqlens]
    starts = cu[:-1].tolist()
    prefix_ids = torch.cat([ids[s : s + p] for s, p in zip(starts, prefix_lens)])
    prefix_cu = torch.tensor([0] + prefix_lens).cumsum(0)
    cache = {}  # layer -> list of (k, v) per sequence

    def prefill(layer_idx, q, k, v):
        b = prefix_cu.tolist()
        cache[layer_idx] = [(k[s:e], v[s:e]) for s, e in zip(b[:-1], b[1:])]
        return _causal_attn_fn(prefix_cu)(layer_idx, q, k, v)

    def decode(layer_idx, q, k, v):
        outs = []
        for i in range(len(seqlens)):
            kc = torch.cat([cache[layer_idx][i][0], k[i : i + 1]])
            vc = torch.cat([cache[layer_idx][i][1], v[i : i + 1]])
            rep = q.shape[1] // kc.shape[1]
            qq = q[i : i + 1].transpose(0, 1)
            kk = kc.transpose(0, 1).repeat_interleave(rep, 0)
            vv = vc.transpose(0, 1).repeat_interleave(rep, 0)
            outs.append(F.scaled_dot_product_attention(qq, kk, vv).transpose(0, 1))
        return torch.cat(outs)

    last_ids = torch.stack([ids[s + p] for s, p in zip(starts, prefix_lens)])
    with torch.no_grad():
        model(prefix_ids, prefix_cu, attn_fn=prefill)
        step = model(
            last_ids,
            torch.arange(len(seqlens) + 1),
            position_ids=torch.tensor(prefix_lens),
            attn_fn=decode,
        )
    want = torch.stack([full[e - 1] for e in cu[1:].tolist()])
    assert (step - want).abs().max() <= 1e-5
    # Wrong positions must change the result (the offset is really used).
    with torch.no_grad():
        model(prefix_ids, prefix_cu, attn_fn=prefill)
        wrong = model(last_ids, torch.arange(len(seqlens) + 1), attn_fn=decode)
    assert (wrong - want).abs().max() > 1e-3


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    a = ReaLModel(tiny_config()).train()
    b = ReaLModel(tiny_config(), gradient_checkpointing=True).train()
    b.load_flat(a.flat_params.detach())
    ids, cu = _batch([7, 12])
    for m in (a, b):
        m(ids, cu).logsumexp(-1).sum().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_run_forward_and_backward(dtype):
    torch.manual_seed(0)
    ref = ReaLModel(tiny_config()).eval()
    m = ReaLModel(tiny_config(), dtype=dtype).eval()
    m.load_flat(ref.flat_params.detach().to(dtype))
    ids, cu = _batch([5, 9])
    out = m(ids, cu)
    assert out.dtype == dtype
    assert (out.float() - ref(ids, cu)).abs().max() < 0.1
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in m.parameters())


def test_critic_outputs_one_value_per_token():
    m = ReaLModel(tiny_config(), is_critic=True)
    ids, cu = _batch([3, 5])
    assert m(ids, cu).shape == (8,)


def test_critic_lm_logits_returns_the_value_then_the_tied_lm_logits():
    cfg = tiny_config(tied_embedding=True)
    lm = ReaLModel(cfg)
    critic = ReaLModel(cfg, is_critic=True)
    both = ReaLModel(cfg, is_critic=True, critic_lm_logits=True)
    assert both.param_spec == critic.param_spec  # the parameters are a plain critic's
    shared = {k: v for k, v in lm.state_dict().items() if k in critic.param_spec}
    critic.load_state_dict({**critic.state_dict(), **shared})
    both.load_state_dict(critic.state_dict())
    ids, cu = _batch([3, 5])
    out = both(ids, cu)
    assert out.shape == (8, 1 + cfg.vocab_size)
    torch.testing.assert_close(out[:, 0], critic(ids, cu))
    torch.testing.assert_close(out[:, 1:], lm(ids, cu))
    out.sum().backward()  # the logits reach the embedding, the value the head
    head = both.config.head_layer_idx
    assert both.get_parameter("0.wte.weight").grad.abs().sum() > 0
    assert both.get_parameter(f"{head}.weight").grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(tied_embedding=False, is_critic=True), "tied embeddings"),
        (dict(tied_embedding=True, is_critic=False), "needs a critic"),
        (dict(tied_embedding=True, is_critic=True, layers=(0, 2)), "the whole model"),
    ],
)
def test_critic_lm_logits_refuses_what_it_cannot_serve(kw, msg):
    layers = kw.pop("layers", None)
    is_critic = kw.pop("is_critic")
    with pytest.raises(ValueError, match=msg):
        ReaLModel(tiny_config(**kw), is_critic=is_critic, critic_lm_logits=True, layers=layers)


# ---- config validation -----------------------------------------------------


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("family", "bert", "family='bert'"),
        ("n_kv_heads", 3, "n_kv_heads=3"),
        ("activation", "tanh", "activation='tanh'"),
        ("n_layers", 0, "n_layers=0"),
        ("head_dim", 15, "head_dim=15"),
        ("sliding_window", 0, "sliding_window=0"),
    ],
)
def test_config_validation_names_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        tiny_config(**{field: value})


def test_config_aliases_and_same_architecture():
    c = tiny_config()
    assert c.max_position_embeddings == c.n_positions
    assert c.same_architecture(dataclasses.replace(c, hf_extra={"eos_token_id": 1}))
    assert not c.same_architecture(dataclasses.replace(c, n_layers=3))


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        ReaLModel(tiny_config(), dtype=torch.float64)
