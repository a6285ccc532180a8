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


_ENTROPY_CHILD = """
import json, sys, torch, torch.distributed as dist
from realhf.impl.model.parallelism.tensor_parallel import TensorParallel
rank, init_file = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
full = torch.randn(5, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
local = full[:, rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)
h = TensorParallel(dist.group.WORLD, 2, rank).token_entropy(local)
(h * torch.arange(1.0, 6.0, dtype=torch.float64)).sum().backward()
print(json.dumps({"h": h.tolist(), "grad": local.grad.tolist()}))
dist.destroy_process_group()
from realhf.base import shutdown
shutdown.hard_exit(0)
"""


@pytest.mark.slow
def test_vocab_parallel_entropy_equals_the_unsharded_one(tmp_path):
    import json
    import subprocess
    import sys

    from realhf.impl.model.nn.parallel_hooks import LOCAL

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ENTROPY_CHILD, str(r), str(tmp_path / "init")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    full = torch.randn(5, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    full.requires_grad_(True)
    h = LOCAL.token_entropy(full)
    p = torch.softmax(full.detach(), -1)
    torch.testing.assert_close(h.detach(), -(p * p.log()).sum(-1))
    (h * torch.arange(1.0, 6.0, dtype=torch.float64)).sum().backward()
    for r, o in enumerate(outs):
        torch.testing.assert_close(torch.tensor(o["h"], dtype=torch.float64), h.detach())
        torch.testing.assert_close(
            torch.tensor(o["grad"], dtype=torch.float64), full.grad[:, r * 6 : (r + 1) * 6]
        )
