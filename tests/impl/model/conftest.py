"""Fixtures for ReaLModel tests: tiny random HF checkpoints per family, built once
per session (no downloads) and a packed batch of mixed lengths."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_hf_model

# Mixed lengths, including a length-1 sequence.
SEQLENS = [7, 19, 1, 33, 12]


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """``tiny_hf_dir(family, **overrides) -> path`` with caching per arguments."""
    cache = {}

    def make(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{family}")
            cache[key] = make_tiny_hf_model(family, d, **overrides)
        return cache[key]

    return make


@pytest.fixture
def packed_batch():
    """``(input_ids [T], cu_seqlens [B+1] int32, seqlens)`` over a 128-token vocab."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 128, (sum(SEQLENS),), generator=g)
    cu = torch.tensor([0] + SEQLENS).cumsum(0).to(torch.int32)
    return ids, cu, list(SEQLENS)
