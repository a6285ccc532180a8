"""ReaLModel vs HuggingFace: logits, gradients, save/load round trips, critics."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import transformers
from tiny_models import TINY_FAMILIES, make_tiny_hf_model

from realhf.impl.model import ReaLModel
from realhf.impl.model.conversion.families import get_family

TOL = 1e-4


def hf_logits_one_by_one(hf, ids, cu):
    """HF logits of each packed sequence run alone, concatenated."""
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        outs.append(hf(ids[s:e][None]).logits[0])
    return torch.cat(outs)


def load_hf(path, cls=transformers.AutoModelForCausalLM):
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logits_match_hf(family, tiny_hf_dir, packed_batch):
    path = tiny_hf_dir(family)
    ids, cu, _ = packed_batch
    ours = ReaLModel.from_hf(path).eval()
    assert ours.config.family == family
    with torch.no_grad():
        diff = (ours(ids, cu) - hf_logits_one_by_one(load_hf(path), ids, cu)).abs().max()
    assert diff <= TOL


def test_llama3_rope_scaling_matches_hf_and_round_trips(tmp_path, packed_batch):
    """Llama 3.1/3.2's RoPE scaling: an original context of 8 makes every branch of it
    (stretched, kept, blended wavelengths) matter at these lengths."""
    scaling = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)  # fmt: skip
    path = make_tiny_hf_model(
        "llama", tmp_path / "hf", rope_parameters={**scaling, "rope_theta": 10000.0}
    )
    ids, cu, seqlens = packed_batch
    assert max(seqlens) > 8
    ours = ReaLModel.from_hf(path).eval()
    assert ours.config.rope_scaling == {k: float(v) for k, v in scaling.items() if k != "rope_type"}
    hf = load_hf(path)
    with torch.no_grad():
        assert (ours(ids, cu) - hf_logits_one_by_one(hf, ids, cu)).abs().max() <= TOL
        plain = ReaLModel(dataclasses.replace(ours.config, rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        assert (plain.eval()(ids, cu) - ours(ids, cu)).abs().max() > 1e-3  # it mattered
    ours.save_hf(tmp_path / "ours")
    again = ReaLModel.from_hf(tmp_path / "ours")
    assert again.config == ours.config
    assert load_hf(tmp_path / "ours").config.rope_parameters["rope_type"] == "llama3"


def test_mistral_sliding_window_matches_hf(tiny_hf_dir, packed_batch):
    path = tiny_hf_dir("mistral", sliding_window=8)
    ids, cu, seqlens = packed_batch
    assert max(seqlens) > 8
    ours = ReaLModel.from_hf(path).eval()
    assert ours.config.sliding_window == 8
    with torch.no_grad():
        diff = (ours(ids, cu) - hf_logits_one_by_one(load_hf(path), ids, cu)).abs().max()
    assert diff <= TOL


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_save_load_round_trip_and_transformers_loads_it(
    family, tiny_hf_dir, packed_batch, tmp_path
):
    ids, cu, _ = packed_batch
    first = ReaLModel.from_hf(tiny_hf_dir(family)).eval()
    first.save_hf(tmp_path)
    second = ReaLModel.from_hf(tmp_path).eval()
    assert second.config == first.config
    assert torch.equal(first.flat_params, second.flat_params)
    with torch.no_grad():
        ours = first(ids, cu)
        assert torch.equal(ours, second(ids, cu))
        diff = (ours - hf_logits_one_by_one(load_hf(tmp_path), ids, cu)).abs().max()
    assert diff <= TOL


def test_embedded_tiny_qwen2_shape_tied_round_trip(tmp_path, packed_batch):
    """The embedded default model's shape: qwen2, tied embeddings, vocab 270."""
    src = make_tiny_hf_model(
        "qwen2",
        tmp_path / "src",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=270,
        tie_word_embeddings=True,
    )
    ids, cu, _ = packed_batch
    model = ReaLModel.from_hf(src).eval()
    assert model.config.tied_embedding and model.config.head_dim == 64
    assert not any(n.endswith(f"{model.config.head_layer_idx}.weight") for n in model.param_spec)
    model.save_hf(tmp_path / "out")
    hf = load_hf(tmp_path / "out")
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        diff = (model(ids, cu) - hf_logits_one_by_one(hf, ids, cu)).abs().max()
    assert diff <= TOL


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "llama"])
def test_gradients_match_hf(family, tiny_hf_dir, packed_batch):
    path = tiny_hf_dir(family)
    ids, cu, _ = packed_batch
    ours = ReaLModel.from_hf(path)
    hf = load_hf(path)
    hf.train()  # dropout is 0 in the tiny configs

    logits = ours(ids, cu)
    loss = _next_token_loss(logits, ids, cu)
    loss.backward()
    hf_loss = sum(
        _next_token_loss(hf(ids[s:e][None]).logits[0], ids[s:e], torch.tensor([0, e - s]))
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
    )
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= TOL

    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    compared = 0
    for rule in get_family(family).weight_rules(ours.config):
        for name, g in zip(rule.ours, rule.to_ours(hf_grads[rule.hf_name])):
            assert (ours_grads[name] - g).abs().max() <= TOL, (rule.hf_name, name)
            compared += 1
    assert compared == len(ours.param_spec)


