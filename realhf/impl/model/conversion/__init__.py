"""HuggingFace checkpoint conversion for ReaLModel (llama, qwen2, qwen3, mistral, gpt2)."""

from realhf.impl.model.conversion.hf_config import CheckpointError, UnsupportedCheckpoint

__all__ = ["CheckpointError", "UnsupportedCheckpoint"]
