"""qwen2_5_vl: Qwen2.5-VL, a qwen2 language model with a vision tower and multimodal RoPE.

HF config (transformers 5.x ``configuration_qwen2_5_vl.py``): the language model's keys in
``text_config`` (a qwen2's, with ``rope_parameters.mrope_section``), the ViT's in
``vision_config``, the vision token ids at the top.  HF weight names: the language model's
are a qwen2's (``model.embed_tokens``, ``model.layers.{i}.*``, ``model.norm``,
``lm_head``); the tower's are ``visual.patch_embed.proj.weight`` (a Conv3d kernel),
``visual.blocks.{i}.{norm1,norm2,attn.qkv,attn.proj,mlp.gate_proj,mlp.up_proj,
mlp.down_proj}``, ``visual.merger.{ln_q,mlp.0,mlp.2}``.  Critics cannot be written:
transformers has no token-classification class for this family.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from realhf.impl.model.conversion import llama_like
from realhf.impl.model.conversion.hf_config import (
    UnsupportedCheckpoint,
    activation_from_hf,
    activation_to_hf,
)
from realhf.impl.model.conversion.rules import WeightRule, copy_rule
from realhf.impl.model.nn.model_config import ReaLModelConfig, VisionConfig

#: the vision token ids, top-level keys of the HF config
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

#: PEFT adapters name modules by their path in the transformers model, where the language
#: model is ``model.language_model`` (the checkpoint says ``model.``); and they leave the
#: vision tower alone (its MLP has gate/up/down_proj too, which a LoRA target list matches)
PEFT_EXCLUDE = r".*\.visual\..*"


def peft_module(hf_name: str) -> str:
    """The transformers module path of the checkpoint tensor name ``hf_name`` (no suffix)."""
    if hf_name.startswith("model.") and not hf_name.startswith("model.language_model."):
        return "model.language_model." + hf_name.removeprefix("model.")
    return hf_name


#: VisionConfig field -> vision_config key, for the fields copied as they are
_VISION_FIELDS = (
    ("depth", "depth"), ("hidden_dim", "hidden_size"), ("n_heads", "num_heads"),
    ("intermediate_dim", "intermediate_size"), ("out_dim", "out_hidden_size"),
    ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
    ("in_channels", "in_channels"), ("spatial_merge_size", "spatial_merge_size"),
    ("window_size", "window_size"),
)  # fmt: skip


def _as_qwen2(cfg: ReaLModelConfig) -> ReaLModelConfig:
    return dataclasses.replace(cfg, family="qwen2", vision=None, mrope_section=None)


def config_from_hf(family: str, hf, source: str) -> ReaLModelConfig:
    """Our config from a ``Qwen2_5_VLConfig``."""
    text = hf.get_text_config()
    base = llama_like.config_from_hf("qwen2", text, source)
    section = (getattr(text, "rope_parameters", None) or {}).get("mrope_section")
    if section is None:
        raise UnsupportedCheckpoint(f"{source}: text_config.rope_parameters has no mrope_section")
    vc = hf.vision_config
    vision = VisionConfig(
        **{ours: getattr(vc, theirs) for ours, theirs in _VISION_FIELDS},
        fullatt_block_indexes=tuple(vc.fullatt_block_indexes),
        activation=activation_from_hf(vc.hidden_act, "vision_config.hidden_act", source),
        rope_theta=float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        tokens_per_second=int(getattr(vc, "tokens_per_second", 4)),
        **{k: int(getattr(hf, k)) for k in TOKEN_KEYS},
    )
    if not 0 <= vision.image_token_id < base.vocab_size:
        raise UnsupportedCheckpoint(
            f"{source}: image_token_id={vision.image_token_id} is outside the vocabulary "
            f"of {base.vocab_size} tokens"
        )
    return dataclasses.replace(
        base,
        family=family,
        tied_embedding=bool(getattr(hf, "tie_word_embeddings", False)),
        vision=vision,
        mrope_section=tuple(section),
    )


def config_to_hf(cfg: ReaLModelConfig) -> Dict[str, Any]:
    """Keyword arguments of ``Qwen2_5_VLConfig``: the text keys at the top level (the
    config class moves them into ``text_config``, with the token ids of ``hf_extra``)."""
    kw = llama_like.config_to_hf(_as_qwen2(cfg))
    kw.pop("head_dim")  # (not a key of the text config: always hidden / heads)
    kw["rope_parameters"] = dict(kw["rope_parameters"], mrope_section=list(cfg.mrope_section))
    v = cfg.vision
    kw["vision_config"] = dict(
        **{theirs: getattr(v, ours) for ours, theirs in _VISION_FIELDS},
        fullatt_block_indexes=list(v.fullatt_block_indexes),
        hidden_act=activation_to_hf(v.activation, "qwen2_5_vl"),
        tokens_per_second=v.tokens_per_second,
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
    )
    kw.update({k: getattr(v, k) for k in TOKEN_KEYS})
    return kw


def check_representable(cfg: ReaLModelConfig) -> None:
    """Raise when ``cfg`` cannot be written as a Qwen2.5-VL checkpoint."""
    llama_like.check_representable(_as_qwen2(cfg))
    bad = []
    if cfg.vision is None or cfg.mrope_section is None:
        bad.append("a vision tower and mrope_section are required")
    if cfg.head_dim * cfg.n_q_heads != cfg.hidden_dim:
        bad.append("head_dim must be hidden_dim / n_q_heads")
    if cfg.sliding_window is not None:
        bad.append("no sliding window")
    if cfg.is_critic:
        bad.append(
            "transformers has no token-classification class for qwen2_5_vl, so a critic "
            "cannot be saved; train it without a critic (GRPO, or PPO with a reward-only "
            "advantage)"
        )
    if bad:
        raise UnsupportedCheckpoint(
            f"ReaLModelConfig(family='qwen2_5_vl') cannot be written as a HuggingFace "
            f"Qwen2.5-VL checkpoint: {'; '.join(bad)}"
        )


def weight_rules(cfg: ReaLModelConfig) -> List[WeightRule]:
    """The qwen2 language model's rules and the vision tower's."""
    rules = llama_like.weight_rules(_as_qwen2(cfg))
    v = cfg.vision
    D, inner, merged = v.hidden_dim, v.intermediate_dim, v.hidden_dim * v.merge_unit
    kernel = (D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    rules.append(
        WeightRule(
            "visual.patch_embed.proj.weight", ("0.visual.patch_embed.weight",), kernel, "flatten"
        )
    )
    for i in range(v.depth):
        p, o = f"visual.blocks.{i}.", f"0.visual.blocks.{i}."
        r = [
            ("norm1.weight", (D,)),
            ("norm2.weight", (D,)),
            ("attn.qkv.weight", (3 * D, D)),
            ("attn.qkv.bias", (3 * D,)),
            ("attn.proj.weight", (D, D)),
            ("attn.proj.bias", (D,)),
            ("mlp.gate_proj.weight", (inner, D)),
            ("mlp.gate_proj.bias", (inner,)),
            ("mlp.up_proj.weight", (inner, D)),
            ("mlp.up_proj.bias", (inner,)),
            ("mlp.down_proj.weight", (D, inner)),
            ("mlp.down_proj.bias", (D,)),
        ]
        rules += [copy_rule(p + n, o + n, shape) for n, shape in r]
    m = "visual.merger."
    rules += [
        copy_rule(m + "ln_q.weight", "0." + m + "ln_q.weight", (D,)),
        copy_rule(m + "mlp.0.weight", "0." + m + "fc1.weight", (merged, merged)),
        copy_rule(m + "mlp.0.bias", "0." + m + "fc1.bias", (merged,)),
        copy_rule(m + "mlp.2.weight", "0." + m + "fc2.weight", (v.out_dim, merged)),
        copy_rule(m + "mlp.2.bias", "0." + m + "fc2.bias", (v.out_dim,)),
    ]
    return rules
