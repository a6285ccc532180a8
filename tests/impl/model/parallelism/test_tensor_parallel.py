"""Tensor parallelism's sharding rules, in one process (the multi-rank equality with one
device is in test_layouts.py)."""

from __future__ import annotations

import pytest
import torch

from realhf.impl.kernels import simd_cpu
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


_VOCAB_CHILD = """
import json, sys, torch, torch.distributed as dist
from realhf.impl.model.modules import vocab_chunked
from realhf.impl.model.parallelism.tensor_parallel import TensorParallel
rank, init_file, impl = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if impl == "torch":  # the block-wise torch ops even where the C++ row kernels run
    vocab_chunked.simd_cpu = lambda: None
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
full = torch.randn(7, 12, generator=torch.Generator().manual_seed(0)) * 3
local = full[:, rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)
rows, labels = torch.tensor([6, 0, 3, 4, 1]), torch.tensor([0, 11, 5, 6, 7])
vocab_chunked.BLOCK_BYTES = 48  # two rows of 6 entries a block: three blocks per call
tp = TensorParallel(dist.group.WORLD, 2, rank)
h = tp.token_entropy(local, rows=rows, temperature=0.7)
lp = tp.token_log_probs(local, labels, rows=rows, temperature=0.7)
w = torch.arange(1.0, 6.0)
((h * w).sum() + (lp * w.flip(0)).sum()).backward()
print(json.dumps({"h": h.tolist(), "lp": lp.tolist(), "grad": local.grad.tolist()}))
dist.destroy_process_group()
from realhf.base import shutdown
shutdown.hard_exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_vocab_parallel_log_probs_and_entropy_equal_the_unsharded_ones(tmp_path, impl):
    """Logits split by vocabulary over two gloo ranks, read in blocks of rows (or by the C++
    row kernels, where this CPU runs them): log-probs, entropies and gradients equal a plain
    log-softmax of the whole logits."""
    if impl == "cpp" and simd_cpu() is None:
        pytest.skip("the C++ row kernels need AVX2 or AVX-512 and realhf._C")
    import json
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _VOCAB_CHILD, str(r), str(tmp_path / "init"), impl],
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
    full = (torch.randn(7, 12, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_()
    rows, labels = torch.tensor([6, 0, 3, 4, 1]), torch.tensor([0, 11, 5, 6, 7])
    logp = torch.log_softmax(full[rows] / 0.7, -1)
    h, lp = -(logp.exp() * logp).sum(-1), logp.gather(-1, labels[:, None])[:, 0]
    w = torch.arange(1.0, 6.0)
    ((h * w).sum() + (lp * w.flip(0)).sum()).backward()
    for r, o in enumerate(outs):
        torch.testing.assert_close(torch.tensor(o["h"]), h.detach())
        torch.testing.assert_close(torch.tensor(o["lp"]), lp.detach())
        torch.testing.assert_close(torch.tensor(o["grad"]), full.grad[:, r * 6 : (r + 1) * 6])
