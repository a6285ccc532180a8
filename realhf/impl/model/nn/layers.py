"""The three kinds of ReaLModel layers: embedding, transformer block, head.

Layers do not allocate their own weights.  Each one *declares* its parameters
(``param_decls``: local name, shape, initialisation); :class:`ReaLModel`
allocates one flat buffer for all layers and registers a view of it under each
declared name (see :mod:`realhf.impl.model.nn.flat_param`).  The forward code
then reads the weights as ordinary attributes (``self.attn.c_proj.weight``).

Under tensor parallelism the layers are built from the rank's local config (its share of
heads, MLP width and vocabulary) and call the hooks of ``tp``
(:mod:`realhf.impl.model.nn.parallel_hooks`) where the sharded computation differs.

Parameter names (``{layer}.{local}``), e.g. for block 3 of a qwen2 model:
``3.attn.c_attn.ln.weight``, ``3.attn.c_attn.q_attn.{weight,bias}``,
``3.attn.c_attn.k_attn.*``, ``3.attn.c_attn.v_attn.*``, ``3.attn.c_proj.weight``,
``3.mlp.ln.weight``, ``3.mlp.{gate_proj,up_proj,down_proj}.weight``; qwen3 adds
``3.attn.q_ln.weight`` / ``3.attn.k_ln.weight``; gpt2's MLP is
``3.mlp.c_fc.*`` / ``3.mlp.c_proj.*``.  Layer 0 holds ``0.wte.weight`` (and gpt2's
``0.wpe.weight``); the head ``{n+1}.ln_f.*`` and ``{n+1}.weight`` (absent when
the embedding is tied; critics add ``{n+1}.bias``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from realhf.impl.model.modules import grad_in_place
from realhf.impl.model.modules.attention import packed_causal_attention
from realhf.impl.model.modules.gated_act import gated_act
from realhf.impl.model.modules.norm import norm, rms_norm
from realhf.impl.model.modules.rotary import apply_rope
from realhf.impl.model.modules.shared_prefix import SharedPrefix
from realhf.impl.model.nn.lora import column_delta, row_delta
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.packed_linear import packed_or_none
from realhf.impl.model.nn.parallel_hooks import LOCAL, LocalHooks
from realhf.impl.model.nn.vision import VisionInputs, vision_forward, vision_param_decls

# (local name, shape, init) with init in {"normal", "ones", "zeros"}.
ParamDecl = Tuple[str, Tuple[int, ...], str]

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclasses.dataclass
class PackedContext:
    """What every block needs to know about the packed batch it runs on.

    Attributes:
        cu_seqlens: ``[B+1]`` sequence offsets into the packed tokens.
        max_seqlen: longest sequence of the pack (for flash-attention).
        cos, sin: RoPE tables ``[T, 1, head_dim]`` for the tokens' positions (see
            ``rotary.rope_cos_sin``), or ``None`` for models with learned positions.
        attn_fn: optional replacement of the packed causal attention (the
            KV-cache hook of the generation engine), see ``ReaLModel.forward``.
        attn_impl: implementation name passed to ``packed_causal_attention``.
        shared_prefix: a :class:`SharedPrefix` whose attention replaces the packed one
            (the pack then holds each shared prompt once).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: Optional[int]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    attn_fn: Optional[AttnFn] = None
    attn_impl: str = "auto"
    shared_prefix: Optional[SharedPrefix] = None


def _plus(y: torch.Tensor, delta: Optional[torch.Tensor]) -> torch.Tensor:
    return y if delta is None else y + delta


def _linear(mod: nn.Module, x: torch.Tensor, tp: LocalHooks = LOCAL) -> torch.Tensor:
    """A column-parallel projection (input after ``tp.copy_in``), with its LoRA term."""
    pk = packed_or_none(mod, "packed", [mod.weight])
    if pk is not None:  # (a generation engine's single-device model: bias included)
        return _plus(pk(x), column_delta(mod, x, tp))
    return _plus(F.linear(x, mod.weight, getattr(mod, "bias", None)), column_delta(mod, x, tp))


