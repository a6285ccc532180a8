"""``python -m realhf.apps.make_model``: random models of released shapes, with the embedded
tokenizer, that ReaLModel and transformers both load."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from realhf.apps import make_model as mm
from realhf.impl.model import ReaLModel
from realhf.impl.model.conversion.families import get_family

# parameters of the released models (their model cards), to 1%
RELEASED = {
    "qwen2.5-0.5b": 494e6,
    "qwen2.5-1.5b": 1.54e9,
    "qwen3-0.6b": 596e6,
    "llama3.2-1b": 1.24e9,
    "qwen2.5-vl-3b": 3.75e9,
}


@pytest.mark.parametrize("shape", sorted(mm.SHAPES))
def test_each_shape_has_the_released_models_size_and_our_model_reads_its_config(shape):
    config = mm.hf_config(shape)
    with torch.device("meta"):  # no storage: the full 1.5B shape costs nothing here
        model = mm.build_hf_model(config)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - RELEASED[shape]) <= 0.01 * RELEASED[shape], n
    ours = get_family(config.model_type).config_from_hf(config, shape, is_critic=False)
    text = config.get_text_config()
    assert (ours.vocab_size, ours.n_layers) == (text.vocab_size, text.num_hidden_layers)
    assert ours.tied_embedding
    assert (ours.rope_scaling is not None) == (shape == "llama3.2-1b")
    # the embedded tokenizer's special ids, so that answers can end
    assert (text.eos_token_id, text.pad_token_id) == (0, 1)
    if shape == "qwen2.5-vl-3b":  # the vision tokens of the visual task's tokenizer
        assert ours.vision.depth == 32 and ours.vision.image_token_id == 270


@pytest.mark.slow
def test_a_shortened_qwen3_shape_loads_in_ours_and_transformers_alike(tmp_path, capsys):
    out = tmp_path / "q3"
    assert mm.main(["--shape", "qwen3-0.6b", str(out), "--layers", "1", "--dtype", "float32"]) == 0
    assert "wrote qwen3-0.6b" in capsys.readouterr().out
    info = json.loads((out / "shape.json").read_text())
    # embedding (tied head) + one layer (q 2048, k/v 1024 wide, q/k norms, MLP 3072) + norm
    assert info["layers"] == 1 and info["parameters"] == 151936 * 1024 + 15_730_944 + 1024
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tok("Compute 12+30.").input_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, as released
    ours = ReaLModel.from_hf(str(out)).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
        mine = ours(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
    assert mine.shape == (len(ids), 151936)
    assert (mine - theirs).abs().max() <= 1e-4
    # the same arguments give the same weights
    again = tmp_path / "again"
    mm.main(["--shape", "qwen3-0.6b", str(again), "--layers", "1", "--dtype", "float32"])
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_bad_arguments_are_refused_naming_the_fix(tmp_path, capsys):
    assert mm.main(["--shape", "qwen2.5-0.5b", str(tmp_path / "a"), "--layers", "99"]) == 2
    assert "--layers 99: give 1..24" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert mm.main(["--shape", "qwen2.5-0.5b", str(tmp_path / "full"), "--layers", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    with pytest.raises(SystemExit) as e:
        mm.main(["--shape", "gpt-5", str(tmp_path / "b")])
    assert e.value.code == 2 and "invalid choice: 'gpt-5'" in capsys.readouterr().err
    assert mm.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in mm.SHAPES)
