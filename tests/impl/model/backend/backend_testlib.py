"""Shared pieces of the backend tests: a tiny ReaLModel, a packed batch, a token-mean
next-token loss, and the per-rank body of the data-parallel test (a top-level function so
that ``torch.multiprocessing.spawn`` can pickle it)."""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.impl.model import ReaLModel, ReaLModelConfig
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

VOCAB = 64
SEQLENS = [5, 9, 3, 12, 7, 4, 10, 6]


def tiny_config(**kw) -> ReaLModelConfig:
    """A 2-layer qwen2-like model of ~20k parameters (with biases and norms)."""
    base = dict(
        family="qwen2",
        n_layers=2,
        hidden_dim=32,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim=8,
        intermediate_dim=64,
        vocab_size=VOCAB,
        n_positions=128,
        use_attention_bias=True,
        tied_embedding=True,
    )
    base.update(kw)
    return ReaLModelConfig(**base)


def tiny_model(seed: int = 0, **kw) -> ReaLModel:
    """The same random weights for the same seed."""
    torch.manual_seed(seed)
    return ReaLModel(tiny_config(**kw))


def batch(seqlens=SEQLENS, seed: int = 1, prefix: str = "s") -> SequenceSample:
    """One sequence per item, random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(seqlens),), generator=g)
    return SequenceSample.from_default(
        ids=[f"{prefix}{i}" for i in range(len(seqlens))],
        seqlens=list(seqlens),
        data={"packed_input_ids": ids},
    )


def lm_loss(logits: torch.Tensor, mb: SequenceSample):
    """Mean next-token NLL over the micro-batch's predicted tokens."""
    ids = mb.data["packed_input_ids"]
    logp = gather_packed_shifted_log_probs(logits, mb.cu_seqlens("packed_input_ids"), ids)
    return -logp.mean(), {"mean_logp": logp.mean().detach()}


def lm_weight(mb: SequenceSample) -> int:
    """Number of predicted tokens (L - 1 per sequence)."""
    return sum(l - 1 for l in mb.flat_seqlens("packed_input_ids"))


def optimizer_config(**kw) -> OptimizerConfig:
    base = dict(lr=1e-2, weight_decay=0.1, eps=1e-8, gradient_clipping=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def dp_rank_main(
    rank: int,
    world: int,
    init_file: str,
    out_file: str,
    n_steps: int,
    shards,
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    opt=None,
):
    """Train on this rank's shard for ``n_steps`` steps; rank 0 saves the flat weights (fp32
    master weights where there are any), the step statistics, the engine's state dict and
    its optimizer bytes.

    Then a fresh engine on a copy of the model loads that state dict and both take one more
    step: rank 0 also saves both engines' weights after it (a resumed run continues exactly).
    """
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        engine = TrainEngine(tiny_model().to(dtype), optimizer_config(**(opt or {})))
        full = batch()
        local = full.select_items(shards[rank])
        spec = MicroBatchSpec(max_tokens_per_mb=max_tokens)
        stats = []
        for _ in range(n_steps):
            stats.append(engine.train_batch(local, spec, lm_loss, lm_weight))
        state = engine.state_dict()  # every rank: a collective under ZeRO
        flat = state.get("master", engine.model.flat_params).float().clone()
        resumed = TrainEngine(tiny_model().to(dtype), optimizer_config(**(opt or {})))
        with torch.no_grad():
            resumed.model.flat_params.copy_(engine.model.flat_params)
        # A copy, as from a checkpoint file: the state dict references the live moments.
        resumed.load_state_dict(copy.deepcopy(state))
        after = []
        for e in (engine, resumed):
            e.train_batch(local, spec, lm_loss, lm_weight)
            after.append(e.model.flat_params.float().clone())
        if rank == 0:
            torch.save(
                {
                    "flat": flat,
                    "stats": stats,
                    "state": state,
                    "opt_bytes": engine.optimizer_state_bytes(),
                    "after": after,
                },
                out_file,
            )
    finally:
        dist.destroy_process_group()
    from realhf.base import shutdown

    shutdown.hard_exit(0)  # a plain return could abort in teardown (see base/shutdown.py)
