"""Data-parallel training of a ReaLModel: micro-batches, global token-mean loss, AdamW.

One :meth:`TrainEngine.train_batch` call is one optimizer step::

    split the batch into micro-batches        (same count on every data-parallel rank)
    for each micro-batch: forward, loss, scaled backward    (grads accumulate in one flat buffer)
    all-reduce the flat gradient (average over data-parallel ranks)
    clip the global norm; skip the step if it is not finite
    set the learning rate of this step, AdamW step

Loss scaling. Each micro-batch loss (a mean over its own tokens) is multiplied by
``w_mb / W * dp_size``, where ``w_mb = loss_weight_fn(mb)`` (its token count) and ``W`` the
sum of the weights of all micro-batches on all ranks. After the gradient average over
ranks this is the gradient of the mean over every token of the global batch, however the
batch was cut into ranks and micro-batches.

Gradients live in one flat buffer laid out like ``model.trained_flat`` (each ``p.grad`` is a
view into it), so the data-parallel reduction is a single all-reduce and the grad norm one
vector norm. Build the engine after the model is on its final device and dtype.  What trains
is the model's ``trained_parameters()``: every parameter (``trained_flat`` is
``flat_params``), or with LoRA adapters (:mod:`realhf.impl.model.nn.lora`) the adapters
alone, in their own flat buffer, while the base weights stay frozen and take no gradient or
optimizer memory.

Mixed precision. A model in bf16 or fp16 computes in its dtype, and the engine keeps fp32
master weights (a flat copy of ``trained_flat``) with an fp32 gradient buffer and fp32 AdamW
moments: after each micro-batch's backward the low-precision gradient is added into the fp32
buffer (pipelined steps add once, after the schedule), which is what is all-reduced, clipped
and applied to the master weights; the model gets them back rounded to its dtype.  Bytes per
parameter: fp32 model 16 (weights 4, gradient 4, Adam 8); bf16 model 20 (weights 2,
gradient 2, master 4, fp32 gradient 4, Adam 8), of which the fp32 gradient is freed during
the forward and backward passes (allocated after the first, once the activations are gone)
-- more than fp32 at rest, for matmuls at bf16 speed and activations of half the size.  The
gradient in the model's dtype holds nothing between steps: calls on the model that do not
train it (its generation, inference, evaluation, writing its weights) run inside
:meth:`TrainEngine.gradients_released`, which frees it (the model worker does this), so a
bf16 model's generation holds 18 bytes per parameter and an fp32 model's 12.  A step of one
micro-batch on one rank has no fp32 gradient at all (16 bytes per parameter): the fp32 sum
would be the bf16 gradient converted, so the step converts it a run of parameters at a time
as it applies it (:meth:`TrainEngine._step_from_model_grad`).  On a CPU with realhf's vector
kernels a bf16 model's step is one pass per element instead (:meth:`TrainEngine._kernel_step`,
``csrc/adamw_simd.h``): the gradient read in its dtype, clipped, applied to the master
weights and moments, and the new weights written back to the model in bf16 (28 bytes of
memory traffic per parameter instead of ~48).
Without master weights an update smaller than half a bf16 ulp of its weight (a relative
change below ~2**-9) would be lost.

ZeRO-1 (``optimizer.zero_stage=1``): the master weights and Adam moments are sharded over
the data-parallel group (:mod:`realhf.impl.model.backend.zero`); the gradient is
reduce-scattered instead of all-reduced, so after a step each rank's ``p.grad`` holds its own
(unaveraged) gradient and only its shard's average lives in ``engine.zero.grad``.

Parallel layouts (``grid=``): gradients are averaged over the grid's data group only; under
tensor parallelism the loss function gets vocabulary-sharded logits (pass ``engine.tp`` to the
log-prob helpers); under pipeline parallelism the micro-batches run with the 1F1B schedule
(:mod:`realhf.impl.model.parallelism.pipeline`), the last stage computes the losses and
statistics and every stage returns the same result.

Contract with interfaces: see :mod:`realhf.impl.model.backend.inference`. A train engine
is also an inference engine (``forward``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as _functional_adamw

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import FinetuneSpec
from realhf.base import logging
from realhf.base.distributed import dist_util
from realhf.base.gcutil import heap_free_bytes, trim_heap
from realhf.impl.kernels import simd_cpu
from realhf.impl.model.backend.inference import InferenceEngine
from realhf.impl.model.backend.lr_schedule import LRSchedule
from realhf.impl.model.backend.offload import free_storage, regrow_storage
from realhf.impl.model.backend.zero import (
    ShardedAdamW,
    adamw,
    decay_split,
    moment_bytes,
    shard_size,
)
from realhf.impl.model.nn.flat_param import flat_intervals, flat_view

logger = logging.getLogger("train_engine")

__all__ = ["TrainEngine", "LossFn", "LossWeightFn"]

#: elements converted at a time when a low-precision gradient is added into the fp32 one
_ACCUMULATE_CHUNK = 16 << 20
#: elements of a piece of the gradient norm on a CPU (see _sum_of_squares)
_NORM_PIECE = 1 << 20
#: a step of one micro-batch on one rank applies the low-precision gradient without the fp32
#: sum (TrainEngine._step_from_model_grad); False sends it through the sum, as a reference
_DIRECT_STEP = True
#: free heap bytes (the forward's freed temporaries) from which a CPU micro-batch trims the
#: heap before its backward.  qwen3-0.6b, bf16, one micro-batch of 5,080 tokens (sft, prompts
#: 128 + answers 512): the worker's peak 21.43 -> 19.71 GiB, the step 45.9 -> 45.7 s
#: (benchmark/scale.py).  The 0.5B shape's 1,148-token step leaves 0.35 GiB: not trimmed.
_TRIM_BEFORE_BACKWARD = 1 << 30

#: ``loss_fn(output, mb) -> (loss, stats)``: the mean loss of one micro-batch (a scalar with
#: grad) and a dict of scalar statistics (floats or 0-d tensors, same keys for every
#: micro-batch). The engine reports each statistic averaged over micro-batches and ranks,
#: weighted like the loss.
LossFn = Callable[[torch.Tensor, SequenceSample], Tuple[torch.Tensor, Dict[str, Any]]]
#: ``loss_weight_fn(mb) -> number``: how much a micro-batch counts (its token count).
LossWeightFn = Callable[[SequenceSample], Any]


def _resolve_group(group):
    """``(group, size, rank)``; None means the default group when torch.distributed runs.

    The returned group is never None under torch.distributed, so callers can hand it to
    functions where None means "do not reduce" (advantage normalisation, early stop)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "a data-parallel group was given but torch.distributed is not initialised"
            )
        return None, 1, 0
    if group is None:
        group = dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


