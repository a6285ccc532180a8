"""The built-in generation engine: continuous batching over ReaLModel with a slot KV cache.

Modules, one concept each: :mod:`.sequence` (one request's state),
:mod:`.kv_cache` (slot cache, and why slots rather than pages),
:mod:`.cache_attention` (decode/prefill attention against the cache),
:mod:`.sampler` (batched sampling), :mod:`.batch_scheduler` (waiting queue and
running set), :mod:`.engine` (the engine thread), :mod:`.engine_config`,
:mod:`.loading` (from a HuggingFace directory), :mod:`.http_app` and
:mod:`.openai_api` (the HTTP server; imported explicitly, they pull in FastAPI).
"""

from realhf.impl.model.gen.engine import EngineClosedError, GenerationEngine
from realhf.impl.model.gen.engine_config import EngineConfig

__all__ = ["EngineConfig", "GenerationEngine", "EngineClosedError"]
