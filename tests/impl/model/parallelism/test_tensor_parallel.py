"""Tensor parallelism's sharding rules, in one process (the multi-rank equality with one
device is in test_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from realhf.impl.model import ReaLModel
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.parallelism.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    shard_model,
    shard_tensor,
    unshard_tensor,
)

# ---- in-process checks of the rules ---------------------------------------------------


def _cfg(**kw) -> ReaLModelConfig:
    base = dict(
        family="qwen2",
        n_layers=2,
        hidden_dim=32,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim=8,
        intermediate_dim=64,
        vocab_size=64,
        use_attention_bias=True,
    )
    base.update(kw)
    return ReaLModelConfig(**base)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("critic", [False, True])
def test_shards_put_back_together_are_the_whole_parameter(m, critic):
    cfg = _cfg(is_critic=critic)
    torch.manual_seed(0)
    full = ReaLModel(cfg)
    shards = [shard_model(full, _FakeTP(m, r)) for r in range(m)]
    for name, p in full.named_parameters():
        parts = [dict(s.named_parameters())[name].detach() for s in shards]
        assert torch.equal(unshard_tensor(name, parts, cfg), p.detach()), name
    # Every rank's flat buffer holds only its shard: together m copies of what is replicated.
    if m > 1:
        assert all(s.flat_params.numel() < full.flat_params.numel() for s in shards)


def test_kv_heads_are_copied_when_fewer_than_ranks():
    cfg = _cfg(n_kv_heads=1)
    w = torch.arange(cfg.kv_dim * cfg.hidden_dim, dtype=torch.float32).view(cfg.kv_dim, -1)
    name = "1.attn.c_attn.k_attn.weight"
    parts = [shard_tensor(name, w, cfg, 4, r) for r in range(4)]
    assert all(torch.equal(p, w) for p in parts)
    cfg2 = _cfg(n_kv_heads=2)
    w2 = torch.randn(cfg2.kv_dim, cfg2.hidden_dim)
    parts = [shard_tensor(name, w2, cfg2, 4, r) for r in range(4)]
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])
    assert torch.equal(torch.cat([parts[0], parts[2]]), w2)


@pytest.mark.parametrize(
    "kw, m, needle",
    [
        (dict(n_q_heads=6, n_kv_heads=2), 4, "n_q_heads=6"),
        (dict(n_q_heads=6, n_kv_heads=3), 2, "n_kv_heads=3"),
        (dict(intermediate_dim=66), 4, "intermediate_dim=66"),
        (dict(vocab_size=65), 2, "vocab_size=65"),
    ],
)
def test_indivisible_dimensions_are_named(kw, m, needle):
    with pytest.raises(ValueError, match=needle) as ei:
        check_tensor_parallel(_cfg(**kw), m)
    assert f"m={m}" in str(ei.value)


class _FakeTP(TensorParallel):
    """Hooks for building shards in one process (no collectives are run)."""

    def __init__(self, m, r):
        super().__init__(object() if m > 1 else None, m, r)
