"""ReaLModel: a decoder-only transformer over packed sequences with flat weights.

Input is a packed batch — ``input_ids: [T]`` holding all sequences back to back
and ``cu_seqlens: [B+1]`` with their offsets — so no compute is spent on
padding.  Output is ``[T, vocab]`` logits, or ``[T]`` values for a critic.

Every parameter is a view into ``model.flat_params`` (layout in
``model.param_spec``, see :mod:`realhf.impl.model.nn.flat_param`).  Moving the
model (``.to(device/dtype)``) converts the flat buffer once and re-points the
parameters at it, so the views survive.  The model code is single-device; tensor
parallelism enters through the hooks object ``tp``
(:mod:`realhf.impl.model.nn.parallel_hooks`): the layers are then built with the rank's
share of heads, MLP width and vocabulary, so the flat buffer holds only the local shard.

Checkpoints are HuggingFace directories: :meth:`ReaLModel.from_hf`,
:meth:`ReaLModel.save_hf`, :meth:`ReaLModel.load_hf_weights` (conversion lives
in :mod:`realhf.impl.model.conversion`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.utils.checkpoint

from realhf.impl.model.modules.rotary import mrope_cos_sin, rope_cos_sin, rope_inv_freq
from realhf.impl.model.modules.shared_prefix import SharedPrefix
from realhf.impl.model.nn.flat_param import ParamSpec, build_param_spec, flat_view
from realhf.impl.model.nn.layers import (
    AttnFn,
    EmbeddingLayer,
    OutputHead,
    PackedContext,
    TransformerBlock,
)
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.parallel_hooks import LOCAL, LocalHooks
from realhf.impl.model.nn.vision import VisionInputs, mrope_positions

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-sequence positions ``0..L-1`` for every token of a packed batch ``[T]``."""
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    # output_size: without it repeat_interleave syncs with the device to learn the length.
    starts = torch.repeat_interleave(cu_seqlens[:-1], seqlens, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def _register_param(root: nn.Module, dotted: str, param: nn.Parameter) -> None:
    """Register ``param`` at ``a.b.weight`` under ``root``, creating containers."""
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)