class TrainEngine(InferenceEngine):
    """AdamW training of a ReaLModel over data-parallel ranks (see the module docstring).

    Args:
        model: the ReaLModel (on its final device/dtype).
        optimizer: AdamW hyper-parameters, LR schedule and gradient clipping.
        ft_spec: run length; the LR schedule spans ``ft_spec.total_train_steps`` steps
            (needed for linear/cosine schedules and for warm-up).
        dp_group: the data-parallel process group. None: the default group when
            torch.distributed is initialised, otherwise a single process. The resolved
            group is :attr:`dp_group` (None only without torch.distributed), with
            :attr:`dp_size` and :attr:`dp_rank`.
        gradient_checkpointing: set the model's activation recomputation (None keeps
            the model's setting).
        grid: the model's :class:`~realhf.impl.model.parallelism.grid.ParallelGrid`
            (instead of ``dp_group``): gradients are averaged over its ``data`` group, and
            the gradient norm sums the shards of its ``model`` group (tensor- and
            pipeline-parallel peers), counting replicated parameters once.

    Weight decay applies to matrices only (embeddings, projections); biases and norm
    weights (1-D parameters) are not decayed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[OptimizerConfig] = None,
        ft_spec: Optional[FinetuneSpec] = None,
        dp_group=None,
        *,
        gradient_checkpointing: Optional[bool] = None,
        grid=None,
    ):
        super().__init__(model, grid)
        if not hasattr(model, "trained_flat") or not hasattr(model, "trained_spec"):
            raise TypeError(
                "TrainEngine needs a ReaLModel (trained_flat + trained_spec); got "
                f"{type(model).__name__}"
            )
        self.config = optimizer if optimizer is not None else OptimizerConfig()
        if not isinstance(self.config, OptimizerConfig):
            raise TypeError(
                f"optimizer must be an OptimizerConfig, got {type(self.config).__name__}"
            )
        self.ft_spec = ft_spec
        if grid is not None:
            if dp_group is not None:
                raise ValueError("give TrainEngine a dp_group or a grid, not both")
            self.dp_group, self.dp_size, self.dp_rank = (
                grid.groups["data"],
                grid.dp_size,
                grid.dp_rank,
            )
            self._norm_group = grid.groups["model"]
        else:
            self.dp_group, self.dp_size, self.dp_rank = _resolve_group(dp_group)
            self._norm_group = None
        if gradient_checkpointing is not None:
            model.gradient_checkpointing = bool(gradient_checkpointing)
        self.lr_schedule = LRSchedule.from_config(
            self.config, None if ft_spec is None else ft_spec.total_train_steps
        )
        sharded = self.config.zero_stage == 1
        numel = model.trained_flat.numel()
        # ZeRO-1 reduce-scatters the gradient: its buffer is padded to d equal shards.
        padded = shard_size(numel, self.dp_size) * self.dp_size if sharded else numel
        self._bind_grad_buffer(padded)
        self._bind_master(padded, sharded)
        self._zero: Optional[ShardedAdamW] = None
        if sharded:
            self._zero = ShardedAdamW(
                model.trained_flat,
                model.trained_spec,
                [n for n, _ in model.trained_parameters()],
                self.config,
                self.dp_group,
                self.dp_size,
                self.dp_rank,
                self._grad_storage,
            )
            self.optimizer = self._zero.optimizer
        else:
            names = [n for n, _ in model.trained_parameters()]
            params = dict(zip(names, self._optimized_params()))
            decay, no_decay = decay_split(names, model.trained_spec)
            groups = [
                {"params": [params[n] for n in decay], "weight_decay": self.config.weight_decay}
            ]
            if no_decay:
                groups.append({"params": [params[n] for n in no_decay], "weight_decay": 0.0})
            self.optimizer = adamw(groups, self.lr_schedule(0), self.config)
        self.n_steps = 0  # train_batch calls (optimizer steps attempted)
        self.n_skipped = 0  # steps skipped for a non-finite grad norm or no tokens

    # ------------------------------------------------------------------ gradients
    def _bind_grad_buffer(self, padded: int) -> None:
        """Point every ``p.grad`` at its slice of one zeroed flat buffer (of ``padded``
        elements, of which the model's ``N`` are used)."""
        m = self.model
        self._grad_storage = m.trained_flat.new_zeros(padded)
        #: the buffer of the model's dtype that backward accumulates into (the same as
        #: ``_grad_storage`` unless fp32 master weights bring their own)
        self._model_grad_storage = self._grad_storage
        self.flat_grad = self._grad_storage[: m.trained_flat.numel()]
        self._grad_views: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        for name, p in m.trained_parameters():
            view = flat_view(self.flat_grad, m.trained_spec[name])
            p.grad = view
            self._grad_views.append((p, view))
        # The flat intervals this rank counts in the gradient norm: all of them, except
        # parameters that tensor-parallel peers hold copies of (counted by one of them).
        tp = getattr(m, "tp", None)
        counted = [
            n
            for n in m.trained_spec
            if tp is None or not tp.distributed or tp.counts_in_norm(n, m.config)
        ]
        self._norm_intervals = (
            None if len(counted) == len(m.trained_spec) else flat_intervals(m.trained_spec, counted)
        )

    def _bind_master(self, padded: int, sharded: bool) -> None:
        """fp32 master weights and gradient for a model in a lower precision (see the module
        docstring); none for an fp32 model.  Under ZeRO-1 the master weights are sharded
        (:mod:`~realhf.impl.model.backend.zero`) and :attr:`master` is None."""
        m = self.model
        self.master: Optional[torch.Tensor] = None
        self.master_grad: Optional[torch.Tensor] = None
        self._master_grad_clear = True  # holds nothing yet: the next accumulation copies
        self._master_params: List[torch.nn.Parameter] = []
        self._master_grad_views: List[torch.Tensor] = []
        #: this step applies the model's gradient itself (see _step_from_model_grad)
        self._direct = False
        self._low_precision = m.trained_flat.dtype != torch.float32
        if not self._low_precision:
            return
        # The fp32 buffer is what is reduced (padded like the low-precision one).
        self._grad_storage = torch.zeros(padded, dtype=torch.float32, device=m.trained_flat.device)
        self.master_grad = self._grad_storage[: m.trained_flat.numel()]
        self._mark_published()
        if sharded:
            return
        self.master = m.trained_flat.detach().float()
        for name, _ in m.trained_parameters():  # in the model's order, as AdamW had them
            mp = torch.nn.Parameter(flat_view(self.master, m.trained_spec[name]))
            mp.grad = flat_view(self.master_grad, m.trained_spec[name])
            self._master_params.append(mp)
            self._master_grad_views.append(mp.grad)

    def _optimized_params(self) -> List[torch.nn.Parameter]:
        """What AdamW updates: the master weights, or the model's own."""
        return self._master_params or [p for _, p in self.model.trained_parameters()]

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient that is reduced, clipped and applied (fp32 with master weights).

        Under ZeRO-1 it is reduced into :attr:`zero`'s shard, which is clipped and applied.
        A step of one micro-batch on one rank applies the model's own (``flat_grad``,
        converted as it is applied): the fp32 sum would be that gradient, converted."""
        return self.flat_grad if self.master_grad is None or self._direct else self.master_grad

    @property
    def zero(self) -> Optional[ShardedAdamW]:
        """The ZeRO-1 sharded optimizer (``optimizer.zero_stage=1``), else None."""
        return self._zero

    def optimizer_state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: Adam moments and fp32 master weights
        (its shard of them under ZeRO-1)."""
        if self._zero is not None:
            return self._zero.state_bytes()
        return moment_bytes(self.optimizer) + (
            0 if self.master is None else self.master.numel() * 4
        )

    def _accumulate_master_grad(self) -> None:
        """Add the model's low-precision gradient into the fp32 buffer and zero it."""
        if self.master_grad is None:
            return
        self._check_grad_views()
        if self._master_grad_clear:  # the first micro-batch: a converting copy, no add
            if self.master is not None:
                if self._grad_storage.device.type == "cpu":
                    # The backward pass just freed the activations, on the C heap: give
                    # them back first, or the fp32 buffer (a fresh mapping) comes on top.
                    trim_heap()
                regrow_storage(self._grad_storage)  # (given back by zero_grad)
            self.master_grad.copy_(self.flat_grad)
            self._master_grad_clear = False
        else:
            # add_ of a bf16 tensor to an fp32 one converts the whole operand first: a
            # temporary as large as the fp32 buffer (2 GB at 0.5B), freshly mapped, whose
            # page faults cost more than the add.  A reused chunk instead.
            n, step = self.master_grad.numel(), _ACCUMULATE_CHUNK
            chunk = self.master_grad.new_empty(min(n, step))
            for a in range(0, n, step):
                b = min(n, a + step)
                part = chunk[: b - a]
                part.copy_(self.flat_grad[a:b])
                self.master_grad[a:b].add_(part)
        self.flat_grad.zero_()

    def _mark_published(self) -> None:
        # Any in-place write into the flat buffer bumps its version counter (views share it).
        m = self.model
        self._published = (id(m.trained_flat), m.trained_flat._version)

    def _sync_master_from_model(self) -> None:
        """Start from the model's weights if something other than this engine wrote them
        since the last step (weights loaded into the model): the master copy would otherwise
        overwrite them at the next step."""
        m = self.model
        if not self._low_precision or self._published == (
            id(m.trained_flat),
            m.trained_flat._version,
        ):
            return
        logger.info("the model's weights changed outside training; master weights follow them")
        if self._zero is not None:
            self._zero.load_weights_from_model()
        else:
            self.master.copy_(m.trained_flat)
        self._mark_published()

    def grad_norm(self) -> float:
        """The global L2 norm of the (already data-parallel averaged) gradient."""
        if self._zero is not None:  # each rank has its shard: sum the squares over ranks
            sq = self._zero.norm_sq(self._norm_intervals)
            if self.dp_size > 1:
                sq = dist_util.all_reduce_(sq, dist.ReduceOp.SUM, self.dp_group)
            if self._norm_group is not None:
                sq = dist_util.all_reduce_(sq, dist.ReduceOp.SUM, self._norm_group)
            return float(sq.sum().sqrt())
        grad = self.grad
        if self._norm_intervals is None:
            sq = _sum_of_squares(grad)
        else:
            sq = sum(_sum_of_squares(grad[a:b]) for a, b in self._norm_intervals)
            sq = torch.as_tensor(sq, dtype=torch.float32)
        if self._norm_group is not None:
            sq = dist_util.all_reduce_(sq.reshape(1).double(), dist.ReduceOp.SUM, self._norm_group)
        return float(sq.sum().sqrt())

    def _check_grad_views(self) -> None:
        # Autograd accumulates in place into an existing .grad, but anything that replaces
        # a grad (a hook, set_to_none) would silently cut it from the flat buffer.
        for p, view in self._grad_views:
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    def zero_grad(self) -> None:
        """Zero the flat gradient buffers (the grads stay views into them).  The fp32 one is
        only marked clear: the first micro-batch's gradient is copied into it."""
        self.flat_grad.zero_()
        self._master_grad_clear = True
        if self.master is not None:
            # Until then it holds nothing: its memory stays out of the forward and backward
            # passes, where a step peaks (1.8 GiB at 0.5B).  (Under ZeRO-1 the buffer is
            # what is reduce-scattered, padding included: it stays.)
            free_storage(self._grad_storage)
        self._check_grad_views()

    @contextlib.contextmanager
    def gradients_released(self) -> Iterator[None]:
        """Give the memory of the gradient in the model's dtype back while the body runs,
        and take it back, zeroed, after.

        For calls on the trained model that do not train (its own generation in sync PPO,
        log-prob inference, an evaluation): between steps that buffer holds nothing a
        later step reads (the next step zeroes it first).  It is ``N x 2`` bytes in bf16
        (0.92 GiB at 0.5B) and ``N x 4`` in fp32, and would otherwise sit under the call's
        own peak: generation's packed weights, inference's logits.

        The memory is taken back right after the call, not at the next step: on a VM that
        reports free pages to its host (virtio-balloon free page reporting), memory that
        stays free for a few seconds costs a page fault from the host on its next use, and
        pages the call has just freed are still cheap.
        """
        storage = self._model_grad_storage
        free_storage(storage)
        try:
            yield
        finally:
            if storage.device.type == "cpu":
                trim_heap()  # what the call freed goes back first, or the buffer comes on top
            regrow_storage(storage)
            storage.zero_()

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        if self.dp_size == 1:
            return t
        return dist_util.all_reduce_(t, op or dist.ReduceOp.SUM, self.dp_group)

    # ------------------------------------------------------------------ training
    def train_batch(
        self,
        sample: SequenceSample,
        mb_spec: MicroBatchSpec,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        version_steps: Optional[int] = None,
    ) -> Dict[str, float]:
        """One optimizer step on ``sample`` (this rank's share of the global batch).

        Every data-parallel rank must call it (it runs collectives). ``version_steps``
        indexes the learning-rate schedule (the run's global step, so that several
        optimizer steps of one training step share its learning rate); None uses the
        number of ``train_batch`` calls so far.

        Returns (identical on every rank): ``loss`` (global token mean), ``grad_norm``
        (before clipping), ``lr``, ``n_tokens`` (total loss weight over ranks),
        ``n_mbs``, ``skipped`` (1.0 if this step was skipped), ``n_skipped_steps``, and
        the loss function's statistics, weighted like the loss.
        """
        self.model.train()
        if len(sample) == 0:
            raise ValueError("train_batch got a sample with no items; there is nothing to train on")
        self._sync_master_from_model()
        if self.grid is not None and self.dp_group is None:  # one replica: nothing to agree
            mbs = sample.split(mb_spec)[0]
        else:
            mbs, _, _ = sample.synced_data_parallel_split(mb_spec, group=self.dp_group)
        # One micro-batch on one rank: the step applies the model's gradient itself
        # (_step_from_model_grad), with no fp32 sum.
        self._direct = (
            _DIRECT_STEP
            and self.master is not None
            and not self.pipelined
            and self.dp_size == 1
            and len(mbs) == 1
        )
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        if any(not math.isfinite(w) or w < 0 for w in weights):
            raise ValueError(f"loss_weight_fn must return finite numbers >= 0, got {weights}")
        total = float(self._all_reduce(torch.tensor([sum(weights)], dtype=torch.float64))[0])

        if self.pipelined:
            keys, partial = self._forward_backward_pipelined(mbs, weights, total, loss_fn)
            self._sync_tied_embedding()
            self._accumulate_master_grad()
        else:
            keys, partial = self._forward_backward(mbs, weights, total, loss_fn)
        reduced = self._all_reduce(partial.cpu())  # [loss, *stats], global weighted means
        if self._zero is not None:
            self._zero.reduce()
        elif self.dp_size > 1:
            self._all_reduce(self.grad)
            self.grad.div_(self.dp_size)
        step = self.n_steps if version_steps is None else int(version_steps)
        lr = self.lr_schedule(step)
        grad_norm, skipped = self._optimizer_step(total, step, lr)
        # (The fp32 gradient is kept until the next step's zero_grad: freeing it here, so
        # that generation and inference calls between steps do not hold it, cut a 0.5B bf16
        # ppo-math worker's peak from 10.67 to 10.07 GiB but made each actor_train call ~4 s
        # slower, 6.8 -> 10.3-11.0 s.  The VM reports free pages to its host: 1.8 GiB that
        # stayed free during a generation call cost host page faults to take back, where
        # memory freed by zero_grad just before the forward pass is reused at once.)

        out = {
            "loss": float(reduced[0]),
            "grad_norm": grad_norm,
            "lr": lr,
            "n_tokens": total,
            "n_mbs": float(len(mbs)),
            "skipped": float(skipped),
            "n_skipped_steps": float(self.n_skipped),
        }
        for k, v in zip(keys, reduced[1:].tolist()):
            out.setdefault(k, v)
        return out

    def _forward_backward(
        self, mbs: List[SequenceSample], weights: List[float], total: float, loss_fn: LossFn
    ) -> Tuple[List[str], torch.Tensor]:
        """Accumulate the scaled gradients of every micro-batch into the flat buffer.

        Returns the statistic names and this rank's share of ``[loss, *stats]``, each
        weighted by ``w_mb / total`` (summing the shares over ranks gives global means).
        """
        self.zero_grad()
        keys: Optional[List[str]] = None
        shares = []
        device = self.device
        for mb, w in zip(mbs, weights):
            loss, stats = loss_fn(self._run_whole(mb), mb)
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise TypeError(f"loss_fn must return a scalar tensor loss, got {loss!r}")
            if keys is None:
                keys = sorted(stats)
            elif sorted(stats) != keys:
                raise ValueError(
                    f"loss_fn returned stats {sorted(stats)} for one micro-batch and {keys} for "
                    "another; return the same keys every time"
                )
            frac = w / total if total > 0 else 0.0
            if device.type == "cpu":
                # The forward's temporaries, freed, stay on the C heap as holes between the
                # saved activations (keep_freed_memory), and the backward's largest tensors
                # (the [T, V] logits' gradient) cannot reuse them: give them back first,
                # when there are enough of them to matter (or glibc cannot say).
                free = heap_free_bytes()
                if free is None or free >= _TRIM_BEFORE_BACKWARD:
                    trim_heap()
            # Even a zero-weight micro-batch runs backward, so every rank runs the same
            # sequence of operations (activation checkpointing, hooks) and stays in step.
            (loss * (frac * self.dp_size)).backward()
            if not self._direct:
                self._accumulate_master_grad()
            row = [loss.detach()] + [torch.as_tensor(stats[k]) for k in keys]
            # Kept on the device until the end: no host sync per micro-batch.
            shares.append(
                torch.stack([x.to(device, torch.float64).reshape(()) for x in row]) * frac
            )
        self._check_grad_views()
        return keys or [], torch.stack(shares).sum(0)

    def _forward_backward_pipelined(
        self, mbs: List[SequenceSample], weights: List[float], total: float, loss_fn: LossFn
    ) -> Tuple[List[str], torch.Tensor]:
        """:meth:`_forward_backward` over pipeline stages (1F1B); the last stage computes the
        losses and sends ``[loss, *stats]`` shares to the other stages."""
        from realhf.impl.model.parallelism import pipeline

        self.zero_grad()
        g = self.grid
        rows: List[torch.Tensor] = []
        keys: List[List[str]] = []

        def last_stage_loss(out: torch.Tensor, i: int) -> torch.Tensor:
            loss, stats = loss_fn(out, mbs[i])
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise TypeError(f"loss_fn must return a scalar tensor loss, got {loss!r}")
            keys.append(sorted(stats))
            if keys[-1] != keys[0]:
                raise ValueError(
                    f"loss_fn returned stats {keys[-1]} for one micro-batch and {keys[0]} for "
                    "another; return the same keys every time"
                )
            frac = weights[i] / total if total > 0 else 0.0
            row = [loss.detach()] + [torch.as_tensor(stats[k]) for k in keys[0]]
            rows.append(torch.stack([x.to(torch.float64).cpu().reshape(()) for x in row]) * frac)
            return loss * (frac * self.dp_size)

        pipeline.train_1f1b(
            self._stage_fn(mbs),
            len(mbs),
            g,
            self._act_shape(mbs),
            self.model.dtype,
            self.device,
            last_stage_loss,
        )
        self._check_grad_views()
        box = [(keys[0], torch.stack(rows).sum(0))] if g.is_last_stage else [None]
        last = g.stage_rank(g.pp_size - 1)
        dist.broadcast_object_list(box, src=last, group=g.groups["pipe"])
        return box[0]

    def _sync_tied_embedding(self) -> None:
        """Sum the gradients of a tied embedding's two copies (first and last stage)."""
        g, m = self.grid, self.model
        group = g.groups["embed"]
        if group is None or not m.config.shares_head_with_embedding or m.lora is not None:
            return  # (with LoRA the embedding is frozen)
        if m.has_embedding:
            grad = m.embedding.wte.weight.grad
        elif m.head_copies_embedding:
            grad = m.head.weight.grad
        else:
            return
        dist_util.all_reduce_(grad, dist.ReduceOp.SUM, group)

    def _optimizer_step(self, total: float, step: int, lr: float) -> Tuple[float, bool]:
        """Clip and apply the (already averaged) gradient; returns (grad norm, skipped)."""
        grad_norm = self.grad_norm()
        skipped = False
        if total <= 0:
            logger.warning(
                "train_batch: the global batch has no tokens to train on (loss weight 0); "
                "skipping the step"
            )
            skipped = True
        elif not math.isfinite(grad_norm):
            # After the all-reduce every rank holds the same gradient, hence takes the same
            # decision.
            warnings.warn(
                f"train_batch: gradient norm is {grad_norm}; skipping optimizer step {step}",
                stacklevel=2,
            )
            logger.warning(f"non-finite gradient norm {grad_norm}: optimizer step {step} skipped")
            skipped = True
        else:
            clip = self.config.gradient_clipping
            coef = clip / (grad_norm + 1e-6) if clip > 0 and grad_norm > clip else None
            if self._zero is not None:
                if coef is not None:
                    self._zero.grad.mul_(coef)
                self._zero.step(lr)
                self._mark_published()
            else:
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                ext = self._master_kernel()
                if ext is not None:  # (it writes the model's weights too)
                    self._kernel_step(ext, coef)
                elif self._direct:
                    self._step_from_model_grad(coef)
                else:
                    if coef is not None:
                        self.grad.mul_(coef)
                    self.optimizer.step()
                if self.master is not None:
                    if ext is None:
                        with torch.no_grad():
                            self.model.trained_flat.copy_(self.master)
                    self._mark_published()
        self.n_steps += 1
        self.n_skipped += int(skipped)
        return grad_norm, skipped

    def _master_kernel(self):
        """``realhf._C`` where this step's AdamW runs as one C++ pass per element
        (:meth:`_kernel_step`): bf16 model, fp32 master weights on a CPU with realhf's vector
        kernels, plain AdamW settings; else None (torch's fused AdamW)."""
        if (
            self.master is None
            or self.master.device.type != "cpu"
            or self.model.trained_flat.dtype != torch.bfloat16
        ):
            return None
        plain = ("amsgrad", "maximize", "capturable", "differentiable")
        if any(g.get(k) for g in self.optimizer.param_groups for k in plain):
            return None
        return simd_cpu()

    @torch.no_grad()
    def _kernel_step(self, ext, coef: Optional[float]) -> None:
        """AdamW on the master weights in one pass per element, the new weights written to
        the model in bf16 in the same pass (``csrc/adamw_simd.h``).

        The gradient is the model's bf16 one for a step of one micro-batch on one rank (no
        fp32 buffer, as in :meth:`_step_from_model_grad`), else the fp32 sum; either way it
        is read in its dtype and scaled by ``coef`` as it is applied, so the two give the
        same step to the bit.  The moments live in the optimizer's state as torch's AdamW
        keeps them (``step``, ``exp_avg``, ``exp_avg_sq``): checkpoints and the torch path
        read them unchanged.  At the 0.5B shape in bf16 on 2 threads (Xeon, AMX host) the
        step's AdamW and master -> model copy took 0.57 s, this pass 0.33 s."""
        if self._direct:
            self._check_grad_views()
            grads = [g for _, g in self._grad_views]
        else:
            grads = self._master_grad_views
        index = {id(mp): i for i, mp in enumerate(self._master_params)}
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            for mp in group["params"]:
                i = index[id(mp)]
                st = state[mp]
                if not st:  # as torch's AdamW makes it on its first step
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(mp, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(mp, memory_format=torch.preserve_format)
                st["step"] += 1
                ext.adamw_step(
                    mp.detach(),
                    st["exp_avg"],
                    st["exp_avg_sq"],
                    grads[i],
                    self._grad_views[i][0].detach(),
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    step=float(st["step"]),
                    grad_coef=1.0 if coef is None else coef,
                )
        # Written behind autograd's back: whoever watches the weights' version sees the step.
        torch.autograd.graph.increment_version(self.model.trained_flat)

    def _step_from_model_grad(self, coef: Optional[float]) -> None:
        """AdamW on the master weights with the model's low-precision gradient, converted
        (and clipped by ``coef``) into fp32 for a run of parameters of about
        ``_ACCUMULATE_CHUNK`` elements at a time.

        For a step of one micro-batch on one rank, where the fp32 sum would hold exactly
        that gradient converted: the step is the same to the bit, without the fp32 buffer
        (4 bytes per parameter) or its page faults (0.5-1 s a step at 0.5B on this VM).
        AdamW updates each tensor on its own, so stepping runs of them in turn, each with
        only its own gradients set, is one step.  A parameter larger than a run (a 152k
        vocabulary's embedding: 136M elements) is stepped a slice at a time
        (:meth:`_step_in_slices`) once its AdamW state exists."""
        state = self.optimizer.state
        sliced = [
            mp.numel() > _ACCUMULATE_CHUNK and bool(state.get(mp)) for mp in self._master_params
        ]
        runs: List[List[int]] = []
        size = longest = 0
        for i, mp in enumerate(self._master_params):
            if sliced[i]:
                continue
            if not runs or size + mp.numel() > _ACCUMULATE_CHUNK:
                runs.append([])
                size = 0
            runs[-1].append(i)
            size += mp.numel()
            longest = max(longest, size)
        buf = self.master.new_empty(max(longest, _ACCUMULATE_CHUNK if any(sliced) else 0))
        for mp in self._master_params:  # a step takes every parameter that has a grad
            mp.grad = None
        try:
            for i in (i for i, s in enumerate(sliced) if s):
                self._step_in_slices(i, coef, buf)
            for run in runs:
                at = 0
                for i in run:
                    mp, (_, low) = self._master_params[i], self._grad_views[i]
                    g = buf[at : at + mp.numel()].view_as(mp)
                    g.copy_(low)
                    if coef is not None:
                        g.mul_(coef)
                    mp.grad = g
                    at += mp.numel()
                self.optimizer.step()
                for i in run:
                    self._master_params[i].grad = None
        finally:
            for mp, view in zip(self._master_params, self._master_grad_views):
                mp.grad = view

    @torch.no_grad()
    def _step_in_slices(self, i: int, coef: Optional[float], buf: torch.Tensor) -> None:
        """The AdamW step of master parameter ``i``, with its gradient converted into ``buf``
        a slice at a time.

        AdamW is element-wise and its per-tensor scalars depend only on the step count, so
        stepping slices of a tensor (views of it and of its moments) with the step count it
        would have is its step, to the bit.  Converting the embedding's gradient whole needed
        a fresh 545 MB buffer each step at 0.5B, and its page faults took 0.3-0.5 s."""
        mp, (_, low) = self._master_params[i], self._grad_views[i]
        group = next(g for g in self.optimizer.param_groups if any(p is mp for p in g["params"]))
        if group["amsgrad"] or group["maximize"] or not group["fused"]:
            raise NotImplementedError("slices are stepped with the fused AdamW of adamw() only")
        st = self.optimizer.state[mp]
        param, avg, avg_sq = (t.view(-1) for t in (mp, st["exp_avg"], st["exp_avg_sq"]))
        grad, n, step = low.reshape(-1), mp.numel(), buf.numel()
        for a in range(0, n, step):
            b = min(n, a + step)
            g = buf[: b - a].copy_(grad[a:b])
            if coef is not None:
                g.mul_(coef)
            # The functional AdamW adds 1 to the count it is given: each slice gets a copy.
            _functional_adamw(
                [param[a:b]],
                [g],
                [avg[a:b]],
                [avg_sq[a:b]],
                [],
                [st["step"].clone()],
                fused=True,
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        st["step"] += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Optimizer moments and step counters (the weights are saved as an HF directory),
        and the fp32 master weights if there are any (the HF directory holds them rounded).

        The layout does not depend on ZeRO or the data-parallel size: under ZeRO-1 this is
        a collective that assembles the whole state on every rank (see
        :meth:`ShardedAdamW.full_state`)."""
        if self._zero is not None:
            optimizer, master = self._zero.full_state()
        else:
            optimizer = self.optimizer.state_dict()
            master = None if self.master is None else self.master.detach().clone()
        state = {"optimizer": optimizer, "n_steps": self.n_steps, "n_skipped": self.n_skipped}
        if master is not None:
            state["master"] = master
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after loading the weights into the model)."""
        missing = {"optimizer", "n_steps", "n_skipped"} - set(state)
        if missing:
            raise KeyError(f"TrainEngine.load_state_dict: state lacks {sorted(missing)}")
        self.n_steps = int(state["n_steps"])
        self.n_skipped = int(state["n_skipped"])
        master = state.get("master")
        if master is not None and master.numel() != self.model.trained_flat.numel():
            raise ValueError(
                f"TrainEngine.load_state_dict: master weights of {master.numel()} elements "
                f"for a model of {self.model.trained_flat.numel()}"
            )
        if self._zero is not None:
            self._zero.load_full_state(state["optimizer"], master)
            if self._low_precision:
                self._zero.gather_weights()
                self._mark_published()
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.master is not None:
            # A state saved without master weights (an fp32 run) starts them from the model.
            with torch.no_grad():
                self.master.copy_(self.model.trained_flat if master is None else master)
                self.model.trained_flat.copy_(self.master)
            self._mark_published()


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """``(t ** 2).sum()`` as an fp32 scalar: the squares of the fp32 norms of pieces of
    ``t``, summed in fp64.  The same pieces for a gradient and its fp32 conversion: both
    give the same norm, to the bit.

    On a CPU a piece is ``_NORM_PIECE`` elements and a low-precision ``t`` is converted a
    piece at a time into one reused 4 MB float32 buffer, which stays in the caches.  In
    pieces of ``_ACCUMULATE_CHUNK`` (64 MB as fp32) each element went through memory three
    times (read, written as fp32, read again): 483 ms against 245 for the 0.5B shape's
    494M bf16 gradient.  Elsewhere the pieces are ``_ACCUMULATE_CHUNK`` elements.

    Where realhf's vector kernels run (a contiguous float32 or bf16 CPU tensor) the sum is
    one C++ pass that reads ``t`` in its dtype (``realhf._C.sum_squares``, the same for a
    gradient and its fp32 conversion too): 155 -> 30-33 ms for that gradient on the Xeon host."""
    n = t.numel()
    if n == 0:
        return t.new_zeros((), dtype=torch.float32)
    ext = simd_cpu() if t.device.type == "cpu" and t.is_contiguous() else None
    if ext is not None and t.dtype in (torch.float32, torch.bfloat16):
        return torch.tensor(ext.sum_squares(t), dtype=torch.float32)
    step = _NORM_PIECE if t.device.type == "cpu" else _ACCUMULATE_CHUNK
    buf = None
    if t.dtype != torch.float32:
        buf = torch.empty(min(step, n), dtype=torch.float32, device=t.device)
    norms = []
    for a in range(0, n, step):
        piece = t[a : a + step]
        if buf is not None:
            piece = buf[: piece.numel()].copy_(piece)
        norms.append(torch.linalg.vector_norm(piece))
    return torch.stack(norms).double().square().sum().float()
