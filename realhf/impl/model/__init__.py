"""Models: ReaLModel (packed-sequence transformer with flat weights) and its
HuggingFace conversion; backends, interfaces and parallelism live in subpackages."""

from realhf.impl.model.conversion import CheckpointError, UnsupportedCheckpoint
from realhf.impl.model.nn import ReaLModel, ReaLModelConfig

__all__ = ["ReaLModel", "ReaLModelConfig", "CheckpointError", "UnsupportedCheckpoint"]
