"""Gradient-free forward passes over a `SequenceSample`, micro-batch by micro-batch.

The engine contract (shared with :class:`~realhf.impl.model.backend.train.TrainEngine`,
which subclasses this engine): a model worker wraps each ReaLModel it hosts in an engine
and hands interfaces a :class:`~realhf.api.core.model_api.Model` whose ``module`` is the
engine. Interfaces then call

- ``model.module.forward(sample, mb_spec, post_hook)`` for inference,
- ``model.module.train_batch(...)`` for training (train engines only),
- ``model.module.model`` for the raw ReaLModel (e.g. to generate from it).

Every sample must carry ``packed_input_ids`` (one or more sequences per item); the network
runs as ``model(input_ids [T], cu_seqlens [B+1])`` on each micro-batch, with the items'
images (:mod:`realhf.api.core.data_api`, "images") when the sample carries them.  With a pipeline
layout (``grid`` with ``pipe > 1``) the micro-batches stream through the stages and the last
stage's result is broadcast, so every rank of a data-parallel replica returns the same.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

from realhf.api.core.data_api import IMAGE_KEYS, MicroBatchSpec, SequenceSample, vision_inputs_of
from realhf.impl.model.modules.shared_prefix import SharedPrefix, prompt_lengths
from realhf.impl.model.nn.parallel_hooks import LOCAL, LocalHooks

__all__ = ["InferenceEngine", "PostHook", "mb_inputs"]

#: ``post_hook(output, mb) -> tensor``: turns the network output of one micro-batch
#: (``[T, vocab]`` logits or ``[T]`` values) into the tensor to return, packed item after
#: item along dim 0 (e.g. next-token log-probs, ``L - 1`` per sequence).
PostHook = Callable[[torch.Tensor, SequenceSample], torch.Tensor]


def mb_images(mb: SequenceSample, model, device: torch.device):
    """The micro-batch's images for ``model``; refuses image placeholders without images
    (a vision-language model would read them as plain tokens and learn nothing from the
    image: the MFC's input keys then lack the image keys)."""
    images = vision_inputs_of(mb, device)
    v = getattr(getattr(model, "config", None), "vision", None)
    if images is None and v is not None and "packed_input_ids" in mb.keys:
        if bool((mb.data["packed_input_ids"] == v.image_token_id).any()):
            raise ValueError(
                f"the batch has image placeholders (token {v.image_token_id}) but no images: "
                f"its keys {sorted(mb.keys)} lack {list(IMAGE_KEYS)}; add them to the MFC's "
                "input keys"
            )
    return images


def mb_inputs(mb: SequenceSample, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [T] long, cu_seqlens [B+1] int32)`` of a (micro-)batch, on ``device``."""
    if "packed_input_ids" not in mb.keys or mb.data is None or mb.data["packed_input_ids"] is None:
        raise KeyError(
            f"the model engines run on key 'packed_input_ids', which this sample lacks "
            f"(keys {sorted(mb.keys)}); select or remap the token key to 'packed_input_ids'"
        )
    ids = mb.data["packed_input_ids"].to(device=device, dtype=torch.long)
    cu = mb.cu_seqlens("packed_input_ids").to(device)
    return ids, cu


class InferenceEngine:
    """Runs a ReaLModel without gradients over micro-batches of a `SequenceSample`.

    Args:
        model: the ReaLModel (already on its device and in its dtype).
        adapters: False: forward with the model's LoRA adapters off (the base model).
        grid: its :class:`~realhf.impl.model.parallelism.grid.ParallelGrid` (None: one
            process, or plain data parallelism).  Every rank of a data-parallel replica
            calls :meth:`forward` with the same sample and gets the same result.
    """

    def __init__(self, model: torch.nn.Module, grid=None, *, adapters: bool = True):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"the engine wraps a torch module (a ReaLModel), got {type(model).__name__}"
            )
        if not adapters and getattr(model, "lora", None) is None:
            raise ValueError("adapters=False needs a model with LoRA adapters")
        self.model = model
        self.grid = grid
        #: False: run the model with its LoRA adapters off (its base: a reference policy)
        self.adapters = adapters
        #: Compute a prompt shared by several sequences of a micro-batch once (see
        #: :mod:`realhf.impl.model.modules.shared_prefix`); needs its ``prompt_mask``.
        self.share_prompts = True

    # ---- module-like surface (``Model`` reads parameters() for its dtype) ----
    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The wrapped model's parameters."""
        return self.model.parameters()

    @property
    def tp(self) -> LocalHooks:
        """The model's tensor-parallel hooks: pass them to log-prob helpers, whose logits
        are vocabulary-sharded under tensor parallelism."""
        return getattr(self.model, "tp", LOCAL)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live."""
        return next(iter(self.model.parameters())).device

    def train(self, mode: bool = True) -> "InferenceEngine":
        """Set the wrapped model's training mode."""
        self.model.train(mode)
        return self

    def eval(self) -> "InferenceEngine":
        """Put the wrapped model in eval mode."""
        return self.train(False)

    @torch.no_grad()
    def forward(
        self,
        sample: SequenceSample,
        mb_spec: MicroBatchSpec,
        post_hook: Optional[PostHook] = None,
        output_seqlens: Optional[List[List[int]]] = None,
    ) -> torch.Tensor:
        """Forward every micro-batch and return the outputs in the sample's item order.

        Args:
            sample: the batch; its items are cut into micro-batches by ``mb_spec``
                (first-fit-decreasing, items never cut) and the results put back in order.
            mb_spec: micro-batch count / token budget.
            post_hook: maps ``(network output, micro-batch)`` to the tensor kept for that
                micro-batch; default: the raw output (logits ``[T, V]`` or values ``[T]``).
            output_seqlens: per item, the lengths of its sequences in the hook's output
                (e.g. ``L - 1`` each for next-token log-probs); default: the
                ``packed_input_ids`` lengths (one output row per token).

        Returns:
            The outputs of all items concatenated along dim 0, in the sample's item order.
        """
        if output_seqlens is None:
            output_seqlens = sample.seqlens["packed_input_ids"]
        if len(output_seqlens) != len(sample):
            raise ValueError(
                f"output_seqlens has {len(output_seqlens)} entries for {len(sample)} items"
            )
        # split() reorders items to pack micro-batches: the i-th item in split order is
        # item forward_idx[i] of the sample, and backward_idx puts them back.
        mbs, forward_idx, backward_idx = sample.split(mb_spec)
        with contextlib.nullcontext() if self.adapters else self.model.lora.disabled():
            outs = self._run_microbatches(mbs, post_hook)
        if outs is None:  # a pipeline stage other than the last
            return self._receive_result()
        per_item: List[torch.Tensor] = []
        for mb, out, start in zip(mbs, outs, _starts([len(m) for m in mbs])):
            sizes = [sum(output_seqlens[forward_idx[start + j]]) for j in range(len(mb))]
            if out.shape[0] != sum(sizes):
                raise ValueError(
                    f"the forward output of a micro-batch has {out.shape[0]} rows but "
                    f"output_seqlens give {sum(sizes)} for its items; pass output_seqlens that "
                    "match the post_hook"
                )
            per_item.extend(torch.split(out, sizes, dim=0))
        result = torch.cat([per_item[i] for i in backward_idx], dim=0)
        if self.pipelined:
            self._send_result(result)
        return result

    def _run_whole(self, mb: SequenceSample) -> torch.Tensor:
        """The network output of one micro-batch on a whole (not pipelined) model, each
        shared prompt computed once when the micro-batch marks its prompts."""
        ids, cu = mb_inputs(mb, self.device)
        images = mb_images(mb, self.model, self.device)
        sp = None
        mask = mb.data.get("prompt_mask") if mb.data is not None else None
        if self.share_prompts and mask is not None and not self.model.config.sliding_window:
            bounds = cu.tolist()
            sp = SharedPrefix.from_prompts(
                ids,
                bounds,
                prompt_lengths(mask, bounds),
                None if images is None else images.seq_images,  # equal prompts, equal images
            )
        return self.model(ids, cu, shared_prefix=sp, images=images)

    # ---- pipeline parallelism ----------------------------------------------------------

    @property
    def pipelined(self) -> bool:
        """Whether the model is one stage of a pipeline (its grid has ``pipe > 1``)."""
        return self.grid is not None and self.grid.pp_size > 1

    def _stage_fn(self, mbs: List[SequenceSample]):
        device = self.device

        def run(x: Optional[torch.Tensor], i: int) -> torch.Tensor:
            ids, cu = mb_inputs(mbs[i], device)
            return self.model(ids, cu, hidden=x, images=mb_images(mbs[i], self.model, device))

        return run

    def _act_shape(self, mbs: List[SequenceSample]):
        hidden = self.model.config.hidden_dim
        return lambda i: (sum(mbs[i].flat_seqlens("packed_input_ids")), hidden)

    def _run_microbatches(
        self, mbs: List[SequenceSample], post_hook: Optional[PostHook]
    ) -> Optional[List[torch.Tensor]]:
        """The (post-hooked) output of every micro-batch; None on a pipeline stage that
        is not the last."""
        if not self.pipelined:
            outs = []
            for mb in mbs:
                out = self._run_whole(mb)
                outs.append(out if post_hook is None else post_hook(out, mb))
            return outs
        from realhf.impl.model.parallelism import pipeline

        run = self._stage_fn(mbs)
        if self.grid.is_last_stage and post_hook is not None:
            stage, run = run, lambda x, i: post_hook(stage(x, i), mbs[i])
        return pipeline.forward_only(
            run, len(mbs), self.grid, self._act_shape(mbs), self.model.dtype, self.device
        )

    def _send_result(self, result: torch.Tensor) -> None:
        """Last stage: broadcast the result to the other stages of the pipeline."""
        g = self.grid
        meta = [(tuple(result.shape), result.dtype)]
        dist.broadcast_object_list(meta, src=g.stage_rank(g.pp_size - 1), group=g.groups["pipe"])
        dist.broadcast(result.contiguous(), src=g.stage_rank(g.pp_size - 1), group=g.groups["pipe"])

    def _receive_result(self) -> torch.Tensor:
        g = self.grid
        meta = [None]
        dist.broadcast_object_list(meta, src=g.stage_rank(g.pp_size - 1), group=g.groups["pipe"])
        shape, dtype = meta[0]
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(out, src=g.stage_rank(g.pp_size - 1), group=g.groups["pipe"])
        return out


def _starts(counts: List[int]) -> List[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
