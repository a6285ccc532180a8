"""Tensor parallelism of ReaLModel: the sharding rules and the collectives behind the hooks.

A tensor-parallel ReaLModel of degree ``m`` is the single-device model built from a *local
config* (``n_q_heads / m`` query heads, ``intermediate_dim / m`` MLP width,
``vocab_size / m`` vocabulary rows, and ``n_kv_heads / m`` key/value heads — or one, when
there are fewer key/value heads than ranks) with :class:`TensorParallel` as its hooks
(:mod:`realhf.impl.model.nn.parallel_hooks`).  How each parameter is split:

===============================================  =========================================
parameter                                        split
===============================================  =========================================
``q_attn.{weight,bias}``, MLP up/gate/c_fc        rows (dim 0): column-parallel
``k_attn`` / ``v_attn``                           rows when ``m`` divides ``n_kv_heads``;
                                                  otherwise rank ``r`` holds kv head
                                                  ``r // (m / n_kv_heads)`` (a copy)
``attn.c_proj.weight``, MLP down/c_proj weight    columns (dim 1): row-parallel
``0.wte.weight``, LM head ``{n+1}.weight``        rows (vocabulary-parallel)
norms, q/k norms, row-parallel biases, ``wpe``,   replicated
the critic's value head
LoRA ``lora_B`` of a column-parallel projection  as its base weight's rows
LoRA ``lora_A`` of a row-parallel projection     columns (dim 1)
the other LoRA matrices                           replicated
===============================================  =========================================

Why hand-written rather than ``torch.distributed.tensor`` parallel styles: ReaLModel keeps
every local parameter as a view into one flat buffer (so gradients all-reduce, the optimizer
and parameter reallocation work on intervals), and DTensor parameters cannot be views of a
shared local buffer; the handful of collectives below (Megatron's f / g operators, a
vocabulary-parallel embedding; the log-softmax's are in
:mod:`realhf.impl.model.modules.vocab_chunked`, shared with one device) is all tensor
parallelism needs, and every one of them has an exact single-device reference in the tests.

Gradients: replicated parameters get identical gradients on every rank (their inputs'
gradients are summed by ``copy_in``; qwen3's per-head q/k norms, applied to local heads
only, sum theirs in :meth:`TensorParallel.head_weight`), so the data-parallel all-reduce is
the only reduction the engine runs; the gradient *norm* counts each replicated parameter once
(:meth:`TensorParallel.counts_in_norm`).  Key/value copies get their gradients summed over
the ranks that share the head (:meth:`TensorParallel.kv_weight`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from realhf.impl.model.modules import grad_in_place, vocab_chunked
from realhf.impl.model.nn.lora import add_lora, all_parameters
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.parallel_hooks import LocalHooks
from realhf.impl.model.nn.real_model import ReaLModel

__all__ = [
    "TensorParallel",
    "check_tensor_parallel",
    "shard_tensor",
    "unshard_tensor",
    "shard_model",
]


# ---- the sharding rules ---------------------------------------------------------------


def check_tensor_parallel(config: ReaLModelConfig, m: int) -> None:
    """Raise ValueError, naming the dimension, unless ``config`` splits ``m`` ways."""
    if m == 1:
        return
    problems = []
    if config.n_q_heads % m:
        problems.append(f"n_q_heads={config.n_q_heads} (attention heads)")
    kv = config.n_kv_heads
    if kv % m and m % kv:
        problems.append(f"n_kv_heads={kv} (neither divides the other)")
    if config.intermediate_dim % m:
        problems.append(f"intermediate_dim={config.intermediate_dim} (MLP width)")
    if config.vocab_size % m:
        problems.append(
            f"vocab_size={config.vocab_size} (the vocabulary is not padded: pad the "
            "tokenizer's vocabulary to a multiple of m, or use another m)"
        )
    if problems:
        raise ValueError(
            f"tensor parallel degree m={m} does not divide {', '.join(problems)} of this "
            f"{config.family} model; choose an m that divides them"
        )


def local_shard_config(config: ReaLModelConfig, m: int) -> ReaLModelConfig:
    check_tensor_parallel(config, m)
    return dataclasses.replace(
        config,
        n_q_heads=config.n_q_heads // m,
        n_kv_heads=max(1, config.n_kv_heads // m),
        intermediate_dim=config.intermediate_dim // m,
        vocab_size=config.vocab_size // m,
    )


_COLUMN = (
    "attn.c_attn.q_attn.",
    "mlp.gate_proj.",
    "mlp.up_proj.",
    "mlp.c_fc.",
)
_KV = ("attn.c_attn.k_attn.", "attn.c_attn.v_attn.")
_ROW_WEIGHTS = ("attn.c_proj.weight", "mlp.down_proj.weight", "mlp.c_proj.weight")


def shard_rule(name: str, config: ReaLModelConfig) -> Optional[Tuple[str, int]]:
    """``(kind, dim)`` of how parameter ``name`` is split, or None when replicated.

    kind is ``"split"`` (even split along ``dim``) or ``"kv"`` (key/value heads: split
    along dim 0, or one head copied when there are fewer heads than ranks).
    """
    layer, _, local = name.partition(".")
    if local.endswith((".lora_A", ".lora_B")):
        # LoRA adapters split the way their base weight does: a column-parallel one's B by
        # rows (A whole), a row-parallel one's A by columns (B whole).
        base = shard_rule(f"{layer}.{local.rsplit('.', 1)[0]}.weight", config)
        if base == ("split", 1):
            return base if local.endswith(".lora_A") else None
        return None if local.endswith(".lora_A") else base
    layer = int(layer)
    if layer == 0:
        return ("split", 0) if local == "wte.weight" else None
    if layer == config.head_layer_idx:
        lm_head = local == "weight" and not config.is_critic
        return ("split", 0) if lm_head else None
    if local.startswith(_COLUMN):
        return ("split", 0)
    if local.startswith(_KV):
        return ("kv", 0)
    if local in _ROW_WEIGHTS:
        return ("split", 1)
    return None


def kv_heads_of(config: ReaLModelConfig, m: int, r: int) -> Tuple[int, int]:
    """``[first, last)`` key/value heads held by rank ``r``."""
    kv = config.n_kv_heads
    if kv % m == 0:
        return r * (kv // m), (r + 1) * (kv // m)
    head = r // (m // kv)
    return head, head + 1


def shard_tensor(
    name: str, full: torch.Tensor, config: ReaLModelConfig, m: int, r: int
) -> torch.Tensor:
    """Rank ``r``'s shard (a view) of the whole parameter ``full`` named ``name``."""
    rule = shard_rule(name, config)
    if rule is None or m == 1:
        return full
    kind, dim = rule
    if kind == "kv":
        lo, hi = kv_heads_of(config, m, r)
        return full.narrow(0, lo * config.head_dim, (hi - lo) * config.head_dim)
    return full.chunk(m, dim)[r]


