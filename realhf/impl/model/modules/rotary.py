"""Rotary position embedding (RoPE) for packed tokens.

Follows the "rotate half" convention that HuggingFace llama/qwen/mistral
checkpoints are trained with: the head dimension is split in two halves that
are rotated as (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin), with frequency
``theta ** (-2i / head_dim)`` for pair ``i``.
"""

from __future__ import annotations

from typing import Tuple

import torch


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in float32."""
    # An int64 arange cast to float32, as HuggingFace does: a floating arange would take
    # torch's default dtype, which may be a half type, and round the frequencies.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (theta ** (exponents / head_dim))


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[T, head_dim]`` for positions ``[T]``.

    Angles are computed in float32 (positions up to ~1e5 lose precision in
    half types) and cast to the activation dtype, as HuggingFace does.
    """
    freqs = position_ids.float()[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [T, n_heads, head_dim]`` by per-token ``cos/sin: [T, head_dim]``."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