def _row_linear(mod: nn.Module, x: torch.Tensor, tp: LocalHooks) -> torch.Tensor:
    pk = packed_or_none(mod, "packed", [mod.weight])
    if pk is not None:
        return _plus(pk(x), row_delta(mod, x, tp))
    # The bias is added once, after the partial products are summed over ranks.
    y = _plus(tp.reduce_out(F.linear(x, mod.weight)), row_delta(mod, x, tp))
    b = getattr(mod, "bias", None)
    return y if b is None else y + b


def _norm(mod: nn.Module, x: torch.Tensor, cfg: ReaLModelConfig) -> torch.Tensor:
    return norm(
        x, mod.weight, getattr(mod, "bias", None), cfg.layer_norm_epsilon, cfg.layer_norm_type
    )


def _norm_decls(prefix: str, cfg: ReaLModelConfig, dim: int) -> List[ParamDecl]:
    decls = [(f"{prefix}.weight", (dim,), "ones")]
    if cfg.layer_norm_type == "layer":
        decls.append((f"{prefix}.bias", (dim,), "zeros"))
    return decls


def _linear_decls(prefix: str, out_dim: int, in_dim: int, bias: bool) -> List[ParamDecl]:
    decls = [(f"{prefix}.weight", (out_dim, in_dim), "normal")]
    if bias:
        decls.append((f"{prefix}.bias", (out_dim,), "zeros"))
    return decls


class EmbeddingLayer(nn.Module):
    """Layer 0: token embedding, plus learned positions for gpt2, plus the vision tower
    of a vision-language model (whose image tokens replace the image placeholders)."""

    def __init__(self, config: ReaLModelConfig, tp: LocalHooks = LOCAL):
        super().__init__()
        self.config = config
        self.tp = tp

    @staticmethod
    def param_decls(cfg: ReaLModelConfig) -> List[ParamDecl]:
        """Parameters of the embedding layer."""
        decls = [("wte.weight", (cfg.vocab_size, cfg.hidden_dim), "normal")]
        if cfg.abs_position_embedding:
            decls.append(("wpe.weight", (cfg.n_positions, cfg.hidden_dim), "normal"))
        if cfg.vision is not None:
            decls += vision_param_decls(cfg.vision)
        return decls

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        images: Optional[VisionInputs] = None,
    ) -> torch.Tensor:
        """``[T]`` token ids (and positions, and images) -> hidden states ``[T, hidden_dim]``."""
        h = self.tp.embed(input_ids, self.wte.weight)
        if self.config.abs_position_embedding:
            h = h + F.embedding(position_ids, self.wpe.weight)
        if images is not None and images.n_images:
            v = self.config.vision
            feats = vision_forward(self.visual, v, images, _ACTIVATIONS[v.activation])
            where = input_ids == v.image_token_id
            if int(where.sum()) != feats.shape[0]:
                raise ValueError(
                    f"the tokens hold {int(where.sum())} image placeholders (id "
                    f"{v.image_token_id}) but the {images.n_images} images make "
                    f"{feats.shape[0]} image tokens"
                )
            # (index_put, not in place on h: the embedding's output may be a view a
            # backward needs)
            h = h.index_put((where.nonzero().squeeze(-1),), feats.to(h.dtype))
        return h