def _next_token_loss(logits, ids, cu):
    """Sum of next-token cross-entropy within each sequence."""
    total = 0.0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e - s > 1:
            total = total + torch.nn.functional.cross_entropy(
                logits[s : e - 1], ids[s + 1 : e], reduction="sum"
            )
    return total


def test_load_hf_weights_swaps_in_place(tiny_hf_dir, tmp_path, packed_batch):
    ids, cu, _ = packed_batch
    a = make_tiny_hf_model("qwen2", tmp_path / "a", seed=1)
    b = make_tiny_hf_model("qwen2", tmp_path / "b", seed=2)
    model = ReaLModel.from_hf(a).eval()
    flat_ptr = model.flat_params.data_ptr()
    param_ids = [id(p) for p in model.parameters()]
    model.load_hf_weights(b)
    assert model.flat_params.data_ptr() == flat_ptr
    assert [id(p) for p in model.parameters()] == param_ids
    assert torch.equal(model.flat_params, ReaLModel.from_hf(b).flat_params)


def test_load_hf_weights_rejects_other_architecture(tiny_hf_dir, tmp_path):
    model = ReaLModel.from_hf(tiny_hf_dir("qwen2"))
    other = make_tiny_hf_model("qwen2", tmp_path / "o", num_hidden_layers=3)
    with pytest.raises(ValueError, match="n_layers"):
        model.load_hf_weights(other)


def test_sharded_save_loads_everywhere(tiny_hf_dir, tmp_path, packed_batch):
    ids, cu, _ = packed_batch
    model = ReaLModel.from_hf(tiny_hf_dir("llama")).eval()
    model.save_hf(tmp_path, max_shard_bytes=64 * 1024)
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path)
    assert torch.equal(ReaLModel.from_hf(tmp_path).flat_params, model.flat_params)
    with torch.no_grad():
        diff = (model(ids, cu) - hf_logits_one_by_one(load_hf(tmp_path), ids, cu)).abs().max()
    assert diff <= TOL


