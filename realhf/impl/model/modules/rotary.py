"""Rotary position embedding (RoPE) for packed tokens.

Follows the "rotate half" convention that HuggingFace llama/qwen/mistral
checkpoints are trained with: the head dimension is split in two halves that
are rotated as (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), with frequency
``theta ** (-2i / head_dim)`` for pair ``i``.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

import torch

from realhf.impl.kernels import simd_cpu
from realhf.impl.model.modules.norm import FUSED_DTYPES

#: the RoPE scalings implemented (``rope_type`` of HuggingFace's rope_parameters)
SUPPORTED_ROPE_SCALING = ("llama3",)
#: the keys of a llama3 scaling
LLAMA3_ROPE_KEYS = (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
)  # fmt: skip


def rope_inv_freq(
    head_dim: int, theta: float, device=None, scaling: Optional[Mapping[str, float]] = None
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32.

    ``scaling``: a llama3 RoPE scaling (Llama 3.1/3.2's ``rope_scaling``, keys
    :data:`LLAMA3_ROPE_KEYS`): wavelengths longer than the original context divided by
    ``low_freq_factor`` are stretched ``factor`` times, those shorter than it divided by
    ``high_freq_factor`` kept, and the band between interpolated smoothly.
    """
    # An int64 arange cast to float32, as HuggingFace does: a floating arange would take
    # torch's default dtype, which may be a half type, and round the frequencies.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high, context = (float(scaling[k]) for k in LLAMA3_ROPE_KEYS)
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    between = (wavelen >= context / high) & (wavelen <= context / low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    return torch.where(between, blended, stretched)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The tables :func:`apply_rope` takes for positions ``[T]``: cos and the signed sin,
    ``[T, 1, head_dim]`` each (see :func:`_tables`).

    Angles are computed in float32 (positions up to ~1e5 lose precision in
    half types) and cast to the activation dtype, as HuggingFace does.
    """
    freqs = position_ids.float()[:, None] * inv_freq[None, :].float()
    return _tables(torch.cat((freqs, freqs), dim=-1), dtype)


def _tables(emb: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos(emb)`` and ``sin(emb)`` with the first half negated, in ``dtype``, with a
    head axis: ``[T, 1, head_dim]``.  Negating before the cast is exact, so the products
    of :func:`apply_rope` are HuggingFace's bit for bit."""
    half = emb.shape[-1] // 2
    sin = emb.sin()
    sin[:, :half].neg_()
    return emb.cos().to(dtype)[:, None], sin.to(dtype)[:, None]


def mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    section: Tuple[int, ...],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE (Qwen2-VL's): :func:`apply_rope`'s tables for positions ``[3, T]``.

    The frequency pairs are cut into ``section`` (temporal, height, width) bands, and
    band ``i`` rotates by position axis ``i``.  With three equal axes this is
    :func:`rope_cos_sin`.
    """
    freqs = position_ids.float()[..., None] * inv_freq.float()  # [3, T, head_dim / 2]
    bands = freqs.split(list(section), dim=-1)
    freqs = torch.cat([band[i % 3] for i, band in enumerate(bands)], dim=-1)
    return _tables(torch.cat((freqs, freqs), dim=-1), dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, n_heads, head_dim]`` (any strides) by the tables of
    :func:`rope_cos_sin` / :func:`mrope_cos_sin`.

    HuggingFace's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2,
    x1)``: here the halves are swapped by a roll and the sign is in the table, which
    gives the same products in two fewer operations per call.

    Under ``torch.inference_mode()`` (the generation engine) on a CPU with AVX2 or
    AVX-512, float32 and bfloat16 go through one C++ pass (``realhf._C.rope``), equal to
    these ops bit for bit.
    """
    ext = simd_cpu() if torch.is_inference_mode_enabled() else None
    if ext is not None and _fusable(x, cos, sin):
        return ext.rope(x, cos, sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def _fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    T, _, D = x.shape if x.dim() == 3 else (None, None, None)
    return (
        T is not None
        and x.device.type == "cpu"
        and x.dtype in FUSED_DTYPES
        and x.stride(-1) == 1
        and D % 2 == 0
        and all(
            t.dtype == x.dtype and t.shape == (T, 1, D) and t.stride(-1) == 1 for t in (cos, sin)
        )
        and cos.stride(0) == sin.stride(0)
    )
