"""llama, qwen2, qwen3 and mistral: RMSNorm, RoPE, gated SiLU MLP, GQA.

They differ only in switches: qwen2 has q/k/v biases; qwen3 has per-head q/k
RMSNorm, an explicit ``head_dim`` and an optional ``attention_bias`` (q/k/v/o);
llama has ``attention_bias`` (q/k/v/o) and ``mlp_bias``; mistral may have a
sliding window.  HuggingFace names (transformers 5.x ``modeling_{llama,qwen2,
qwen3,mistral}.py``): ``model.embed_tokens``, ``model.layers.{i}.input_layernorm``,
``.self_attn.{q,k,v,o}_proj``, ``.self_attn.{q,k}_norm`` (qwen3),
``.post_attention_layernorm``, ``.mlp.{gate,up,down}_proj``, ``model.norm``,
``lm_head``.
"""

from __future__ import annotations

from typing import Any, Dict, List

from realhf.impl.model.conversion.hf_config import (
    UnsupportedCheckpoint,
    activation_from_hf,
    activation_to_hf,
    hf_extra_from,
    rope_from_hf,
    rope_to_hf,
)
from realhf.impl.model.conversion.rules import WeightRule, copy_rule
from realhf.impl.model.nn.model_config import ReaLModelConfig

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def config_from_hf(family: str, hf, source: str) -> ReaLModelConfig:
    """Our config from a transformers config object of ``family``."""
    hidden, n_heads = hf.hidden_size, hf.num_attention_heads
    # qwen3 sets head_dim apart from hidden / heads; others may leave it out or None.
    head_dim = getattr(hf, "head_dim", None) or hidden // n_heads
    n_kv = getattr(hf, "num_key_value_heads", None) or n_heads
    attn_bias = bool(getattr(hf, "attention_bias", False))
    if family == "qwen2":  # hard-wired in Qwen2Attention, no config key
        qkv_bias, o_bias = True, False
    else:
        qkv_bias, o_bias = attn_bias, attn_bias
    window = _sliding_window_from_hf(family, hf, source)
    rope_theta, rope_scaling = rope_from_hf(hf, source)
    return ReaLModelConfig(
        family=family,
        n_layers=hf.num_hidden_layers,
        hidden_dim=hidden,
        n_q_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_dim=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        n_positions=hf.max_position_embeddings,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        layer_norm_epsilon=hf.rms_norm_eps,
        layer_norm_type="rms",
        activation=activation_from_hf(hf.hidden_act, "hidden_act", source),
        gated_mlp=True,
        use_attention_bias=qkv_bias,
        use_attn_proj_bias=o_bias,
        use_mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_layernorm=family == "qwen3",
        tied_embedding=bool(getattr(hf, "tie_word_embeddings", False)),
        abs_position_embedding=False,
        sliding_window=window,
        init_std=float(getattr(hf, "initializer_range", 0.02)),
        hf_extra=hf_extra_from(hf),
    )


def _sliding_window_from_hf(family: str, hf, source: str):
    if family == "mistral":
        return getattr(hf, "sliding_window", None)
    if family in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
        types = getattr(hf, "layer_types", None) or []
        kinds = set(types)
        if kinds == {"sliding_attention"}:
            return hf.sliding_window
        if "sliding_attention" in kinds:
            raise UnsupportedCheckpoint(
                f"{source}: use_sliding_window with max_window_layers="
                f"{getattr(hf, 'max_window_layers', None)} mixes sliding and full attention "
                "layers, which ReaLModel does not support; set use_sliding_window=false"
            )
    return None


def config_to_hf(cfg: ReaLModelConfig) -> Dict[str, Any]:
    """Keyword arguments of the transformers config class for ``cfg``."""
    kw: Dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_dim,
        intermediate_size=cfg.intermediate_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_q_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act=activation_to_hf(cfg.activation, "llama"),
        max_position_embeddings=cfg.n_positions,
        rms_norm_eps=cfg.layer_norm_epsilon,
        tie_word_embeddings=cfg.tied_embedding,
        rope_parameters=rope_to_hf(cfg),
        initializer_range=cfg.init_std,
    )
    if cfg.family in ("llama", "qwen3"):
        kw["attention_bias"] = cfg.use_attention_bias
    if cfg.family == "llama":
        kw["mlp_bias"] = cfg.use_mlp_bias
    if cfg.family == "mistral":
        kw["sliding_window"] = cfg.sliding_window
    elif cfg.family in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = cfg.sliding_window is not None
        if cfg.sliding_window is not None:
            kw["sliding_window"] = cfg.sliding_window
            # Layers from max_window_layers on use the window: 0 puts it on all of them,
            # the only layout ReaLModel has.
            kw["max_window_layers"] = 0
    return kw