def test_reads_pytorch_bin_sharded_and_unsharded(tiny_hf_dir, tmp_path):
    import json
    import shutil

    src = tiny_hf_dir("gpt2")
    ref = ReaLModel.from_hf(src)
    sd = load_hf(src).state_dict()
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(os.path.join(src, "config.json"), single)
    torch.save(sd, single / "pytorch_model.bin")
    assert torch.equal(ReaLModel.from_hf(single).flat_params, ref.flat_params)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(src, "config.json"), sharded)
    names = list(sd)
    halves = {"p-1.bin": names[: len(names) // 2], "p-2.bin": names[len(names) // 2 :]}
    for fname, keys in halves.items():
        torch.save({k: sd[k] for k in keys}, sharded / fname)
    weight_map = {k: f for f, ks in halves.items() for k in ks}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(ReaLModel.from_hf(sharded).flat_params, ref.flat_params)


def test_old_gpt2_names_without_transformer_prefix(tiny_hf_dir, tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = tiny_hf_dir("gpt2")
    sd = load_hf(src).state_dict()
    old = {
        k.removeprefix("transformer."): v.clone() for k, v in sd.items() if k != "lm_head.weight"
    }
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    save_file(old, str(tmp_path / "model.safetensors"))
    assert torch.equal(ReaLModel.from_hf(tmp_path).flat_params, ReaLModel.from_hf(src).flat_params)


def test_tokenizer_files_are_copied(tiny_hf_dir, tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text('{"fake": true}')
    (tok_dir / "tokenizer_config.json").write_text("{}")
    ReaLModel.from_hf(tiny_hf_dir("qwen2")).save_hf(tmp_path / "out", tokenizer=str(tok_dir))
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"fake": true}'
    assert (tmp_path / "out" / "tokenizer_config.json").exists()


# ---- critics ------------------------------------------------------------


def test_critic_from_causal_lm_gets_new_value_head(tiny_hf_dir, packed_batch):
    ids, cu, _ = packed_batch
    critic = ReaLModel.from_hf(tiny_hf_dir("qwen2"), is_critic=True).eval()
    actor = ReaLModel.from_hf(tiny_hf_dir("qwen2"))
    head = critic.config.head_layer_idx
    assert critic.param_spec[f"{head}.weight"].shape == (1, critic.config.hidden_dim)
    assert critic.head.weight.abs().sum() > 0  # initialised, not left as garbage zeros
    # The body is the causal LM's.
    for name in actor.param_spec:
        if name.startswith("1."):
            assert torch.equal(actor.get_parameter(name), critic.get_parameter(name))
    with torch.no_grad():
        values = critic(ids, cu)
    assert values.shape == (ids.numel(),) and torch.isfinite(values).all()


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_critic_round_trip_and_transformers_token_classification(
    family, tiny_hf_dir, packed_batch, tmp_path
):
    ids, cu, _ = packed_batch
    critic = ReaLModel.from_hf(tiny_hf_dir(family), is_critic=True).eval()
    with torch.no_grad():
        critic.head.bias.fill_(0.25)
    critic.save_hf(tmp_path)
    again = ReaLModel.from_hf(tmp_path, is_critic=True).eval()
    assert torch.equal(again.flat_params, critic.flat_params)
    hf = load_hf(tmp_path, transformers.AutoModelForTokenClassification)
    with torch.no_grad():
        ours = critic(ids, cu)
        theirs = hf_logits_one_by_one(hf, ids, cu)[:, 0]
    assert (ours - theirs).abs().max() <= TOL
    with pytest.raises(ValueError, match="is_critic=True"):
        ReaLModel.from_hf(tmp_path)


# ---- clear errors --------------------------------------------------------


def test_unsupported_architecture_names_config(tmp_path):
    cfg = transformers.AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json.*model_type='bert'"):
        ReaLModel.from_hf(tmp_path)


def test_unsupported_rope_scaling_is_named(tiny_hf_dir, tmp_path):
    import json
    import shutil

    src = tiny_hf_dir("llama")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'linear'"):
        ReaLModel.from_hf(tmp_path)


def test_missing_weight_file_is_named(tiny_hf_dir, tmp_path):
    import shutil

    shutil.copy(os.path.join(tiny_hf_dir("qwen2"), "config.json"), tmp_path)
    with pytest.raises(ValueError, match="no weight file found.*model.safetensors"):
        ReaLModel.from_hf(tmp_path)


def test_missing_shard_is_named(tiny_hf_dir, tmp_path):
    ReaLModel.from_hf(tiny_hf_dir("llama")).save_hf(tmp_path, max_shard_bytes=64 * 1024)
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / shard)
    with pytest.raises(ValueError, match=f"{shard}.*is missing"):
        ReaLModel.from_hf(tmp_path)


def test_missing_parameter_is_named(tiny_hf_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_hf_dir("qwen2")
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    del sd["model.layers.1.self_attn.k_proj.bias"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        ReaLModel.from_hf(tmp_path)


def test_mismatched_shape_names_file_and_parameter(tiny_hf_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_hf_dir("qwen2")
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: parameter 'model\.layers\.0\.mlp\.up_proj\.weight' "
        r"has shape \(100, 64\), expected \(128, 64\)",
    ):
        ReaLModel.from_hf(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json: not found"):
        ReaLModel.from_hf(tmp_path)


def test_safetensors_are_read_exactly_and_without_mapping_the_file(tmp_path):
    """Every dtype, a scalar and an empty tensor read back equal to safetensors' own
    reader; the file is never memory-mapped (its pages would count in the RSS); a
    truncated file is named."""
    from safetensors.torch import load_file, save_file

    from realhf.impl.model.conversion.checkpoint import CheckpointReader

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    reader = CheckpointReader(str(tmp_path))
    got = {key: reader.get(key) for key in tensors}
    with open("/proc/self/maps") as f:
        assert str(path) not in f.read()
    ref = load_file(str(path))  # safetensors' own reader (which maps the file)
    for key in tensors:
        assert got[key].dtype == ref[key].dtype and torch.equal(got[key], ref[key]), key
    # The tensor stored last loses its end.
    last = max(
        reader._open("model.safetensors").header.items(), key=lambda kv: kv[1]["data_offsets"][1]
    )[0]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 2)
    with pytest.raises(
        ValueError, match=rf"model.safetensors: cannot read parameter '{last}'.*early"
    ):
        CheckpointReader(str(tmp_path)).get(last)
