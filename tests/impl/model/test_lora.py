"""LoRA adapters on ReaLModel: a fresh adapter changes nothing, the adapted model equals
PEFT's on the HF base with the adapter files we write (also after training), only adapters
train, adapters off is the base model, and bad specs are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.nn.lora import (
    LoraSpec,
    add_lora,
    load_peft,
    merged,
    read_peft_spec,
    save_peft,
)
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

SEQLENS = [7, 19, 1, 12]


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(SEQLENS),), generator=g)
    cu = torch.tensor([0] + SEQLENS).cumsum(0).int()
    return ids, cu


def _lora_model(path, rank=4, targets=None, seed=1, **kw):
    torch.manual_seed(0)
    m = ReaLModel.from_hf(path, **kw)
    spec = LoraSpec(rank, alpha=8.0, target_modules=targets or LoraSpec(1).target_modules)
    add_lora(m, spec, generator=torch.Generator().manual_seed(seed))
    return m


def _randomize_b(m, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.lora.params.items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=g)


def _peft_logits(base_dir, adapter_dir, ids, cu):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, adapter_dir).eval()
    out = []
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            out.append(pm(input_ids=ids[a:b][None]).logits[0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_qwen2"))


def test_a_fresh_adapter_changes_nothing_and_adapters_off_is_the_base(qwen_dir):
    base = ReaLModel.from_hf(qwen_dir).eval()
    m = _lora_model(qwen_dir).eval()
    ids, cu = _batch(base.config.vocab_size)
    with torch.no_grad():
        ref = base(ids, cu)
        assert torch.equal(m(ids, cu), ref)  # B = 0
        _randomize_b(m)
        assert (m(ids, cu) - ref).abs().max() > 1e-3
        with m.lora.disabled():
            assert torch.equal(m(ids, cu), ref)
        assert m.lora.enabled
    # The base is frozen; only the adapters are what trains.
    assert not any(p.requires_grad for p in m.parameters())
    names = [n for n, _ in m.trained_parameters()]
    assert names and all(n.endswith((".lora_A", ".lora_B")) for n in names)
    assert m.trained_flat.numel() == sum(p.numel() for _, p in m.trained_parameters())


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_logits_equal_peft_on_the_hf_base_with_our_adapter_files(tiny_hf_dir, tmp_path, family):
    path = tiny_hf_dir(family)
    m = _lora_model(path, rank=4).eval()
    _randomize_b(m)
    save_peft(m, str(tmp_path / "adapter"), base_model_path=path)
    ids, cu = _batch(m.config.vocab_size)
    with torch.no_grad():
        ours = m(ids, cu)
    theirs = _peft_logits(path, str(tmp_path / "adapter"), ids, cu)
    assert (ours - theirs).abs().max() < 1e-5
    # The files read back into a fresh model give the same adapters.
    again = ReaLModel.from_hf(path)
    add_lora(again, read_peft_spec(str(tmp_path / "adapter")), init=False)
    load_peft(again, str(tmp_path / "adapter"))
    assert torch.equal(again.lora.flat, m.lora.flat)
    # Merged into the base: the same function with no adapters.
    mm = merged(m).eval()
    assert mm.lora is None
    with torch.no_grad():
        assert (mm(ids, cu) - ours).abs().max() < 1e-5


def _lm_loss(logits, mb):
    ids = mb.data["packed_input_ids"]
    logp = gather_packed_shifted_log_probs(logits, mb.cu_seqlens("packed_input_ids"), ids)
    return -logp.mean(), {}


def test_training_moves_only_the_adapters_and_still_equals_peft(qwen_dir, tmp_path):
    from realhf.api.cli_args import OptimizerConfig

    m = _lora_model(qwen_dir, rank=8, targets=("q_proj", "v_proj", "down_proj"))
    base_before = m.flat_params.detach().clone()
    lora_before = m.lora.flat.detach().clone()
    engine = TrainEngine(m, OptimizerConfig(lr=1e-2, weight_decay=0.0, gradient_clipping=0.0))
    # Nothing of the base size is allocated for training: gradients and Adam are the
    # adapters' size.
    assert engine.flat_grad.numel() == m.lora.flat.numel()
    ids, _ = _batch(m.config.vocab_size, seed=3)
    sample = SequenceSample.from_default(
        ids=[str(i) for i in range(len(SEQLENS))],
        seqlens=SEQLENS,
        data={"packed_input_ids": ids},
    )
    for _ in range(3):
        engine.train_batch(sample, MicroBatchSpec(), _lm_loss, lambda mb: 1)
    assert torch.equal(m.flat_params, base_before)  # the base did not move
    assert not torch.equal(m.lora.flat, lora_before)
    assert engine.optimizer_state_bytes() == 2 * 4 * m.lora.flat.numel()
    save_peft(m, str(tmp_path / "trained"), base_model_path=qwen_dir)
    m.eval()
    ids, cu = _batch(m.config.vocab_size)
    with torch.no_grad():
        ours = m(ids, cu)
    assert (ours - _peft_logits(qwen_dir, str(tmp_path / "trained"), ids, cu)).abs().max() < 1e-5


def test_bf16_adapters_train_through_fp32_master_weights(qwen_dir):
    from realhf.api.cli_args import OptimizerConfig

    m = _lora_model(qwen_dir, dtype=torch.bfloat16)
    assert m.lora.flat.dtype == torch.bfloat16
    engine = TrainEngine(m, OptimizerConfig(lr=1e-3, weight_decay=0.0))
    assert engine.master is not None and engine.master.numel() == m.lora.flat.numel()
    ids, _ = _batch(m.config.vocab_size, seed=3)
    sample = SequenceSample.from_default(
        ids=[str(i) for i in range(len(SEQLENS))], seqlens=SEQLENS, data={"packed_input_ids": ids}
    )
    stats = engine.train_batch(sample, MicroBatchSpec(), _lm_loss, lambda mb: 1)
    assert stats["grad_norm"] > 0
    assert torch.equal(m.lora.flat, engine.master.to(torch.bfloat16))


def test_a_copy_keeps_its_adapters_and_moves_with_the_model(qwen_dir):
    m = _lora_model(qwen_dir)
    _randomize_b(m)
    c = copy.deepcopy(m)
    assert torch.equal(c.lora.flat, m.lora.flat) and c.lora.flat is not m.lora.flat
    ids, cu = _batch(m.config.vocab_size)
    b = m.to(torch.bfloat16)
    assert b.lora.flat.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in b.lora.params.values())
    with torch.no_grad():
        assert b(ids, cu).dtype == torch.bfloat16


def test_bad_specs_are_refused_with_the_fix(tiny_hf_dir):
    with pytest.raises(ValueError, match="lora.rank=-1: use a positive integer"):
        LoraSpec(-1)
    with pytest.raises(ValueError, match=r"unknown \['qkv'\].*use some of"):
        LoraSpec(4, target_modules=("q_proj", "qkv"))
    with pytest.raises(ValueError, match="lora.dropout"):
        LoraSpec(4, dropout=1.0)
    gpt2 = ReaLModel.from_hf(tiny_hf_dir("gpt2"))
    with pytest.raises(ValueError, match="llama-like families"):
        add_lora(gpt2, LoraSpec(4))


def test_an_adapter_directory_loads_as_a_model_and_an_engine_can_run_its_base(qwen_dir, tmp_path):
    from realhf.impl.model.backend import InferenceEngine

    m = _lora_model(qwen_dir).eval()
    _randomize_b(m)
    save_peft(m, str(tmp_path / "a"), base_model_path=qwen_dir)
    loaded = ReaLModel.from_hf(str(tmp_path / "a")).eval()  # base + adapters
    assert torch.equal(loaded.lora.flat, m.lora.flat)
    ids, _ = _batch(m.config.vocab_size)
    sample = SequenceSample.from_default(
        ids=[str(i) for i in range(len(SEQLENS))], seqlens=SEQLENS, data={"packed_input_ids": ids}
    )
    base = ReaLModel.from_hf(qwen_dir).eval()
    off = InferenceEngine(loaded, adapters=False).forward(sample, MicroBatchSpec())
    on = InferenceEngine(loaded).forward(sample, MicroBatchSpec())
    assert torch.equal(off, InferenceEngine(base).forward(sample, MicroBatchSpec()))
    assert (on - off).abs().max() > 1e-3 and loaded.lora.enabled
    with pytest.raises(ValueError, match="needs a model with LoRA adapters"):
        InferenceEngine(base, adapters=False)
    # A relative base path is taken from the adapter directory; a missing one is named.
    import json

    cfg_path = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "nowhere"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="its base model 'nowhere' is not a directory"):
        ReaLModel.from_hf(str(tmp_path / "a"))


def test_an_adapter_of_another_shape_is_refused_naming_both(qwen_dir, tmp_path):
    m = _lora_model(qwen_dir, rank=4)
    save_peft(m, str(tmp_path / "a"), base_model_path=qwen_dir)
    other = ReaLModel.from_hf(qwen_dir)
    add_lora(other, LoraSpec(4, alpha=16.0), init=False)  # the same rank, another scale
    with pytest.raises(ValueError, match="alpha 8 on .*this model's: rank 4, alpha 16"):
        load_peft(other, str(tmp_path / "a"))


def test_a_lora_critic_trains_a_copy_of_its_value_head_and_equals_peft(qwen_dir, tmp_path):
    """A critic (a reward model, PPO's critic) with adapters also trains its value head, as
    PEFT's modules_to_save does: the saved directory loads with peft onto the HF
    token-classification base and gives the same values."""
    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    from realhf.api.cli_args import OptimizerConfig

    torch.manual_seed(0)
    critic = ReaLModel.from_hf(qwen_dir, is_critic=True)  # a fresh value head
    base_dir = str(tmp_path / "critic")
    critic.save_hf(base_dir)
    add_lora(critic, LoraSpec(4, alpha=8.0), generator=torch.Generator().manual_seed(1))
    head = critic.config.head_layer_idx
    assert f"{head}.value_head.weight" in critic.lora.params
    ids, cu = _batch(critic.config.vocab_size)
    engine = TrainEngine(critic, OptimizerConfig(lr=1e-2, weight_decay=0.0))
    sample = SequenceSample.from_default(
        ids=[str(i) for i in range(len(SEQLENS))], seqlens=SEQLENS, data={"packed_input_ids": ids}
    )

    def value_loss(values, mb):
        return values.float().pow(2).mean(), {}

    before = critic.head.weight.detach().clone()
    for _ in range(2):
        engine.train_batch(sample, MicroBatchSpec(), value_loss, lambda mb: 1)
    assert torch.equal(critic.head.weight, before)  # the base's head stays
    assert not torch.equal(critic.lora.params[f"{head}.value_head.weight"], before)
    save_peft(critic, str(tmp_path / "a"), base_model_path=base_dir)
    critic.eval()
    with torch.no_grad():
        ours = critic(ids, cu)
        hf = AutoModelForTokenClassification.from_pretrained(base_dir, dtype=torch.float32)
        pm = PeftModel.from_pretrained(hf, str(tmp_path / "a")).eval()
        theirs = torch.cat(
            [
                pm(input_ids=ids[a:b][None]).logits[0, :, 0]
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
            ]
        )
        assert (ours - theirs).abs().max() < 1e-5
        # Merged: the same values from a plain critic; and the adapter directory loads back.
        assert (merged(critic).eval()(ids, cu) - ours).abs().max() < 1e-5
        again = ReaLModel.from_hf(str(tmp_path / "a"), is_critic=True).eval()
        assert torch.equal(again(ids, cu), ours)
