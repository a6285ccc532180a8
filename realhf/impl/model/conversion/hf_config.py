"""Errors and small config helpers shared by the family converters."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from realhf.impl.model.modules.rotary import LLAMA3_ROPE_KEYS, SUPPORTED_ROPE_SCALING


class CheckpointError(ValueError):
    """A HuggingFace checkpoint cannot be read as a ReaLModel (names the file
    and, where relevant, the parameter)."""


class UnsupportedCheckpoint(CheckpointError):
    """The checkpoint uses an architecture or option ReaLModel does not implement."""


# Config keys without architectural meaning that save_hf writes back unchanged.
HF_EXTRA_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
)

_ACT_FROM_HF = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


def activation_from_hf(name: str, field: str, source: str) -> str:
    """Our activation name for HF's ``hidden_act``/``activation_function``."""
    if name not in _ACT_FROM_HF:
        raise UnsupportedCheckpoint(
            f"{source}: {field}={name!r} is not supported; supported: {sorted(_ACT_FROM_HF)}"
        )
    return _ACT_FROM_HF[name]


def activation_to_hf(name: str, family: str) -> str:
    """HF activation name for our ``activation`` (gpt2 calls tanh-GELU gelu_new)."""
    if name == "gelu_tanh":
        return "gelu_new" if family == "gpt2" else "gelu_pytorch_tanh"
    return name


def rope_from_hf(hf, source: str) -> Tuple[float, Optional[Dict[str, float]]]:
    """RoPE base and scaling (None, or llama3's) from a transformers config."""
    # transformers 5 keeps RoPE settings in rope_parameters; older configs have
    # rope_scaling and a top-level rope_theta. Either may be present.
    params = getattr(hf, "rope_parameters", None) or {}
    legacy = getattr(hf, "rope_scaling", None) or {}
    scaling = None
    for d in (params, legacy):
        kind = d.get("rope_type", d.get("type", "default")) if isinstance(d, dict) else None
        if kind == "llama3":
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in d]
            if missing:
                raise UnsupportedCheckpoint(f"{source}: llama3 RoPE scaling without {missing}")
            scaling = {k: float(d[k]) for k in LLAMA3_ROPE_KEYS}
        elif kind not in ("default", None):
            raise UnsupportedCheckpoint(
                f"{source}: rope type {kind!r} (rope_parameters/rope_scaling) is not "
                f"supported; ReaLModel implements plain RoPE and the scalings "
                f"{SUPPORTED_ROPE_SCALING}"
            )
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(hf, "rope_theta", None) or 10000.0
    return float(theta), scaling


def rope_to_hf(cfg) -> Dict[str, Any]:
    """transformers' ``rope_parameters`` of a ReaLModelConfig."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **cfg.rope_scaling}


def hf_extra_from(hf) -> Dict[str, Any]:
    """The non-architectural keys of a transformers config worth keeping."""
    out = {}
    for k in HF_EXTRA_KEYS:
        v = getattr(hf, k, None)
        if v is not None:
            out[k] = v
    return out
