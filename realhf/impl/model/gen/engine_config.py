"""Configuration of the built-in generation engine."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from realhf.impl.model.gen.cache_attention import DECODE_IMPLS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fail(field: str, value, fix: str):
    raise ValueError(f"EngineConfig.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass
class EngineConfig:
    """Limits and numerics of :class:`~realhf.impl.model.gen.engine.GenerationEngine`.

    Attributes:
        max_running_requests: most sequences decoded together; more wait in the
            queue (also while the KV cache has no room for them).
        context_length: most tokens (prompt + generated) per sequence; ``None``
            uses the model's ``n_positions``.
        kv_cache_tokens: the KV cache's budget: token positions held at once
            over all running sequences (:mod:`~realhf.impl.model.gen.kv_cache`),
            each ``2 * n_layers * n_kv_heads * head_dim * dtype bytes``. A request
            reserves ``prompt + max_new_tokens`` positions when admitted (a
            group's shared prompt once), and one that needs more than the whole
            cache is refused. ``None``: ``max_running_requests * context_length``.
        max_prefill_tokens: prompt tokens admitted per engine step.
        max_queued_requests: waiting requests beyond this are refused.
        seed: seeds the engine's generator for requests without
            ``sampling_seed``.
        dtype: ``float32``, ``bfloat16`` or ``float16`` for weights and cache.
        device: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or
            ``cuda:N``.
        decode_attn_impl: ``auto`` (the first of these that can run), ``cpp`` (C++,
            CPUs with AVX2 or AVX-512, float32 or bfloat16), ``numba`` (CPU float32 or bfloat16)
            or ``padded`` (any device); see :mod:`realhf.impl.model.gen.cache_attention`.
        num_threads: CPU threads for the engine's torch ops (process-wide)
            and numba kernels (numba's set by the thread that runs the engine: its
            own, or the caller's in ``run_until_idle``); ``None``
            keeps the defaults (all cores). On a shared machine 1 is often
            faster: a multi-threaded op stalls when another process takes one
            of its cores.
        pack_weights: pre-pack the linear weights for oneDNN on a CPU (fp32, and bf16
            where it has bf16 kernels; :mod:`realhf.impl.model.nn.packed_linear`): 1.2-2.8x
            faster decode products, for one more copy of the weights in memory.
            Packed a few matrices per step after each weight update (and while idle),
            so an update itself costs nothing more.
        request_timeout_s: most seconds a caller waits for one request.
        control_timeout_s: most seconds a caller waits for the engine thread
            to carry out pause/continue/weight updates.
    """

    max_running_requests: int = 64
    context_length: Optional[int] = None
    kv_cache_tokens: Optional[int] = None
    max_prefill_tokens: int = 4096
    max_queued_requests: int = 100_000
    seed: int = 1
    dtype: str = "float32"
    device: str = "auto"
    decode_attn_impl: str = "auto"
    num_threads: Optional[int] = None
    pack_weights: bool = True
    request_timeout_s: float = 3600.0
    control_timeout_s: float = 300.0

    def __post_init__(self):
        for name in ("max_running_requests", "max_prefill_tokens", "max_queued_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(name, v, "use an integer >= 1")
        # >= 2: one prompt token and one generated token (the cache's smallest slot).
        if self.context_length is not None and (
            not isinstance(self.context_length, int) or self.context_length < 2
        ):
            _fail("context_length", self.context_length, "use an integer >= 2 or None")
        if self.kv_cache_tokens is not None and (
            not isinstance(self.kv_cache_tokens, int)
            or isinstance(self.kv_cache_tokens, bool)
            or self.kv_cache_tokens < 2
        ):
            _fail("kv_cache_tokens", self.kv_cache_tokens, "use an integer >= 2 or None")
        if self.dtype not in _DTYPES:
            _fail("dtype", self.dtype, f"use one of {sorted(_DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            _fail("device", self.device, "use auto, cpu, cuda or cuda:N")
        if self.decode_attn_impl not in DECODE_IMPLS:
            _fail("decode_attn_impl", self.decode_attn_impl, f"use one of {DECODE_IMPLS}")
        if self.num_threads is not None and (
            not isinstance(self.num_threads, int) or self.num_threads < 1
        ):
            _fail("num_threads", self.num_threads, "use an integer >= 1 or None")
        for name in ("request_timeout_s", "control_timeout_s"):
            if not getattr(self, name) > 0:
                _fail(name, getattr(self, name), "use a positive number of seconds")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        """The resolved device."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
