"""The seam through which tensor parallelism enters a single-device ReaLModel.

Model code never touches process groups.  Where a tensor-parallel model differs from the
single-device one, the layers call a hook of ``model.tp``; :class:`LocalHooks` (the
default) makes every hook the identity, and
:class:`realhf.impl.model.parallelism.tensor_parallel.TensorParallel` implements them with
collectives over the tensor-parallel group.  The places (Megatron-style):

- :meth:`~LocalHooks.copy_in` on the input of every column-parallel projection (q/k/v,
  MLP up/gate, LM head): identity forward, sum of the input gradients over ranks backward;
- :meth:`~LocalHooks.reduce_out` on the output of every row-parallel projection (attention
  output, MLP down) *before its bias*: sum over ranks forward, identity backward;
- :meth:`~LocalHooks.embed`: the vocabulary-parallel embedding lookup;
- :meth:`~LocalHooks.kv_weight`: key/value weights that several ranks hold copies of (when
  there are fewer key/value heads than ranks) get their gradients summed over the copies;
- :meth:`~LocalHooks.head_weight`: replicated weights applied to this rank's heads only
  (qwen3's per-head q/k norms) get their gradients summed over ranks;
- :meth:`~LocalHooks.token_log_probs`: log-softmax of vocabulary-sharded logits at given
  labels, without gathering the ``[T, vocab]`` logits or copying them to float32;
- :meth:`~LocalHooks.token_entropy`: entropy of the softmax of vocabulary-sharded logits,
  likewise.

The layers are built from :meth:`~LocalHooks.local_config`: the same architecture with this
rank's share of heads, MLP width and vocabulary, so their parameter declarations give the
local shard shapes and the flat buffer holds only the local shard.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from realhf.impl.model.modules import grad_in_place, vocab_chunked
from realhf.impl.model.nn.model_config import ReaLModelConfig

__all__ = ["LocalHooks", "LOCAL"]


class LocalHooks:
    """Single-device hooks: one rank holds everything; every hook is the identity."""

    size = 1
    rank = 0
    #: whether the model is split over processes (loading and saving are then collectives)
    distributed = False

    def local_config(self, config: ReaLModelConfig) -> ReaLModelConfig:
        """The architecture of this rank's layers."""
        return config

    def vocab_range(self, config: ReaLModelConfig) -> Tuple[int, int]:
        """``[start, end)`` of the vocabulary rows this rank holds."""
        return 0, config.vocab_size

    def copy_in(self, x: torch.Tensor) -> torch.Tensor:
        """Input of a column-parallel projection."""
        return x

    def reduce_out(self, x: torch.Tensor) -> torch.Tensor:
        """Partial output of a row-parallel projection (before its bias)."""
        return x

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Token embedding ``[T, hidden]`` of ``input_ids`` from this rank's rows ``weight``."""
        return grad_in_place.embed(input_ids, weight)

    def kv_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A key/value projection weight or bias, as used in forward."""
        return w

    def head_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A replicated weight applied per head to this rank's heads, as used in forward."""
        return w

    def token_log_probs(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        rows: Optional[torch.Tensor] = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """float32 ``[N]``: ``log_softmax(logits[rows] / temperature)[i, labels[i]]`` for
        ``logits [T, V_local]`` in the model's dtype (rows None: all of them), a block of
        rows at a time (:mod:`realhf.impl.model.modules.vocab_chunked`)."""
        return vocab_chunked.token_log_probs(logits, labels, rows=rows, temperature=temperature)

    def token_entropy(
        self, logits: torch.Tensor, rows: Optional[torch.Tensor] = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """float32 ``[N]``: entropy of ``softmax(logits[rows] / temperature)``, likewise."""
        return vocab_chunked.token_entropy(logits, rows=rows, temperature=temperature)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[N, V]`` from this rank's ``[N, V_local]`` (for
        sampling a few rows; training never needs it)."""
        return logits

    def shard_param(self, name: str, full: torch.Tensor, config: ReaLModelConfig) -> torch.Tensor:
        """This rank's shard of the whole parameter ``full`` named ``name``."""
        return full

    def gather_model(self, model):
        """The whole single-device model (a collective under tensor parallelism; None on
        ranks that do not receive it)."""
        return model

    def shard_model(self, full, device=None, **kwargs):
        """This rank's share of the whole model ``full`` (itself on a single device)."""
        return full if device is None else full.to(device)

    def run_stages(self, model, input_ids, cu_seqlens, **kwargs) -> torch.Tensor:
        """The whole model's output for a packed batch (pipeline stages pass hidden states
        along; on a single device this is just ``model(...)``)."""
        return model(input_ids, cu_seqlens, **kwargs)


#: the shared single-device hooks
LOCAL = LocalHooks()
