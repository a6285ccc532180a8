"""Parallel layouts of ReaLModel: the process grid, tensor and pipeline parallelism.

Entry point for model workers: build the :class:`~realhf.impl.model.parallelism.grid.ParallelGrid`
of the layout (every process of the world calls it), then :func:`load_model` (this rank's
part of a HuggingFace checkpoint), then the engines with ``grid=``.
"""

from realhf.impl.model.parallelism.grid import ParallelGrid
from realhf.impl.model.parallelism.model import check_layout, load_model

__all__ = ["ParallelGrid", "load_model", "check_layout"]