class TransformerBlock(nn.Module):
    """Layers 1..n: pre-norm attention and MLP with residual connections."""

    def __init__(self, config: ReaLModelConfig, block_idx: int, tp: LocalHooks = LOCAL):
        super().__init__()
        self.config = config
        self.tp = tp
        # 0-based like HuggingFace's layer_idx; the block's parameter prefix is block_idx + 1.
        self.block_idx = block_idx
        self._act = _ACTIVATIONS[config.activation]

    @staticmethod
    def param_decls(cfg: ReaLModelConfig) -> List[ParamDecl]:
        """Parameters of one transformer block."""
        h = cfg.hidden_dim
        d: List[ParamDecl] = _norm_decls("attn.c_attn.ln", cfg, h)
        # q, k, v weights are declared next to each other so that one slice of
        # the flat buffer covers the whole QKV projection.
        d += [("attn.c_attn.q_attn.weight", (cfg.q_dim, h), "normal")]
        d += [("attn.c_attn.k_attn.weight", (cfg.kv_dim, h), "normal")]
        d += [("attn.c_attn.v_attn.weight", (cfg.kv_dim, h), "normal")]
        if cfg.use_attention_bias:
            d += [("attn.c_attn.q_attn.bias", (cfg.q_dim,), "zeros")]
            d += [("attn.c_attn.k_attn.bias", (cfg.kv_dim,), "zeros")]
            d += [("attn.c_attn.v_attn.bias", (cfg.kv_dim,), "zeros")]
        if cfg.qk_layernorm:
            d += [("attn.q_ln.weight", (cfg.head_dim,), "ones")]
            d += [("attn.k_ln.weight", (cfg.head_dim,), "ones")]
        d += _linear_decls("attn.c_proj", h, cfg.q_dim, cfg.use_attn_proj_bias)
        d += _norm_decls("mlp.ln", cfg, h)
        i, b = cfg.intermediate_dim, cfg.use_mlp_bias
        if cfg.gated_mlp:
            d += _linear_decls("mlp.gate_proj", i, h, b)
            d += _linear_decls("mlp.up_proj", i, h, b)
            d += _linear_decls("mlp.down_proj", h, i, b)
        else:
            d += _linear_decls("mlp.c_fc", i, h, b)
            d += _linear_decls("mlp.c_proj", h, i, b)
        return d

    def forward(self, h: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        """Hidden states ``[T, hidden_dim]`` -> ``[T, hidden_dim]``."""
        h = h + self._attention(_norm(self.attn.c_attn.ln, h, self.config), ctx)
        return h + self._mlp(_norm(self.mlp.ln, h, self.config))

    def qkv(self, x: torch.Tensor, ctx: PackedContext):
        """Projected, normed and rotated q ``[T, nq, d]``, k and v ``[T, nkv, d]``."""
        cfg, ca, tp = self.config, self.attn.c_attn, self.tp
        T = x.shape[0]
        x = tp.copy_in(x)
        pk = packed_or_none(
            ca, "packed_qkv", [ca.q_attn.weight, ca.k_attn.weight, ca.v_attn.weight]
        )
        if pk is not None:  # one product for the three
            y = pk(x)
            deltas = [column_delta(m, x, tp) for m in (ca.q_attn, ca.k_attn, ca.v_attn)]
            if not cfg.qk_layernorm and all(dt is None for dt in deltas):
                # q and k lie side by side in y: one rotation for both, and views of the
                # product rather than copies (decoding runs this for every token).
                nq, qk_dim = cfg.n_q_heads, cfg.q_dim + cfg.kv_dim
                qk = y[:, :qk_dim].view(T, nq + cfg.n_kv_heads, cfg.head_dim)
                if ctx.cos is not None:
                    qk = apply_rope(qk, ctx.cos, ctx.sin)
                return qk[:, :nq], qk[:, nq:], y[:, qk_dim:].view(T, -1, cfg.head_dim)
            q, k, v = (
                _plus(t.contiguous(), dt)
                for t, dt in zip(y.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1), deltas)
            )
        else:
            q, k, v = _linear(ca.q_attn, x, tp), self._kv(ca.k_attn, x), self._kv(ca.v_attn, x)
        q = q.view(T, cfg.n_q_heads, cfg.head_dim)
        k = k.view(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.n_kv_heads, cfg.head_dim)
        # Order as in HuggingFace: per-head q/k norm (qwen3), then RoPE. The norm is over
        # head_dim, so it sees one head at a time.
        if cfg.qk_layernorm:
            q = rms_norm(q, tp.head_weight(self.attn.q_ln.weight), cfg.layer_norm_epsilon)
            k = rms_norm(k, tp.head_weight(self.attn.k_ln.weight), cfg.layer_norm_epsilon)
        if ctx.cos is not None:
            q = apply_rope(q, ctx.cos, ctx.sin)
            k = apply_rope(k, ctx.cos, ctx.sin)
        return q, k, v

    def _kv(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b = getattr(mod, "bias", None)
        y = F.linear(x, self.tp.kv_weight(mod.weight), None if b is None else self.tp.kv_weight(b))
        return _plus(y, column_delta(mod, x, self.tp))

    def _attention(self, x: torch.Tensor, ctx: PackedContext) -> torch.Tensor:
        q, k, v = self.qkv(x, ctx)
        if ctx.attn_fn is not None:
            o = ctx.attn_fn(self.block_idx, q, k, v)
            if o.shape != q.shape:
                raise ValueError(
                    f"attn_fn for layer {self.block_idx} returned shape {tuple(o.shape)}, "
                    f"expected {tuple(q.shape)} (= q's shape [T, n_q_heads, head_dim])"
                )
        elif ctx.shared_prefix is not None:
            o = ctx.shared_prefix.attention(q, k, v)
        else:
            o = packed_causal_attention(
                q,
                k,
                v,
                ctx.cu_seqlens,
                max_seqlen=ctx.max_seqlen,
                sliding_window=self.config.sliding_window,
                impl=ctx.attn_impl,
            )
        o = o.reshape(x.shape[0], self.config.q_dim)
        return _row_linear(self.attn.c_proj, o, self.tp)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        m, tp = self.mlp, self.tp
        x = tp.copy_in(x)
        if self.config.gated_mlp:  # SwiGLU-style: act(gate(x)) scales up(x)
            pk = packed_or_none(m, "packed_gate_up", [m.gate_proj.weight, m.up_proj.weight])
            if pk is not None:  # one product for the two
                gate, up = pk(x).chunk(2, dim=-1)
                gate = _plus(gate, column_delta(m.gate_proj, x, tp))
                up = _plus(up, column_delta(m.up_proj, x, tp))
                return _row_linear(m.down_proj, gated_act(self._act, gate, up), tp)
            a = gated_act(self._act, _linear(m.gate_proj, x, tp), _linear(m.up_proj, x, tp))
            return _row_linear(m.down_proj, a, tp)
        return _row_linear(m.c_proj, self._act(_linear(m.c_fc, x, tp)), tp)


class OutputHead(nn.Module):
    """Layer n+1: final norm, then the LM head (logits) or the value head.

    Under tensor parallelism the LM head is vocabulary-parallel (each rank computes the
    logits of its vocabulary rows) and the value head is replicated.
    """

    def __init__(self, config: ReaLModelConfig, tp: LocalHooks = LOCAL):
        super().__init__()
        self.config = config
        self.tp = tp

    @staticmethod
    def param_decls(cfg: ReaLModelConfig) -> List[ParamDecl]:
        """Parameters of the head; no LM-head matrix when it is the embedding's."""
        decls = _norm_decls("ln_f", cfg, cfg.hidden_dim)
        if cfg.is_critic:
            # With a bias, as the score layer of HuggingFace's token-classification models
            # that save_hf writes critics as.
            decls += _linear_decls("", 1, cfg.hidden_dim, bias=True)
        elif not cfg.tied_embedding:
            decls += _linear_decls("", cfg.vocab_size, cfg.hidden_dim, bias=False)
        # "" prefix gives ".weight"; strip the dot so names read "{n+1}.weight".
        return [(n.lstrip("."), s, i) for n, s, i in decls]

    def forward(self, h: torch.Tensor, tied_weight: Optional[torch.Tensor]) -> torch.Tensor:
        """``[T, hidden_dim]`` -> logits ``[T, vocab]`` or values ``[T]``.

        A critic given ``tied_weight`` (``ReaLModel(critic_lm_logits=True)``) returns
        ``[T, 1 + vocab]``: its values, then the logits of the tied LM head."""
        x = _norm(self.ln_f, h, self.config)
        if self.config.is_critic:
            # A LoRA critic trains a copy of its value head (PEFT's modules_to_save).
            w, b = getattr(self, "lora_value", None) or (self.weight, self.bias)
            values = F.linear(x, w, b)
            if tied_weight is None:
                return values.squeeze(-1)
            return torch.cat([values, F.linear(self.tp.copy_in(x), tied_weight)], dim=-1)
        w = tied_weight if self.config.tied_embedding else self.weight
        pk = packed_or_none(self, "packed", [w])
        if pk is not None:
            return pk(x)
        # (its weight gradient is added into .grad in place: modules/grad_in_place.py)
        return grad_in_place.linear(self.tp.copy_in(x), w)
