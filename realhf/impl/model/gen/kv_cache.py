"""The KV cache of the generation engine: one preallocated slot per running sequence.

Design decision — per-sequence slots, not pages. Each running sequence owns a
*slot*: a contiguous ``[n_kv_heads, slot_len, head_dim]`` region per layer in
two tensors ``k, v: [n_layers, n_slots, n_kv_heads, slot_len, head_dim]``.

- Why not paged (vLLM/SGLang style)? A paged cache saves memory by allocating
  blocks on demand, but attention then has to follow a block table. Without a
  paged-attention kernel (none exists for CPU in torch) that means gathering
  every sequence's blocks into a contiguous buffer at every decode step, i.e.
  copying the whole live cache per layer per step — on the CPU this costs more
  than the attention itself. Slots let decode attention read the cache in
  place: a numba kernel indexes ``(slot, position)`` directly, and the padded
  SDPA path takes the strided view ``k[layer, :n, :, :L]`` without a copy.
- Memory is bounded by construction: ``n_slots * slot_len`` tokens
  (:attr:`SlotKVCache.nbytes`), where ``n_slots`` is the engine's
  ``max_running_requests`` and ``slot_len`` its context length; requests beyond
  ``n_slots`` wait in the queue.
- The tensors are zero-filled once at start. The padded decode path reads
  ``max(lens)`` positions of every slot in range and masks the invalid ones;
  a masked score gets weight 0, but ``0 * NaN`` is NaN, so never-written
  memory that happened to hold NaN/inf bit patterns would poison the output.
  (It did: the engine emitted token 0 after a few steps only when earlier
  tests in the same process had left NaNs in the freed memory the cache
  reused.) Zeros cost one memset of the cache and make every position that
  attention can touch finite: afterwards it only ever holds written keys/values.
- A finished sequence frees its slot at once; the next admitted request reuses
  it. Slots are handed out lowest-first so that the slot range touched by a
  decode step stays compact (the padded path's cost grows with it).
- There is no prefix cache: a resubmitted prompt is prefilled again, which for
  the short prompts of RL rollouts costs little next to decoding.
"""

from __future__ import annotations

import heapq
from typing import List

import torch


class SlotKVCache:
    """Preallocated per-slot key/value storage and a lowest-first slot allocator.

    Args:
        n_layers, n_kv_heads, head_dim: model geometry.
        n_slots: most sequences held at once.
        slot_len: most tokens (prompt + generated) per sequence.
        dtype, device: of the cache tensors.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_slots: int,
        slot_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # slot_len >= 2: a sequence holds at least one prompt token and one generated token.
        if n_slots < 1 or slot_len < 2:
            raise ValueError(
                f"SlotKVCache needs n_slots >= 1 and slot_len >= 2, got {n_slots} and {slot_len}"
            )
        shape = (n_layers, n_slots, n_kv_heads, slot_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.slot_len = slot_len
        # A min-heap: alloc() hands out the lowest free slot (see the module docstring).
        self._free: List[int] = list(range(n_slots))
        heapq.heapify(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the two cache tensors."""
        return self.k.numel() * self.k.element_size() * 2

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers."""
        return self.nbytes // (self.n_slots * self.slot_len)

    @property
    def n_free(self) -> int:
        """Number of unused slots."""
        return len(self._free)

    def alloc(self) -> int:
        """Take the lowest free slot; raises when none is free (callers check first)."""
        if not self._free:
            raise RuntimeError("SlotKVCache.alloc: no free slot; check n_free before admitting")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        """Return a slot; its contents become garbage."""
        if not 0 <= slot < self.n_slots or slot in self._free:
            raise RuntimeError(f"SlotKVCache.free: slot {slot} is not allocated")
        heapq.heappush(self._free, slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """Store ``k, v [T, n_kv_heads, head_dim]`` at ``(slots[t], positions[t])``."""
        # Two index tensors around a slice: numpy rules put the indexed dim first, so the
        # target is [T, n_kv_heads, head_dim], the layout of k and v.
        self.k[layer, slots, :, positions] = k.to(self.k.dtype)
        self.v[layer, slots, :, positions] = v.to(self.v.dtype)


def check_cache_fits(model_config, n_slots: int, slot_len: int, dtype: torch.dtype, device) -> None:
    """Refuse a cache that cannot fit: 90% of free GPU memory, or 80% of host RAM.

    On the CPU pages become resident only when written, but a long-running
    server eventually writes every slot. ``model_config`` needs ``n_layers``,
    ``n_kv_heads`` and ``head_dim``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    mc = model_config
    need = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * itemsize * n_slots * slot_len
    device = torch.device(device)
    # The margins leave room for what the cache does not count: activations and logits of
    # a step, and on the CPU, where the limit is total RAM, the weights and everything else.
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        limit, what = 0.9 * free, "90% of the free GPU memory"
    else:
        import psutil

        limit, what = 0.8 * psutil.virtual_memory().total, "80% of the host memory"
    if need > limit:
        raise ValueError(
            f"the KV cache needs {need / 2**30:.1f} GiB for max_running_requests={n_slots} x "
            f"context_length={slot_len}, more than {what} ({limit / 2**30:.1f} GiB); lower "
            "EngineConfig.max_running_requests or EngineConfig.context_length"
        )