class ReaLModel(nn.Module):
    """Decoder-only transformer over packed sequences (see module docstring).

    Args:
        config: the architecture.
        dtype: parameter dtype (float32, bfloat16 or float16).
        device: where the flat buffer lives; ``"meta"`` builds the structure
            and param spec without memory.
        is_critic: override ``config.is_critic`` (a one-output value head
            instead of the LM head); ``None`` keeps the config's value.
        init_weights: initialise weights (normal(0, init_std), norms to one,
            biases to zero); ``from_hf`` skips it since it overwrites them.
        gradient_checkpointing: recompute each block in backward instead of
            storing its activations.
        attn_impl: packed attention implementation, see
            :func:`realhf.impl.model.modules.attention.packed_causal_attention`.
        tp: tensor-parallel hooks (default: single device); see
            :class:`realhf.impl.model.parallelism.tensor_parallel.TensorParallel`.
        layers: ``(start, end)``: hold only layers ``start..end-1`` (a pipeline stage;
            layer 0 is the embedding, ``n_layers + 1`` the head); default all.  A stage
            without the embedding takes hidden states as input (``forward(hidden=)``), one
            without the head returns them.  A last stage of a tied-embedding model holds
            its own copy of the embedding matrix as ``{n+1}.weight`` (kept equal to the
            embedding by summing their gradients, see the pipeline engine).
        critic_lm_logits: a critic of a tied-embedding model that also returns its
            language-model logits (through the embedding matrix it holds anyway):
            ``forward`` gives ``[T, 1 + vocab]``, column 0 the value.  For reward models
            trained with a language-model regulariser (``rw.lm_coef``); whole models
            only (no pipeline stages).  The parameters are a plain critic's.

    ``config`` is always the whole architecture; ``layer_config`` is the one the layers
    were built from (this rank's shard under tensor parallelism, else ``config``).

    Children are named ``"0"`` (embedding), ``"1".."n"`` (blocks) and
    ``"n+1"`` (head), so ``state_dict()`` keys equal ``param_spec`` keys.
    """

    def __init__(
        self,
        config: ReaLModelConfig,
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        is_critic: Optional[bool] = None,
        *,
        init_weights: bool = True,
        gradient_checkpointing: bool = False,
        attn_impl: str = "auto",
        tp: LocalHooks = LOCAL,
        layers: Optional[Tuple[int, int]] = None,
        critic_lm_logits: bool = False,
    ):
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"ReaLModel dtype={dtype} is unsupported; use one of {_DTYPES}")
        if is_critic is not None and is_critic != config.is_critic:
            config = dataclasses.replace(config, is_critic=is_critic)
        self.config = config
        self.tp = tp
        self.layer_config = lc = tp.local_config(config)
        self.gradient_checkpointing = gradient_checkpointing
        self.attn_impl = attn_impl
        self._inv_freq_cache: Dict[torch.device, torch.Tensor] = {}

        n_all = config.n_layers + 2
        start, end = (0, n_all) if layers is None else (int(layers[0]), int(layers[1]))
        if not 0 <= start < end <= n_all:
            raise ValueError(
                f"ReaLModel layers={layers!r}: need 0 <= start < end <= {n_all} "
                f"(embedding 0, blocks 1..{config.n_layers}, head {n_all - 1})"
            )
        self.layer_range = (start, end)
        if critic_lm_logits and not (config.is_critic and config.tied_embedding):
            raise ValueError(
                "critic_lm_logits needs a critic (is_critic=True) of a model with tied "
                "embeddings (the LM head is the embedding matrix); this model has "
                f"is_critic={config.is_critic}, tied_embedding={config.tied_embedding}"
            )
        if critic_lm_logits and (start, end) != (0, n_all):
            raise ValueError(
                "critic_lm_logits needs the whole model (the head reads the embedding "
                f"matrix); this part holds layers {start}..{end - 1} of a pipeline"
            )
        self.critic_lm_logits = bool(critic_lm_logits)
        #: whether the head keeps its own copy of a tied embedding (a last pipeline stage)
        self.head_copies_embedding = (
            config.shares_head_with_embedding and start > 0 and end == n_all
        )
        built = {}
        for idx in range(start, end):
            if idx == 0:
                built[idx] = (EmbeddingLayer(lc, tp), lc)
            elif idx == n_all - 1:
                hc = (
                    dataclasses.replace(lc, tied_embedding=False)
                    if self.head_copies_embedding
                    else lc
                )
                built[idx] = (OutputHead(hc, tp), hc)
            else:
                built[idx] = (TransformerBlock(lc, idx - 1, tp), lc)
        for idx, (layer, _) in built.items():
            self.add_module(str(idx), layer)

        decls = [(idx, type(layer).param_decls(c)) for idx, (layer, c) in built.items()]
        self.param_spec: Dict[str, ParamSpec]
        self.param_spec, total = build_param_spec(
            [(idx, [(n, s) for n, s, _ in d]) for idx, d in decls]
        )
        self.flat_params = torch.empty(total, dtype=dtype, device=device)
        #: LoRA adapters (:func:`~realhf.impl.model.nn.lora.add_lora`), or None
        self.lora = None
        self._init_kinds = {f"{idx}.{n}": kind for idx, d in decls for n, _, kind in d}
        for name, spec in self.param_spec.items():
            _register_param(self, name, nn.Parameter(flat_view(self.flat_params, spec)))
        if init_weights:
            self.reset_parameters()

    # ---- structure -------------------------------------------------------

    @property
    def embedding(self) -> EmbeddingLayer:
        """Layer 0."""
        return getattr(self, "0")

    @property
    def blocks(self):
        """The transformer blocks this model holds (layers 1..n_layers), in order."""
        start, end = self.layer_range
        lo, hi = max(start, 1), min(end, self.config.n_layers + 1)
        return [getattr(self, str(i)) for i in range(lo, hi)]

    @property
    def has_embedding(self) -> bool:
        """Whether layer 0 is here (the first pipeline stage)."""
        return self.layer_range[0] == 0

    @property
    def has_head(self) -> bool:
        """Whether the head is here (the last pipeline stage)."""
        return self.layer_range[1] == self.config.n_layers + 2

    @property
    def head(self) -> OutputHead:
        """Layer n_layers + 1."""
        return getattr(self, str(self.config.head_layer_idx))

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype."""
        return self.flat_params.dtype

    @property
    def device(self) -> torch.device:
        """Device of the flat buffer."""
        return self.flat_params.device

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Fresh initialisation of every parameter (in place in the flat buffer)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                kind = self._init_kinds[name]
                if kind == "ones":
                    p.fill_(1.0)
                elif kind == "zeros":
                    p.zero_()
                else:
                    p.normal_(0.0, self.config.init_std, generator=generator)

    # ---- what trains ------------------------------------------------------

    @property
    def trained_flat(self) -> torch.Tensor:
        """The flat buffer a TrainEngine optimises: the adapters' with LoRA, else
        :attr:`flat_params`."""
        return self.flat_params if self.lora is None else self.lora.flat

    @property
    def trained_spec(self) -> Dict[str, ParamSpec]:
        """The layout of :attr:`trained_flat`."""
        return self.param_spec if self.lora is None else self.lora.param_spec

    def trained_parameters(self):
        """``(name, parameter)`` of what trains, in :attr:`trained_spec`'s names: the
        adapters with LoRA (the base is frozen), else every parameter."""
        if self.lora is None:
            return list(self.named_parameters())
        return list(self.lora.params.items())

    def train(self, mode: bool = True):
        if self.lora is not None:
            self.lora.training = mode  # (adapter dropout)
        return super().train(mode)

    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy a whole 1-D parameter vector (same layout) into the flat buffer."""
        if flat.dim() != 1 or flat.numel() != self.flat_params.numel():
            raise ValueError(
                f"load_flat got a tensor of shape {tuple(flat.shape)}; expected a 1-D "
                f"tensor of {self.flat_params.numel()} elements (this model's flat buffer)"
            )
        with torch.no_grad():
            self.flat_params.copy_(flat)

    def copy_base(self) -> "ReaLModel":
        """A copy of the model without its LoRA adapters (weights, trainable flags and mode
        kept), in a flat buffer of its own."""
        # The default deepcopy clones every parameter separately, which would
        # leave the copy's parameters outside its flat buffer.
        new = type(self)(
            self.config,
            dtype=self.dtype,
            device=self.device,
            init_weights=False,
            gradient_checkpointing=self.gradient_checkpointing,
            attn_impl=self.attn_impl,
            tp=self.tp,
            layers=self.layer_range,
        )
        new.load_flat(self.flat_params.detach())
        for (_, src), (_, dst) in zip(self.named_parameters(), new.named_parameters()):
            dst.requires_grad_(src.requires_grad)
        new.train(self.training)
        return new

    def __deepcopy__(self, memo):
        new = self.copy_base()
        if self.lora is not None:
            from realhf.impl.model.nn.lora import add_lora

            add_lora(new, self.lora.spec, init=False).use_flat(self.lora.flat.detach().clone())
            new.lora.enabled = self.lora.enabled
        memo[id(self)] = new
        return new

    def _apply(self, fn, recurse=True):
        # Module._apply would convert each parameter separately and break the
        # views; convert the buffer once and re-point every parameter instead.
        self.use_flat(fn(self.flat_params))
        if self.lora is not None:
            self.lora.use_flat(fn(self.lora.flat))
        for _, p in self.trained_parameters():
            # Grads are views of the TrainEngine's own flat buffer, not of this model's; a
            # converted grad is a loose tensor, which the engine copies back into its buffer
            # (TrainEngine._check_grad_views).
            if p.grad is not None:
                p.grad = fn(p.grad)
        self._inv_freq_cache.clear()  # keyed by device, which may have changed
        return self

    def use_flat(self, new_flat: torch.Tensor) -> None:
        """Make ``new_flat`` (this model's layout, any dtype and device) the flat buffer:
        every parameter becomes a view of it.  Nothing is copied; the old buffer is freed
        when nothing else holds it.  A generation server serves a flat weight file in
        shared memory this way (:func:`~realhf.impl.model.conversion.flat_file.map_flat`)."""
        if new_flat.dim() != 1 or new_flat.numel() != self.flat_params.numel():
            raise ValueError(
                f"a flat buffer of {self.flat_params.numel()} elements is needed, got "
                f"{tuple(new_flat.shape)}"
            )
        for name, p in self.named_parameters():
            p.data = flat_view(new_flat, self.param_spec[name])
        self.flat_params = new_flat

    # ---- forward ---------------------------------------------------------

    def _rope_tables(self, position_ids: torch.Tensor):
        if self.config.abs_position_embedding:
            return None, None
        dev = position_ids.device
        if dev not in self._inv_freq_cache:
            self._inv_freq_cache[dev] = rope_inv_freq(
                self.config.head_dim,
                self.config.rope_theta,
                device=dev,
                scaling=self.config.rope_scaling,
            )
        if position_ids.dim() == 2:  # [3, T]: multimodal RoPE
            return mrope_cos_sin(
                position_ids, self._inv_freq_cache[dev], self.dtype, self.config.mrope_section
            )
        return rope_cos_sin(position_ids, self._inv_freq_cache[dev], self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        position_ids: Optional[torch.Tensor] = None,
        attn_fn: Optional[AttnFn] = None,
        max_seqlen: Optional[int] = None,
        hidden: Optional[torch.Tensor] = None,
        shared_prefix: Optional[SharedPrefix] = None,
        images: Optional[VisionInputs] = None,
        output_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the packed batch through the layers this model holds.

        Args:
            input_ids: ``LongTensor[T]``, all sequences concatenated.
            cu_seqlens: ``IntTensor[B+1]``, ``0 = cu[0] <= ... <= cu[B] = T``.
            position_ids: ``LongTensor[T]``; default per-sequence ``0..L-1``.
            attn_fn: KV-cache hook.  When given, each block computes q
                ``[T, n_q_heads, head_dim]`` and k, v ``[T, n_kv_heads, head_dim]``
                (after bias, q/k norm and RoPE at ``position_ids``) and calls
                ``attn_fn(layer_idx, q, k, v)`` with ``layer_idx`` the 0-based
                block index; it must return ``[T, n_q_heads, head_dim]``, to which
                the block applies its output projection.  ``cu_seqlens`` is then
                not used for attention.
            max_seqlen: longest sequence, if known (saves a sync for flash-attn).
            hidden: ``[T, hidden_dim]`` input hidden states of a pipeline stage without
                the embedding (required there, refused elsewhere).
            shared_prefix: compute each shared prompt once (see
                :mod:`realhf.impl.model.modules.shared_prefix`); the output still has one
                row per packed token.  Whole models without a sliding window only, and
                without ``position_ids`` / ``attn_fn`` / ``hidden``; with ``images`` each
                prompt's images are encoded for its leader only (``seq_images`` needed).
            images: the batch's images (a vision-language model): the vision tower's
                tokens replace the image placeholders (on the stage with the embedding),
                and the default positions become multimodal RoPE positions ``[3, T]``
                (:func:`~realhf.impl.model.nn.vision.mrope_positions`).  Explicit
                ``position_ids`` of such a model may be ``[3, T]``.
            output_rows: ``LongTensor[R]``, packed rows at which the head runs (a
                generation's prefill samples from each prompt's last row only): the
                output then has ``R`` rows, in this order.  The LM head is the largest
                product of a model with a large vocabulary; a stage without the head
                still returns all ``T`` hidden states.

        Returns:
            ``[T, vocab_size]`` logits (``[T, vocab_size / tp]``, this rank's vocabulary
            rows, under tensor parallelism), or ``[T]`` values for a critic (``[T, 1 +
            vocab]``, the value then the logits, with ``critic_lm_logits``), in the
            model dtype; ``[T, hidden_dim]`` hidden states from a stage without the head.
            (``R`` rows instead of ``T`` with ``output_rows``.)
        """
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids must be 1-D packed tokens [T], got shape {tuple(input_ids.shape)}"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D [B+1], got shape {tuple(cu_seqlens.shape)}")
        T = input_ids.shape[0]
        sp = shared_prefix
        if images is not None and self.config.vision is None:
            raise ValueError(
                f"images were given to a {self.config.family} model, which has no vision "
                "tower; use a vision-language model (family qwen2_5_vl)"
            )
        if sp is not None:
            if attn_fn is not None or position_ids is not None or hidden is not None:
                raise ValueError("shared_prefix sets positions and attention itself")
            if images is not None and images.n_images and images.seq_images is None:
                raise ValueError(
                    "shared_prefix with images needs VisionInputs.seq_images (which images "
                    "each sequence reads; vision_inputs_of sets it)"
                )
            if not (self.has_embedding and self.has_head) or self.config.sliding_window:
                raise ValueError(
                    "shared_prefix needs a whole model (not a pipeline stage) without a "
                    "sliding window"
                )
            if sp.expand.numel() != T:
                raise ValueError(f"shared_prefix describes {sp.expand.numel()} tokens, not {T}")
        if output_rows is not None and (
            output_rows.dim() != 1 or output_rows.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                f"output_rows must be a 1-D integer tensor of packed rows, got "
                f"{output_rows.dtype} of shape {tuple(output_rows.shape)}"
            )
        if int(cu_seqlens[-1]) != T:
            raise ValueError(
                f"cu_seqlens[-1]={int(cu_seqlens[-1])} must equal the number of packed tokens {T}"
            )
        cu_seqlens = cu_seqlens.to(input_ids.device)
        if sp is not None:  # the attention reads sp's rows, not cu_seqlens
            position_ids = sp.position_ids
            if images is not None and images.n_images:
                # The full pack's multimodal positions, at the kept rows; the images of the
                # sequences that keep their prompt (the others read it from their leader's).
                full = mrope_positions(input_ids, cu_seqlens, images.slot_grids, self.config.vision)
                position_ids = full.position_ids[:, sp.keep]
                slots, first = [], 0
                for seq, own_prompt in zip(images.seq_images, sp.keeps_prompt):
                    if own_prompt:
                        slots += range(first, first + len(seq))
                    first += len(seq)
                images = images.select(slots)
            input_ids = input_ids[sp.keep]
            cu_seqlens = cu_seqlens.new_tensor([0, input_ids.shape[0]])
        if position_ids is None:
            if images is not None and images.n_images:
                v = self.config.vision
                position_ids = mrope_positions(input_ids, cu_seqlens, images.slot_grids, v)
                position_ids = position_ids.position_ids
            else:
                position_ids = packed_position_ids(cu_seqlens, T)
        elif position_ids.shape != input_ids.shape and not (
            self.config.mrope_section is not None and position_ids.shape == (3, input_ids.shape[0])
        ):
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} must equal input_ids "
                f"shape {tuple(input_ids.shape)}"
                + (" (or [3, T] multimodal positions)" if self.config.mrope_section else "")
            )
        # The RoPE tables are built once per forward and shared by all blocks.
        cos, sin = self._rope_tables(position_ids)
        ctx = PackedContext(
            cu_seqlens, max_seqlen, cos, sin, attn_fn, self.attn_impl, shared_prefix=sp
        )
        if self.has_embedding != (hidden is None):
            raise ValueError(
                f"ReaLModel holding layers {self.layer_range}: "
                + (
                    "pass hidden= (the previous stage's output); this stage has no embedding"
                    if hidden is None
                    else "hidden= is only for pipeline stages without the embedding"
                )
            )
        if hidden is not None and tuple(hidden.shape) != (T, self.config.hidden_dim):
            raise ValueError(
                f"hidden has shape {tuple(hidden.shape)}; expected [T, hidden_dim] = "
                f"[{T}, {self.config.hidden_dim}]"
            )
        h = self.embedding(input_ids, position_ids, images) if hidden is None else hidden
        checkpoint = (
            self.gradient_checkpointing
            and self.training
            and torch.is_grad_enabled()
            and attn_fn is None  # a KV-cache hook must not be called twice
        )
        for block in self.blocks:
            if checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, ctx, use_reentrant=False)
            else:
                h = block(h, ctx)
        if not self.has_head:
            return h
        tied = None
        if self.critic_lm_logits or (
            self.config.shares_head_with_embedding and not self.head_copies_embedding
        ):
            tied = self.embedding.wte.weight
        rows = sp.expand if sp is not None else None  # the output's rows among h's
        if output_rows is not None:
            output_rows = output_rows.to(h.device)
            rows = output_rows if rows is None else rows.index_select(0, output_rows)
        return self.head(h if rows is None else h.index_select(0, rows), tied)

    # ---- HuggingFace checkpoints -----------------------------------------

    @classmethod
    def from_hf(
        cls,
        model_dir: Union[str, os.PathLike],
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cpu",
        is_critic: bool = False,
        **kwargs,
    ) -> "ReaLModel":
        """Build a model from a HuggingFace directory (family from config.json).

        A critic loads its value head from a critic checkpoint written by
        :meth:`save_hf`, or starts a fresh one on a causal-LM checkpoint.  A PEFT LoRA
        adapter directory (``adapter_config.json``, no ``config.json``) loads its base
        model (``base_model_name_or_path``) with the adapters on it.
        ``kwargs`` go to the constructor (``gradient_checkpointing``, ``tp``, ...); with
        tensor-parallel hooks ``tp`` the model holds this rank's shard.
        """
        from realhf.impl.model.conversion import hf
        from realhf.impl.model.nn.lora import (
            adapter_base,
            add_lora,
            is_adapter_dir,
            load_peft,
            read_peft_spec,
        )

        if is_adapter_dir(model_dir):  # the base, then its adapters on it
            model = cls.from_hf(adapter_base(model_dir), dtype, device, is_critic, **kwargs)
            add_lora(model, read_peft_spec(str(model_dir)), init=False)
            load_peft(model, str(model_dir))
            return model
        tp = kwargs.pop("tp", LOCAL)
        config = hf.config_from_hf_dir(model_dir, is_critic=is_critic)
        if tp.distributed:
            # Every rank reads the whole checkpoint on the host and keeps its shard.
            full = cls(config, dtype=dtype, device="cpu", init_weights=False)
            hf.load_weights(full, model_dir, check_config=False)
            return tp.shard_model(full, device=device, **kwargs)
        model = cls(config, dtype=dtype, device=device, init_weights=False, **kwargs)
        hf.load_weights(model, model_dir, check_config=False)
        return model

    def load_hf_weights(self, model_dir: Union[str, os.PathLike]) -> None:
        """Replace the weights in place from a HuggingFace directory of the same
        architecture (the flat buffer and parameter objects are kept)."""
        from realhf.impl.model.conversion import hf

        hf.load_weights(self, model_dir, check_config=True)

    def save_trained(
        self,
        out_dir: Union[str, os.PathLike],
        base_model_path: Optional[str] = None,
        tokenizer=None,
    ) -> None:
        """Write what training changes (a recover checkpoint's weights, a saved model): the
        HF directory, or with LoRA the adapters alone in PEFT's format, naming
        ``base_model_path`` as their base; with ``tokenizer`` (as for :meth:`save_hf`) in
        either case.  A collective like :meth:`save_hf`."""
        if self.lora is None:
            return self.save_hf(out_dir, tokenizer)
        from realhf.impl.model.conversion.hf import save_tokenizer
        from realhf.impl.model.nn.lora import save_peft

        full = self.tp.gather_model(self) if self.tp.distributed else self
        if full is not None:  # (None: a rank that does not write)
            save_peft(full, str(out_dir), base_model_path=base_model_path)
            if tokenizer is not None:  # (loaders of the directory find it there)
                save_tokenizer(tokenizer, str(out_dir))

    def load_trained(self, model_dir: Union[str, os.PathLike]) -> None:
        """Load what :meth:`save_trained` wrote, in place."""
        if self.lora is None:
            return self.load_hf_weights(model_dir)
        from realhf.impl.model.nn.lora import load_peft

        load_peft(self, str(model_dir))

    def save_hf(
        self,
        model_dir: Union[str, os.PathLike],
        tokenizer=None,
        *,
        max_shard_bytes: Optional[int] = None,
    ) -> None:
        """Write a HuggingFace directory (config.json + safetensors) that
        ``transformers`` loads (``AutoModelForCausalLM``, or
        ``AutoModelForTokenClassification`` with one label for a critic).  A model with
        LoRA adapters writes the merged model (:func:`~realhf.impl.model.nn.lora.merged`).

        ``tokenizer`` is a tokenizer object (saved with ``save_pretrained``) or a
        directory whose tokenizer files are copied.  ``max_shard_bytes``: weight file size
        (None: :data:`~realhf.impl.model.conversion.checkpoint.SHARD_BYTES`).  Under tensor
        parallelism this is a collective of the tensor-parallel group and its rank 0 writes
        the whole model.
        """
        from realhf.impl.model.conversion import hf

        if self.lora is not None:  # the base with the adapters folded in
            from realhf.impl.model.nn.lora import merged

            return merged(self).save_hf(model_dir, tokenizer, max_shard_bytes=max_shard_bytes)
        if self.tp.distributed:
            # Collective over the model's ranks; one of them writes the whole model.
            full = self.tp.gather_model(self)
            if full is not None:
                full.save_hf(model_dir, tokenizer, max_shard_bytes=max_shard_bytes)
            return
        hf.save(self, model_dir, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)
