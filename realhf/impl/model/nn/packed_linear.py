"""Linear weights pre-packed for decoding: faster decode-time matmuls on CPU.

``F.linear`` on a CPU tensor hands a plain ``[out, in]`` matrix to the BLAS: in bf16 oneDNN
reorders it into its blocked layout on every call, and in fp32 MKL's sgemm runs a generic
path on AMD CPUs.  Packing the weights once makes each product faster.  bf16 weights are
packed for oneDNN (AMD EPYC Zen 5, AVX-512 with ``avx512_bf16``, one thread: 1.2-2.8x, 16
rows against Qwen2.5-0.5B's matrices: 72.6 -> 47.5 ms per decode step).  fp32 weights are
packed for realhf's own decode kernel (``realhf._C.decode_linear``, where the CPU has AVX2 or
AVX-512; else for oneDNN), which streams blocks of 16 output rows: against 0.5B-MLP matrices
at 16 rows on a 2-core Xeon it reads weights at 18.1 GB/s, oneDNN's packed product at 16.0
and ``F.linear`` at 9.0.  Beyond :data:`DECODE_KERNEL_ROWS` rows (a prefill) the fp32
products are ``F.linear`` on the model's own weights; an engine that runs more than
:data:`DECODE_KERNEL_BATCH` sequences at once packs fp32 for oneDNN, which is faster
there.  Packing also lets one product serve several projections: q, k and v (and an MLP's
gate and up) are packed side by side and their output split.  fp32 products then sum in
another order than ``F.linear`` (a few ulps).

The packed weights are copies (the model's memory for its weights once more), made by a
:class:`WeightPacker` a few matrices at a time, and used only while they match the weights:
each records every weight it was made from (the parameter, its memory, which the pack keeps
alive, and its version counter), and a product whose weight has changed since (a weight
update in place, or a new buffer) falls back to ``F.linear`` until the packer packs it
again.  So a stale pack is never used, whoever changes the weights.

Used by the generation engine (:mod:`realhf.impl.model.gen.engine`) on single-device
models; training never packs (the products need gradients).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from realhf.impl.kernels import simd_cpu

__all__ = ["PackedLinear", "WeightPacker", "packing_supported", "packed_or_none"]

#: Rows up to which a packed float32 product runs realhf's decode kernel; more go to
#: ``F.linear`` (0.5B-MLP matrices, 2 AVX-512 cores: the kernel is 1.1x oneDNN's packed
#: product at 16 rows and 3x ``F.linear``; equal to ``F.linear`` at 64, 0.4x at 512).
DECODE_KERNEL_ROWS = 64
#: Running sequences up to which fp32 weights are packed for realhf's decode kernel rather
#: than for oneDNN (same matrices: the kernel 18.1 GB/s against 16.0 at 16 rows, 12.5
#: against 13.3 at 24, 5.4 against 7.2 at 64).
DECODE_KERNEL_BATCH = 20


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of ``dtype`` on ``device`` can be packed here (fp32, or bf16 where
    oneDNN has bf16 kernels, on a CPU)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    mk = torch.ops.mkldnn
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(mk, "_reorder_linear_weight")
            and hasattr(mk, "_linear_pointwise")
            and (dtype != torch.bfloat16 or bool(mk._is_mkldnn_bf16_supported()))
        )
    except (RuntimeError, AttributeError):
        return False


class PackedLinear:
    """``x @ cat(weights).T + cat(biases)`` with the weights packed; ``None`` biases are
    zeros.  ``weights`` are the modules' parameters at packing time."""

    def __init__(
        self,
        weights: List[torch.Tensor],
        biases: Optional[List[Optional[torch.Tensor]]],
        batch_hint: int,
    ):
        # Each source with an alias of its data: holding the storage keeps its address
        # from being reused, so an equal address below means the same memory.
        self._sources = [(w, w.detach(), w._version) for w in weights]
        plain = _rows_in_place(weights)
        w = (torch.cat(weights) if plain is None else plain).detach()
        self.bias = None
        if biases is not None and any(b is not None for b in biases):
            self.bias = torch.cat(
                [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)]
            ).detach()
        self._ext = _decode_kernels(w) if batch_hint <= DECODE_KERNEL_BATCH else None
        if self._ext is None:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
            return
        # realhf's float32 decode kernel takes the few rows of a decode step; a prefill's
        # many go to F.linear on the model's own weights (a product per source matrix where
        # they do not lie side by side: a joined copy would cost memory)
        self.n_out = w.shape[0]
        if plain is not None:
            self._plain = [(w, self.bias)]
        else:
            bs = biases or [None] * len(weights)
            self._plain = [
                (s.detach(), None if b is None else b.detach()) for s, b in zip(weights, bs)
            ]
        self.weight, self.bias_padded = pack_blocks(w, self.bias)

    def fresh(self, weights: List[torch.Tensor]) -> bool:
        """Whether ``weights`` are still the tensors, and values, this was packed from."""
        return len(weights) == len(self._sources) and all(
            w is s and w.data_ptr() == d.data_ptr() and w._version == v
            for w, (s, d, v) in zip(weights, self._sources)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if x.dim() == 2 and x.shape[0] <= DECODE_KERNEL_ROWS:
            return self._ext.decode_linear(x, self.weight, self.bias_padded, self.n_out)
        if len(self._plain) == 1:
            return F.linear(x, *self._plain[0])
        return torch.cat([F.linear(x, w, b) for w, b in self._plain], dim=-1)


def pack_blocks(
    w: torch.Tensor, bias: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``w`` [N, K] as realhf's decode kernel reads it: blocks of 16 rows, k-major,
    ``[ceil(N / 16), K, 16]`` (the last block padded with zeros), and ``bias`` padded to
    ``ceil(N / 16) * 16``."""
    pad = -w.shape[0] % 16
    if pad:  # (a copy: only where the rows do not fill the last block)
        w = F.pad(w, (0, 0, 0, pad))
        bias = None if bias is None else F.pad(bias, (0, pad))
    blocks = w.reshape(-1, 16, w.shape[1]).transpose(1, 2).contiguous()
    return blocks, None if bias is None else bias.contiguous()


def _decode_kernels(w: torch.Tensor):
    """``realhf._C`` where its float32 decode kernel takes ``w``'s products, else None."""
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return None
    return simd_cpu()


def _rows_in_place(weights: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``cat(weights)`` as a view, where the matrices lie one after another in one buffer
    (a ReaLModel's q, k, v and gate, up lie so in its flat parameter buffer); else None."""
    w0 = weights[0]
    if len(weights) == 1:
        return w0
    end = w0.data_ptr()
    for w in weights:
        if not (
            w.is_contiguous()
            and w.dim() == 2
            and w.shape[1] == w0.shape[1]
            and w.dtype == w0.dtype
            and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
            and w.data_ptr() == end
        ):
            return None
        end += w.numel() * w.element_size()
    return w0.detach().as_strided((sum(w.shape[0] for w in weights), w0.shape[1]), (w0.shape[1], 1))


def packed_or_none(owner: nn.Module, attr: str, weights: List[torch.Tensor]):
    """The :class:`PackedLinear` stored as ``owner.<attr>`` if it matches ``weights`` and
    gradients are off, else None (the caller computes the plain product)."""
    pk = owner.__dict__.get(attr)
    if pk is None or torch.is_grad_enabled() or not pk.fresh(weights):
        return None
    return pk


class WeightPacker:
    """Packs the linear weights of a single-device ReaLModel for decoding, a few matrices
    at a time (:meth:`pack`), the LM head first (the largest product of a decode step).

    ``jobs``: per packed product, the module that holds it, the attribute name, and a
    function returning its weights and biases now (read at packing time, so a model whose
    buffer was replaced packs its new weights)."""

    def __init__(self, model, batch_hint: int):
        self.batch_hint = max(1, int(batch_hint))
        self.jobs: List[tuple] = []
        if model.has_head and not model.config.is_critic:
            head = model.head
            if model.config.shares_head_with_embedding and not model.head_copies_embedding:
                emb = model.embedding
                self._add(head, "packed", lambda e=emb: ([e.wte.weight], None))
            else:
                self._add(head, "packed", lambda h=head: ([h.weight], None))
        for b in model.blocks:
            ca, m = b.attn.c_attn, b.mlp
            mods = [ca.q_attn, ca.k_attn, ca.v_attn]
            self._add(ca, "packed_qkv", _getter(mods))
            self._add(b.attn.c_proj, "packed", _getter([b.attn.c_proj]))
            if b.config.gated_mlp:
                self._add(m, "packed_gate_up", _getter([m.gate_proj, m.up_proj]))
                self._add(m.down_proj, "packed", _getter([m.down_proj]))
            else:
                self._add(m.c_fc, "packed", _getter([m.c_fc]))
                self._add(m.c_proj, "packed", _getter([m.c_proj]))
        self.next = 0

    def _add(self, owner: nn.Module, attr: str, get: Callable) -> None:
        self.jobs.append((owner, attr, get))

    @property
    def done(self) -> bool:
        """Whether every product has been packed since the last :meth:`reset`."""
        return self.next >= len(self.jobs)

    def reset(self) -> None:
        """Drop every pack (before the weights change: their memory goes first) and start
        over."""
        for owner, attr, _ in self.jobs:
            owner.__dict__.pop(attr, None)
        self.next = 0

    def pack(self, budget_s: float = 0.0) -> None:
        """Pack the next product, then more while ``budget_s`` seconds have not passed."""
        t0 = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():
            while not self.done:
                owner, attr, get = self.jobs[self.next]
                weights, biases = get()
                owner.__dict__[attr] = PackedLinear(weights, biases, self.batch_hint)
                self.next += 1
                if time.perf_counter() - t0 >= budget_s:
                    break


def _getter(mods: List[nn.Module]) -> Callable:
    def get():
        return [m.weight for m in mods], [getattr(m, "bias", None) for m in mods]

    return get