def check_representable(cfg: ReaLModelConfig) -> None:
    """Raise when ``cfg`` has a switch the HF class of its family cannot express."""
    f = cfg.family
    bad = []
    if cfg.layer_norm_type != "rms" or not cfg.gated_mlp or cfg.abs_position_embedding:
        bad.append("layer_norm_type/gated_mlp/abs_position_embedding")
    if f == "qwen2" and (not cfg.use_attention_bias or cfg.use_attn_proj_bias):
        bad.append("qwen2 has q/k/v bias and no o_proj bias")
    if f in ("llama", "qwen3") and cfg.use_attention_bias != cfg.use_attn_proj_bias:
        bad.append(f"{f}'s attention_bias covers q/k/v and o_proj together")
    if f != "llama" and cfg.use_mlp_bias:
        bad.append(f"{f} has no mlp bias")
    if f == "mistral" and cfg.use_attention_bias:
        bad.append("mistral has no attention bias")
    if cfg.qk_layernorm != (f == "qwen3"):
        bad.append("q/k norm exists exactly in qwen3")
    if bad:
        raise UnsupportedCheckpoint(
            f"ReaLModelConfig(family={f!r}) cannot be written as a HuggingFace {f} "
            f"checkpoint: {'; '.join(bad)}"
        )


def weight_rules(cfg: ReaLModelConfig) -> List[WeightRule]:
    """Rules for the embedding, the blocks, the final norm and the LM head."""
    H, Q, KV, I = cfg.hidden_dim, cfg.q_dim, cfg.kv_dim, cfg.intermediate_dim
    rules = [copy_rule("model.embed_tokens.weight", "0.wte.weight", (cfg.vocab_size, H))]
    for i in range(cfg.n_layers):
        p, o = f"model.layers.{i}.", f"{i + 1}."
        r = [
            (p + "input_layernorm.weight", o + "attn.c_attn.ln.weight", (H,)),
            (p + "self_attn.q_proj.weight", o + "attn.c_attn.q_attn.weight", (Q, H)),
            (p + "self_attn.k_proj.weight", o + "attn.c_attn.k_attn.weight", (KV, H)),
            (p + "self_attn.v_proj.weight", o + "attn.c_attn.v_attn.weight", (KV, H)),
            (p + "self_attn.o_proj.weight", o + "attn.c_proj.weight", (H, Q)),
            (p + "post_attention_layernorm.weight", o + "mlp.ln.weight", (H,)),
            (p + "mlp.gate_proj.weight", o + "mlp.gate_proj.weight", (I, H)),
            (p + "mlp.up_proj.weight", o + "mlp.up_proj.weight", (I, H)),
            (p + "mlp.down_proj.weight", o + "mlp.down_proj.weight", (H, I)),
        ]
        if cfg.use_attention_bias:
            r += [
                (p + "self_attn.q_proj.bias", o + "attn.c_attn.q_attn.bias", (Q,)),
                (p + "self_attn.k_proj.bias", o + "attn.c_attn.k_attn.bias", (KV,)),
                (p + "self_attn.v_proj.bias", o + "attn.c_attn.v_attn.bias", (KV,)),
            ]
        if cfg.use_attn_proj_bias:
            r += [(p + "self_attn.o_proj.bias", o + "attn.c_proj.bias", (H,))]
        if cfg.qk_layernorm:
            r += [
                (p + "self_attn.q_norm.weight", o + "attn.q_ln.weight", (cfg.head_dim,)),
                (p + "self_attn.k_norm.weight", o + "attn.k_ln.weight", (cfg.head_dim,)),
            ]
        if cfg.use_mlp_bias:
            r += [
                (p + "mlp.gate_proj.bias", o + "mlp.gate_proj.bias", (I,)),
                (p + "mlp.up_proj.bias", o + "mlp.up_proj.bias", (I,)),
                (p + "mlp.down_proj.bias", o + "mlp.down_proj.bias", (H,)),
            ]
        rules += [copy_rule(*x) for x in r]
    head = cfg.head_layer_idx
    rules.append(copy_rule("model.norm.weight", f"{head}.ln_f.weight", (H,)))
    if not cfg.is_critic and not cfg.tied_embedding:
        rules.append(copy_rule("lm_head.weight", f"{head}.weight", (cfg.vocab_size, H)))
    return rules
