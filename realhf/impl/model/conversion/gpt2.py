"""gpt2: learned positions, LayerNorm, tanh-GELU MLP with biases, tied head.

HuggingFace names (transformers 5.x ``modeling_gpt2.py``): ``transformer.wte``,
``transformer.wpe``, ``transformer.h.{i}.ln_1``, ``.attn.c_attn`` (q|k|v fused),
``.attn.c_proj``, ``.ln_2``, ``.mlp.c_fc``, ``.mlp.c_proj``, ``transformer.ln_f``,
``lm_head``.  Its ``Conv1D`` layers store weights as ``[in, out]``, the
transpose of ours.  Old checkpoints omit the ``transformer.`` prefix; the reader
falls back to the unprefixed name.
"""

from __future__ import annotations

from typing import Any, Dict, List

from realhf.impl.model.conversion.hf_config import (
    UnsupportedCheckpoint,
    activation_from_hf,
    activation_to_hf,
    hf_extra_from,
)
from realhf.impl.model.conversion.rules import WeightRule, copy_rule
from realhf.impl.model.nn.model_config import ReaLModelConfig


def config_from_hf(family: str, hf, source: str) -> ReaLModelConfig:
    """Our config from a ``GPT2Config``."""
    unsupported = {
        "scale_attn_weights": (getattr(hf, "scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (
            getattr(hf, "scale_attn_by_inverse_layer_idx", False),
            False,
        ),
        "add_cross_attention": (getattr(hf, "add_cross_attention", False), False),
    }
    for field, (value, needed) in unsupported.items():
        if bool(value) != needed:
            raise UnsupportedCheckpoint(
                f"{source}: gpt2 option {field}={value!r} is not supported (ReaLModel "
                f"needs {field}={needed})"
            )
    hidden, n_heads = hf.n_embd, hf.n_head
    return ReaLModelConfig(
        family="gpt2",
        n_layers=hf.n_layer,
        hidden_dim=hidden,
        n_q_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=hidden // n_heads,
        intermediate_dim=getattr(hf, "n_inner", None) or 4 * hidden,
        vocab_size=hf.vocab_size,
        n_positions=hf.n_positions,
        layer_norm_epsilon=hf.layer_norm_epsilon,
        layer_norm_type="layer",
        activation=activation_from_hf(hf.activation_function, "activation_function", source),
        gated_mlp=False,
        use_attention_bias=True,
        use_attn_proj_bias=True,
        use_mlp_bias=True,
        qk_layernorm=False,
        tied_embedding=bool(getattr(hf, "tie_word_embeddings", True)),  # GPT2Config's default
        abs_position_embedding=True,
        init_std=float(getattr(hf, "initializer_range", 0.02)),
        hf_extra=hf_extra_from(hf),
    )


def config_to_hf(cfg: ReaLModelConfig) -> Dict[str, Any]:
    """Keyword arguments of ``GPT2Config`` for ``cfg``."""
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions,
        n_embd=cfg.hidden_dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_q_heads,
        n_inner=cfg.intermediate_dim,
        activation_function=activation_to_hf(cfg.activation, "gpt2"),
        layer_norm_epsilon=cfg.layer_norm_epsilon,
        tie_word_embeddings=cfg.tied_embedding,
        initializer_range=cfg.init_std,
    )


def check_representable(cfg: ReaLModelConfig) -> None:
    """Raise when ``cfg`` is not a plain gpt2 architecture."""
    ok = (
        cfg.layer_norm_type == "layer"
        and not cfg.gated_mlp
        and cfg.abs_position_embedding
        and cfg.use_attention_bias
        and cfg.use_attn_proj_bias
        and cfg.use_mlp_bias
        and not cfg.qk_layernorm
        and cfg.n_kv_heads == cfg.n_q_heads
        and cfg.head_dim * cfg.n_q_heads == cfg.hidden_dim
        and cfg.sliding_window is None
    )
    if not ok:
        raise UnsupportedCheckpoint(
            "ReaLModelConfig(family='gpt2') must have LayerNorm, a plain MLP, learned "
            "positions, all biases, no GQA/q-k norm/sliding window and "
            "head_dim * n_q_heads == hidden_dim to be written as a gpt2 checkpoint"
        )


def weight_rules(cfg: ReaLModelConfig) -> List[WeightRule]:
    """Rules for embeddings, blocks, final norm and (untied) LM head."""
    H, I = cfg.hidden_dim, cfg.intermediate_dim
    rules = [
        copy_rule("transformer.wte.weight", "0.wte.weight", (cfg.vocab_size, H)),
        copy_rule("transformer.wpe.weight", "0.wpe.weight", (cfg.n_positions, H)),
    ]
    for i in range(cfg.n_layers):
        p, o = f"transformer.h.{i}.", f"{i + 1}."
        qkv = tuple(o + f"attn.c_attn.{x}_attn" for x in "qkv")
        rules += [
            copy_rule(p + "ln_1.weight", o + "attn.c_attn.ln.weight", (H,)),
            copy_rule(p + "ln_1.bias", o + "attn.c_attn.ln.bias", (H,)),
            # One Conv1D [H, 3H] holds q | k | v side by side along its output dim.
            WeightRule(
                p + "attn.c_attn.weight",
                tuple(n + ".weight" for n in qkv),
                (H, 3 * H),
                "split_transpose",
                (H, H, H),
            ),
            WeightRule(
                p + "attn.c_attn.bias",
                tuple(n + ".bias" for n in qkv),
                (3 * H,),
                "split",
                (H, H, H),
            ),
            WeightRule(p + "attn.c_proj.weight", (o + "attn.c_proj.weight",), (H, H), "transpose"),
            copy_rule(p + "attn.c_proj.bias", o + "attn.c_proj.bias", (H,)),
            copy_rule(p + "ln_2.weight", o + "mlp.ln.weight", (H,)),
            copy_rule(p + "ln_2.bias", o + "mlp.ln.bias", (H,)),
            WeightRule(p + "mlp.c_fc.weight", (o + "mlp.c_fc.weight",), (H, I), "transpose"),
            copy_rule(p + "mlp.c_fc.bias", o + "mlp.c_fc.bias", (I,)),
            WeightRule(p + "mlp.c_proj.weight", (o + "mlp.c_proj.weight",), (I, H), "transpose"),
            copy_rule(p + "mlp.c_proj.bias", o + "mlp.c_proj.bias", (H,)),
        ]
    head = cfg.head_layer_idx
    rules += [
        copy_rule("transformer.ln_f.weight", f"{head}.ln_f.weight", (H,)),
        copy_rule("transformer.ln_f.bias", f"{head}.ln_f.bias", (H,)),
    ]
    if not cfg.is_critic and not cfg.tied_embedding:
        rules.append(copy_rule("lm_head.weight", f"{head}.weight", (cfg.vocab_size, H)))
    return rules
