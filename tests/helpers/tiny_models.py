"""Tiny random HuggingFace models for tests (no downloads).

``make_tiny_hf_model("qwen2", tmp_path / "m")`` writes a HuggingFace directory
(config.json + model.safetensors) that both ``transformers`` and
``ReaLModel.from_hf`` load.  Every parameter is perturbed after HF's
initialisation (HF starts biases at 0 and norms at 1, which would hide a
mis-mapped bias or norm in a comparison test).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Union

import torch

# Small but non-degenerate: GQA (4 q heads / 2 kv heads), 2 layers.
_TINY: Dict[str, Dict[str, Any]] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # explicit and != hidden/heads, as in real qwen3 models
        vocab_size=128,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        vocab_size=128,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=1,
    ),
}

TINY_FAMILIES = tuple(_TINY)


def tiny_hf_config(family: str, **overrides):
    """A transformers config object for a tiny model of ``family``."""
    import transformers

    if family not in _TINY:
        raise ValueError(f"no tiny config for family {family!r}; use one of {TINY_FAMILIES}")
    kwargs = dict(_TINY[family])
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(family, **kwargs)


def make_tiny_hf_model(
    family: str,
    path: Union[str, os.PathLike],
    *,
    seed: int = 0,
    perturb: float = 0.02,
    **overrides,
) -> str:
    """Write a random tiny HF causal LM of ``family`` to ``path``; returns the path.

    Args:
        family: llama, qwen2, qwen3, mistral or gpt2.
        path: output directory (created).
        seed: torch seed for the weights.
        perturb: std of the noise added to every parameter after HF's init
            (0 keeps HF's init exactly).
        overrides: HF config keyword arguments (``num_hidden_layers=4``,
            ``tie_word_embeddings=True``, ...).
    """
    import transformers

    config = tiny_hf_config(family, **overrides)
    return _save_random(transformers.AutoModelForCausalLM.from_config, config, path, seed, perturb)


def _save_random(build, config, path, seed: int, perturb: float) -> str:
    """``build(config)`` under ``seed``, every parameter perturbed, saved to ``path``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config)
        if perturb:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * perturb)
    os.makedirs(str(path), exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


#: token ids of the tiny vision-language model (vocabulary 128)
VL_TOKENS = dict(vision_start_token_id=120, vision_end_token_id=121, image_token_id=122,
                 video_token_id=123)  # fmt: skip


def tiny_vl_config(**text_overrides):
    """A transformers Qwen2_5_VLConfig: the tiny qwen2 text model, a 2-block ViT whose first
    block attends in windows of 2x2 merged tokens, and M-RoPE sections (2, 3, 3)."""
    import transformers

    text = dict(_TINY["qwen2"], tie_word_embeddings=False)
    text.update(text_overrides)
    text["rope_parameters"] = dict(
        rope_type="default", rope_theta=text.pop("rope_theta"), mrope_section=[2, 3, 3]
    )
    tie = text.pop("tie_word_embeddings")
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])  # fmt: skip
    return transformers.AutoConfig.for_model(
        "qwen2_5_vl",
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        vision_config=vision,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        **VL_TOKENS,
        **text,
    )


def make_tiny_vl_model(
    path: Union[str, os.PathLike], *, seed: int = 0, perturb: float = 0.02, **text_overrides
) -> str:
    """Write a random tiny Qwen2.5-VL (``tiny_vl_config``) to ``path``; returns the path."""
    import transformers

    config = tiny_vl_config(**text_overrides)
    return _save_random(
        transformers.Qwen2_5_VLForConditionalGeneration, config, path, seed, perturb
    )


class TinyItems:
    """A dataset of ``n`` one-token prompts (``i0``, ``i1``, ...) for a ShardLoader."""

    def __init__(self, n: int):
        from realhf.api.core.data_api import SequenceSample

        self.items = [
            SequenceSample.from_default([f"i{j}"], [1], {"packed_prompts": torch.tensor([j])})
            for j in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, j: int):
        return self.items[j]


def make_tiny_visual_model(path: Union[str, os.PathLike], seed: int = 1) -> str:
    """The embedded visual task's untrained VLM (``examples/tiny_visual/make_model.py``:
    the tiny text model, a random vision tower, the tokenizer with the vision tokens and
    the image processor) written to ``path``."""
    from example_scripts import load_script

    mod = load_script("examples/tiny_visual/make_model.py", "tiny_visual_make_model")
    return mod.make_model(str(path), seed)


def long_context_copy(path: Union[str, os.PathLike], positions: int = 32768) -> str:
    """The embedded model (tokenizer included) copied to ``path``, claiming ``positions``
    positions like a real model (its RoPE weights do not depend on them); returns the path."""
    import json
    import shutil

    from realhf.experiments.building_blocks import TINY_MODEL

    shutil.copytree(TINY_MODEL, str(path), ignore=shutil.ignore_patterns("data"))
    with open(os.path.join(str(path), "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = positions
    with open(os.path.join(str(path), "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)
