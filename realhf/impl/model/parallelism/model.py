"""A rank's part of a ReaLModel in a parallel layout: checks, pipeline stages, loading.

A rank of a ``dXpYmZ`` layout holds the layers of its pipeline stage (:func:`stage_layers`:
contiguous blocks balanced by parameter count, the embedding on the first stage, the head on
the last), each split over the tensor-parallel group.  :class:`GridHooks` are the model's
hooks: tensor parallelism plus loading, gathering and running across stages.  The engines
(:mod:`realhf.impl.model.backend`) run micro-batches through the stages.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from realhf.api.core.allocation import ParallelismConfig
from realhf.impl.model.nn.layers import EmbeddingLayer, OutputHead, TransformerBlock
from realhf.impl.model.nn.lora import add_lora, all_parameters
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.parallelism.grid import ParallelGrid
from realhf.impl.model.parallelism.tensor_parallel import (
    TensorParallel,
    check_tensor_parallel,
    shard_tensor,
    unshard_tensor,
)

__all__ = ["check_layout", "load_model", "stage_layers", "GridHooks"]


def check_layout(config: ReaLModelConfig, layout: ParallelismConfig, what: str = "model") -> None:
    """Raise ValueError (naming the dimension and the fix) unless ``config`` can be split
    as ``layout`` says."""
    try:
        check_tensor_parallel(config, layout.tensor)
    except ValueError as e:
        raise ValueError(f"{what} in layout {layout}: {e}") from None
    if layout.pipe > config.n_layers:
        raise ValueError(
            f"{what} in layout {layout}: {layout.pipe} pipeline stages for "
            f"{config.n_layers} transformer layers; use p <= {config.n_layers}"
        )


def load_model(
    path: Union[str, os.PathLike],
    grid: ParallelGrid,
    *,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    is_critic: bool = False,
    **kwargs,
) -> ReaLModel:
    """This rank's part of the HuggingFace checkpoint ``path`` in ``grid``'s layout.

    ``kwargs`` go to the ReaLModel constructor (``gradient_checkpointing``, ...).
    """
    from realhf.impl.model.conversion import hf

    config = hf.config_from_hf_dir(path, is_critic=is_critic)
    check_layout(config, grid.layout, f"model {str(path)!r}")
    hooks = GridHooks(grid)
    return ReaLModel.from_hf(
        path, dtype=dtype, device=device, is_critic=is_critic, tp=hooks, **kwargs
    )


# ---- pipeline stages --------------------------------------------------------------------


def _numel(decls) -> int:
    return sum(math.prod(shape) for _, shape, _ in decls)


def stage_layers(config: ReaLModelConfig, p: int) -> List[Tuple[int, int]]:
    """Layer ranges ``[start, end)`` of ``p`` pipeline stages, balanced by parameter count.

    Every stage holds at least one transformer block; the first also holds the embedding
    (layer 0), the last the head (layer ``n_layers + 1``).  The split minimises the largest
    stage's parameter count.
    """
    n = config.n_layers
    if not 1 <= p <= n:
        raise ValueError(f"{p} pipeline stages for {n} transformer layers; use 1 <= p <= {n}")
    block = _numel(TransformerBlock.param_decls(config))
    emb = _numel(EmbeddingLayer.param_decls(config))
    head = _numel(OutputHead.param_decls(dataclasses.replace(config, tied_embedding=False)))

    def cost(k: int, lo: int, hi: int) -> int:  # stage k holding blocks lo..hi-1 (0-based)
        return (hi - lo) * block + (emb if k == 0 else 0) + (head if k == p - 1 else 0)

    # best[k][j]: the smallest largest-stage cost of the first j blocks over k+1 stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p)]
    cut = [[0] * (n + 1) for _ in range(p)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, p):
        for j in range(k + 1, n + 1):
            for i in range(k, j):
                c = max(best[k - 1][i], cost(k, i, j))
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    bounds = [n]
    for k in range(p - 1, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.append(0)
    bounds.reverse()  # block boundaries b_0 = 0 < b_1 < ... < b_p = n
    ranges = []
    for k in range(p):
        start = 0 if k == 0 else bounds[k] + 1
        end = n + 2 if k == p - 1 else bounds[k + 1] + 1
        ranges.append((start, end))
    return ranges


class GridHooks(TensorParallel):
    """The hooks of a model in a :class:`ParallelGrid`: tensor parallelism over the grid's
    tensor group, plus what a pipeline stage needs (its layers, loading and gathering the
    whole model across stages, running generation through the stages).

    The same object serves one model (it remembers how its kv heads are shared).
    """

    def __init__(self, grid: ParallelGrid):
        super().__init__(grid.groups["tensor"], grid.tp_size, grid.tp_rank)
        self.grid = grid

    @property
    def distributed(self) -> bool:
        return self.size > 1 or self.grid.pp_size > 1

    def __repr__(self) -> str:
        return f"GridHooks({self.grid!r})"

    def stage_range(self, config: ReaLModelConfig) -> Tuple[int, int]:
        """The layers of this rank's pipeline stage."""
        return stage_layers(config, self.grid.pp_size)[self.grid.pp_rank]

    def counts_in_norm(self, name: str, config: ReaLModelConfig) -> bool:
        g = self.grid
        if (
            g.pp_size > 1
            and g.is_last_stage
            and config.shares_head_with_embedding
            and name == f"{config.head_layer_idx}.weight"
        ):
            return False  # the copy of the embedding: counted on the first stage
        return super().counts_in_norm(name, config)

    def shard_model(self, full: ReaLModel, device=None, **kwargs) -> ReaLModel:
        cfg = full.config
        model = ReaLModel(
            cfg,
            dtype=full.dtype,
            device=device if device is not None else full.device,
            init_weights=False,
            tp=self,
            layers=self.stage_range(cfg),
            **kwargs,
        )
        if full.lora is not None:
            add_lora(model, full.lora.spec, init=False)
        src = dict(all_parameters(full))
        head_w = f"{cfg.head_layer_idx}.weight"
        with torch.no_grad():
            for name, p in all_parameters(model):
                whole = src[
                    "0.wte.weight" if model.head_copies_embedding and name == head_w else name
                ]
                p.copy_(shard_tensor(name, whole.detach(), cfg, self.size, self.rank))
        return model

    def gather_model(self, model: ReaLModel) -> Optional[ReaLModel]:
        """The whole model on the replica's (pipe 0, tensor 0) rank; None elsewhere.  Every
        rank of the replica must call it."""
        g, cfg = self.grid, model.config
        # 1. Tensor shards -> whole stage parameters on tensor rank 0.
        stage: Dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in all_parameters(model):
                local = p.detach().contiguous()
                if self.size == 1:
                    stage[name] = local.cpu()
                    continue
                parts = [torch.empty_like(local) for _ in range(self.size)]
                dist.all_gather(parts, local, group=self.group)
                stage[name] = unshard_tensor(name, [t.cpu() for t in parts], cfg)
        if self.rank != 0:
            return None
        # 2. Stages -> pipe 0 (over the tensor-0 ranks' pipe group).
        if g.pp_size > 1:
            if model.head_copies_embedding:  # the first stage's embedding is the real one
                stage.pop(f"{cfg.head_layer_idx}.weight")
            parts = [None] * g.pp_size if g.is_first_stage else None
            dist.gather_object(stage, parts, dst=g.stage_rank(0), group=g.groups["pipe"])
            if not g.is_first_stage:
                return None
            stage = {k: v for part in parts for k, v in part.items()}
        full = ReaLModel(cfg, dtype=model.dtype, device="cpu", init_weights=False)
        if model.lora is not None:
            add_lora(full, model.lora.spec, init=False)
        with torch.no_grad():
            for name, p in all_parameters(full):
                p.copy_(stage[name])
        return full

    def run_stages(self, model: ReaLModel, input_ids, cu_seqlens, **kw) -> torch.Tensor:
        """The whole model's output on every stage: each stage runs its layers and passes
        the hidden states on; the last stage's output is broadcast back to all stages."""
        g = self.grid
        if g.pp_size == 1:
            return model(input_ids, cu_seqlens, **kw)
        T = input_ids.shape[0]
        h = None
        if not g.is_first_stage:
            h = torch.empty(T, model.config.hidden_dim, dtype=model.dtype, device=model.device)
            dist.recv(h, src=g.prev_stage, group=g.groups["pipe"])
        out = model(input_ids, cu_seqlens, hidden=h, **kw)
        if not g.is_last_stage:
            dist.send(out.contiguous(), dst=g.next_stage, group=g.groups["pipe"])
            lc = model.layer_config
            rows = kw.get("output_rows")
            R = T if rows is None else rows.numel()  # the head's rows, on the last stage
            shape = (R,) if lc.is_critic else (R, lc.vocab_size)
            out = torch.empty(shape, dtype=model.dtype, device=model.device)
        dist.broadcast(out, src=g.stage_rank(g.pp_size - 1), group=g.groups["pipe"])
        return out