def unshard_tensor(name: str, shards: List[torch.Tensor], config: ReaLModelConfig) -> torch.Tensor:
    """The whole parameter from every rank's shard (rank order)."""
    m = len(shards)
    rule = shard_rule(name, config)
    if rule is None or m == 1:
        return shards[0]
    kind, dim = rule
    if kind == "kv" and config.n_kv_heads < m:
        copies = m // config.n_kv_heads
        return torch.cat(shards[::copies], dim=0)
    return torch.cat(shards, dim=dim)


def counts_in_norm(name: str, config: ReaLModelConfig, m: int, r: int) -> bool:
    """Whether rank ``r`` counts parameter ``name`` in the global gradient norm (each
    element exactly once over the tensor-parallel group)."""
    rule = shard_rule(name, config)
    if m == 1:
        return True
    if rule is None:
        return r == 0
    if rule[0] == "kv" and config.n_kv_heads < m:
        return r % (m // config.n_kv_heads) == 0
    return True


# ---- autograd functions ---------------------------------------------------------------


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


class _CopyIn(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceOut(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _SharedKVGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks holding the same
    key/value head copy (one all-reduce over the whole group: each rank writes its
    gradient into its head's slot)."""

    @staticmethod
    def forward(ctx, w, group, slot, n_slots):
        ctx.group, ctx.slot, ctx.n_slots = group, slot, n_slots
        return w

    @staticmethod
    def backward(ctx, g):
        buf = g.new_zeros((ctx.n_slots,) + tuple(g.shape))
        buf[ctx.slot] = g
        _all_reduce(buf, ctx.group)
        return buf[ctx.slot].clone(), None, None, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (a replicated weight
    that each rank applies to its own heads only)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.contiguous().clone(), ctx.group), None


# ---- the hooks ------------------------------------------------------------------------


class TensorParallel(LocalHooks):
    """Tensor-parallel hooks of a ReaLModel over ``group`` (see the module docstring).

    Args:
        group: the tensor-parallel process group (``ParallelGrid.groups["tensor"]``).
        size, rank: the degree ``m`` and this rank's index in the group.
    """

    def __init__(self, group, size: int, rank: int):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"TensorParallel: rank {rank} is outside a group of size {size}")
        if size > 1 and group is None:
            raise ValueError("TensorParallel of size > 1 needs its process group")
        self.group, self.size, self.rank = group, size, rank
        # How many ranks hold a copy of each kv head, and how many kv heads there are: set
        # by local_config, which the model calls once when it is built.
        self._kv_copies, self._n_kv = 1, 1

    @classmethod
    def from_grid(cls, grid) -> "TensorParallel":
        """The hooks of a :class:`~realhf.impl.model.parallelism.grid.ParallelGrid`."""
        return cls(grid.groups["tensor"], grid.tp_size, grid.tp_rank)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def __repr__(self) -> str:
        return f"TensorParallel(rank {self.rank} of {self.size})"

    # -- layout --
    def local_config(self, config: ReaLModelConfig) -> ReaLModelConfig:
        if self.size == 1:
            return config
        self._kv_copies = max(1, self.size // config.n_kv_heads)
        self._n_kv = config.n_kv_heads
        return local_shard_config(config, self.size)

    def vocab_range(self, config: ReaLModelConfig) -> Tuple[int, int]:
        n = config.vocab_size // self.size
        return self.rank * n, (self.rank + 1) * n

    # -- collectives --
    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _CopyIn.apply(x, self.group)

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.size == 1 else _ReduceOut.apply(x, self.group)

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return grad_in_place.embed(input_ids, weight)
        start = self.rank * weight.shape[0]
        local = input_ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        h = grad_in_place.embed(local.masked_fill(outside, 0), weight)
        return self.reduce_out(h.masked_fill(outside.unsqueeze(-1), 0.0))

    def kv_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.size == 1 or self._kv_copies == 1:
            return w
        return _SharedKVGrad.apply(w, self.group, self.rank // self._kv_copies, self._n_kv)

    def head_weight(self, w: torch.Tensor) -> torch.Tensor:
        # Also for a copied kv head: each copy's gradient comes from different query heads.
        return w if self.size == 1 else _SumGrad.apply(w, self.group)

    def token_log_probs(self, logits, labels, rows=None, temperature=1.0):
        if self.size == 1:
            return super().token_log_probs(logits, labels, rows, temperature)
        start = self.rank * logits.shape[-1]
        return vocab_chunked.token_log_probs(
            logits, labels, rows=rows, temperature=temperature, start=start, group=self.group
        )

    def token_entropy(self, logits, rows=None, temperature=1.0):
        if self.size == 1:
            return super().token_entropy(logits, rows, temperature)
        return vocab_chunked.token_entropy(
            logits, rows=rows, temperature=temperature, group=self.group
        )

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # -- norm and checkpoints --
    def shard_param(self, name: str, full: torch.Tensor, config: ReaLModelConfig) -> torch.Tensor:
        return shard_tensor(name, full, config, self.size, self.rank)

    def counts_in_norm(self, name: str, config: ReaLModelConfig) -> bool:
        """Whether this rank counts ``name`` in the global gradient norm."""
        return counts_in_norm(name, config, self.size, self.rank)

    def gather_model(self, model: ReaLModel) -> Optional[ReaLModel]:
        """The whole single-device model on tensor rank 0 (None on the others)."""
        cfg = model.config
        full = None
        if self.rank == 0:
            full = ReaLModel(cfg, dtype=model.dtype, device="cpu", init_weights=False)
        full_params = dict(full.named_parameters()) if full is not None else {}
        if full is not None and model.lora is not None:
            full_params.update(add_lora(full, model.lora.spec, init=False).params)
        with torch.no_grad():
            for name, p in all_parameters(model):
                local = p.detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(self.size)]
                dist.all_gather(parts, local, group=self.group)
                if full is not None:
                    full_params[name].copy_(unshard_tensor(name, [t.cpu() for t in parts], cfg))
        return full

    def shard_model(self, full: ReaLModel, device=None, **kwargs) -> ReaLModel:
        """This rank's shard of the whole model ``full`` (see :func:`shard_model`)."""
        return shard_model(full, self, device, **kwargs)


def shard_model(full: ReaLModel, tp: TensorParallel, device=None, **kwargs) -> ReaLModel:
    """This rank's tensor-parallel shard of the whole model ``full`` (weights copied)."""
    check_tensor_parallel(full.config, tp.size)
    model = ReaLModel(
        full.config,
        dtype=full.dtype,
        device=device if device is not None else full.device,
        init_weights=False,
        tp=tp,
        **kwargs,
    )
    if full.lora is not None:
        add_lora(model, full.lora.spec, init=False)
    src = dict(all_parameters(full))
    with torch.no_grad():
        for name, p in all_parameters(model):
            p.copy_(shard_tensor(name, src[name].detach(), full.config, tp.size, tp.rank))
    return model
