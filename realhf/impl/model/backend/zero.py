"""ZeRO stage 1: the optimizer state sharded over the data-parallel group.

Every data-parallel rank holds the whole model and computes the whole gradient, as in
plain data parallelism, but AdamW runs on 1/d of the flat parameter buffer only::

    flat buffer [0, N), padded to d * S          S = ceil(N / d)
    rank r owns [r * S, min((r + 1) * S, N))

    reduce-scatter the flat fp32 gradient      -> this rank's shard of the averaged gradient
    grad norm: squared norm of each shard, summed over the group
    AdamW on the shard (fp32 master piece + moments)
    all-gather the updated shards              -> every rank's model has the new weights

So the fp32 master weights (for a bf16/fp16 model) and the two Adam moments -- 12 of the
20 bytes per parameter of a bf16 model, 8 of 16 for fp32 -- cost 1/d per rank.  The
gradient buffer stays whole (gradients accumulate over micro-batches; sharding them too is
stage 2).

A shard cuts parameters anywhere, but AdamW is element-wise, so each parameter's part in
the shard becomes its own optimizer parameter (a *piece*, a view into the shard) and weight
decay still applies to matrices only.  :meth:`ShardedAdamW.full_state` assembles the state
a single-rank :class:`torch.optim.AdamW` over the whole model would have, so checkpoints do
not depend on ``d`` or on whether ZeRO was on: a run can resume with another
data-parallel size or with ZeRO switched on or off.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from realhf.api.cli_args import OptimizerConfig
from realhf.impl.model.nn.flat_param import ParamSpec

__all__ = ["ShardedAdamW", "adamw", "decay_split", "moment_bytes", "shard_size"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def decay_split(
    names: Sequence[str], param_spec: Dict[str, ParamSpec]
) -> Tuple[List[str], List[str]]:
    """``names`` split into AdamW's two groups, each in the given order: matrices
    (embeddings, projections), which are weight-decayed, then 1-D parameters (biases, norm
    weights), which are not.  A whole-model AdamW numbers its parameters in this order, so
    the checkpoint layout of both engines rests on it."""
    decay = [n for n in names if len(param_spec[n].shape) >= 2]
    return decay, [n for n in names if len(param_spec[n].shape) < 2]


def adamw(groups: List[dict], lr: float, config) -> torch.optim.AdamW:
    """The AdamW of ``groups`` with ``config``'s betas and eps: the fused kernel (one pass
    over each tensor, no temporaries; 5x the default multi-tensor step on a 2-core CPU, whose
    temporaries were a second copy of the moments at the step's memory peak)."""
    return torch.optim.AdamW(
        groups, lr=lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=True
    )


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the Adam moments ``optimizer`` holds (its step counters left out)."""
    return sum(
        t.numel() * t.element_size()
        for st in optimizer.state.values()
        for k, t in st.items()
        if k in MOMENTS
    )


def shard_size(numel: int, dp_size: int) -> int:
    """Elements per rank's shard: the flat buffer padded to a multiple of ``dp_size``."""
    return -(-numel // dp_size)


class ShardedAdamW:
    """AdamW over this rank's shard of a flat parameter buffer (see the module docstring).

    Args:
        flat_params: the model's flat parameter buffer (N elements, any float dtype).
        param_spec: ``name -> ParamSpec`` of the buffer.
        names: parameter names in the order a whole-model AdamW lists them (the model's
            ``named_parameters`` order); decides the layout of :meth:`full_state`.
        config: AdamW hyper-parameters.
        group, dp_size, dp_rank: the data-parallel group (None when ``dp_size`` is 1).
        padded_grad: the engine's flat fp32 gradient buffer, padded to ``d * S`` elements:
            what :meth:`reduce` reduce-scatters.

    For an fp32 model the shard's weights are the model's own (a view of ``flat_params``);
    for a lower precision they are an fp32 master copy of this rank's part.
    """

    def __init__(
        self,
        flat_params: torch.Tensor,
        param_spec: Dict[str, ParamSpec],
        names: Sequence[str],
        config: OptimizerConfig,
        group,
        dp_size: int,
        dp_rank: int,
        padded_grad: torch.Tensor,
    ):
        self.flat_params = flat_params
        self.param_spec = param_spec
        self.names = list(names)
        self.group, self.dp_size, self.dp_rank = group, dp_size, dp_rank
        self.numel = flat_params.numel()
        self.size = shard_size(self.numel, dp_size)
        self.lo = min(dp_rank * self.size, self.numel)
        self.hi = min(self.lo + self.size, self.numel)
        flat = flat_params.detach()
        self.has_master = flat.dtype != torch.float32
        # The fp32 weights AdamW updates: the model's own slice, or a master copy of it.
        self.master = (
            flat[self.lo : self.hi].float() if self.has_master else flat[self.lo : self.hi]
        )
        # The averaged gradient of the shard (padded to S: the reduce-scatter's output); on
        # one rank the shard is the whole gradient buffer itself.
        self.padded_grad = padded_grad
        if dp_size == 1:
            self.grad = padded_grad
        else:
            self.grad = torch.zeros(self.size, dtype=torch.float32, device=flat.device)
        self.pieces: List[Tuple[str, int, int, torch.nn.Parameter]] = []
        decayed = set(decay_split(self.names, param_spec)[0])
        decay, no_decay = [], []
        for name in self.names:
            spec = param_spec[name]
            a, b = max(spec.offset, self.lo), min(spec.end, self.hi)
            if a >= b:
                continue
            p = torch.nn.Parameter(self.master[a - self.lo : b - self.lo])
            p.grad = self.grad[a - self.lo : b - self.lo]
            self.pieces.append((name, a, b, p))
            (decay if name in decayed else no_decay).append(p)
        # Both groups always exist (maybe empty), in the order a whole-model AdamW has them.
        self.optimizer = adamw(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            config.lr,
            config,
        )

    # ------------------------------------------------------------------ one step
    def reduce(self) -> None:
        """Average the whole fp32 gradient (``padded_grad``: ``d * S`` elements) over the
        group into :attr:`grad` (this rank's shard)."""
        if self.dp_size == 1:
            return
        dist.reduce_scatter_tensor(self.grad, self.padded_grad, group=self.group)
        self.grad.div_(self.dp_size)

    def norm_sq(self, intervals: Optional[List[Tuple[int, int]]]) -> torch.Tensor:
        """Squared L2 norm of this shard's gradient over the flat ``intervals`` (None: all
        of it), as a 1-element float64 tensor; summing it over the group gives the whole."""
        if intervals is None:
            intervals = [(self.lo, self.hi)]
        sq = torch.zeros(1, dtype=torch.float64, device=self.grad.device)
        for a, b in intervals:
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b:
                sq += torch.linalg.vector_norm(self.grad[a - self.lo : b - self.lo]).double() ** 2
        return sq

    def step(self, lr: float) -> None:
        """AdamW on the shard, then every rank's model gets every shard's new weights."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.gather_weights()

    def gather_weights(self) -> None:
        """All-gather the shards' weights into every rank's ``flat_params`` (in its dtype)."""
        flat = self.flat_params.detach()
        if self.dp_size == 1:
            if self.has_master:
                flat.copy_(self.master)
            return
        mine = torch.zeros(self.size, dtype=flat.dtype, device=flat.device)
        mine[: self.hi - self.lo].copy_(self.master)
        outs, partial = [], []
        for r in range(self.dp_size):
            a = r * self.size
            if a + self.size <= self.numel:
                outs.append(flat[a : a + self.size])  # received in place
            else:  # the padded tail: received aside, its valid part copied in
                outs.append(torch.empty_like(mine))
                partial.append((r, a))
        dist.all_gather(outs, mine, group=self.group)
        for r, a in partial:
            if a < self.numel:
                flat[a:].copy_(outs[r][: self.numel - a])

    def load_weights_from_model(self) -> None:
        """Restart the master shard from the model (weights loaded into it from outside)."""
        if self.has_master:
            self.master.copy_(self.flat_params.detach()[self.lo : self.hi])

    # ------------------------------------------------------------------ checkpoints
    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """All ranks' ``shard`` (``hi - lo`` fp32 elements each) as one ``[N]`` tensor."""
        mine = torch.zeros(self.size, dtype=torch.float32, device=shard.device)
        mine[: self.hi - self.lo].copy_(shard)
        if self.dp_size == 1:
            return mine[: self.numel]
        full = torch.empty(self.size * self.dp_size, dtype=torch.float32, device=shard.device)
        dist.all_gather_into_tensor(full, mine, group=self.group)
        return full[: self.numel]

    def _step_count(self) -> float:
        steps = [
            float(self.optimizer.state[p]["step"])
            for *_, p in self.pieces
            if p in self.optimizer.state
        ]
        n = torch.tensor([max(steps, default=0.0)], dtype=torch.float64, device=self.grad.device)
        if self.dp_size > 1:
            dist.all_reduce(n, dist.ReduceOp.MAX, group=self.group)
        return float(n[0])

    def full_state(self) -> Tuple[Dict[str, Any], Optional[torch.Tensor]]:
        """``(optimizer state dict, fp32 master weights or None)`` as a whole-model AdamW
        on one rank would have them.  A collective: every rank of the group calls it, and
        each gets the whole state (transiently 8-12 bytes per parameter)."""
        step = self._step_count()
        moments = {}
        for key in MOMENTS:
            shard = torch.zeros(self.hi - self.lo, dtype=torch.float32, device=self.grad.device)
            for _, a, b, p in self.pieces:
                st = self.optimizer.state.get(p)
                if st:
                    shard[a - self.lo : b - self.lo] = st[key]
            moments[key] = self._gather_flat(shard)
        master = self._gather_flat(self.master) if self.has_master else None
        mats, vectors = decay_split(self.names, self.param_spec)
        order = mats + vectors
        state = {}
        if step > 0:
            for i, name in enumerate(order):
                spec = self.param_spec[name]
                state[i] = {"step": torch.tensor(step, dtype=torch.float32)}
                for key in MOMENTS:
                    state[i][key] = moments[key][spec.offset : spec.end].view(spec.shape).clone()
        # The unsharded engine has a group for 1-D parameters only if the model has some.
        spans = [range(len(mats))] + ([range(len(mats), len(order))] if vectors else [])
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(ids)}
            for g, ids in zip(self.optimizer.param_groups, spans)
        ]
        return {"state": state, "param_groups": groups}, master

    def load_full_state(self, opt_state: Dict[str, Any], master: Optional[torch.Tensor]) -> None:
        """Take this rank's part of a whole-model AdamW state (:meth:`full_state`'s layout,
        which is also what the unsharded engine saves) and of the master weights."""
        order = sum(decay_split(self.names, self.param_spec), [])
        ids = [i for g in opt_state["param_groups"] for i in g["params"]]
        if len(ids) != len(order):
            raise ValueError(
                f"optimizer state for {len(ids)} parameters, but the model has {len(order)}; "
                "resume with the same model"
            )
        for g, saved in zip(self.optimizer.param_groups, opt_state["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        index = {name: i for i, name in enumerate(order)}
        self.optimizer.state.clear()
        for name, a, b, p in self.pieces:
            st = opt_state["state"].get(index[name])
            if not st:
                continue
            off = self.param_spec[name].offset
            self.optimizer.state[p] = {
                "step": torch.tensor(float(st["step"]), dtype=torch.float32),
                **{
                    k: st[k].reshape(-1)[a - off : b - off].to(p.device, torch.float32).clone()
                    for k in MOMENTS
                },
            }
        if self.has_master:
            src = self.flat_params.detach() if master is None else master
            self.master.copy_(src[self.lo : self.hi])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam moments and fp32 master shard."""
        return moment_bytes(self.optimizer) + (self.master.numel() * 4 if self.has_master else 0)
