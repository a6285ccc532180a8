"""A rank's part of a ReaLModel in a parallel layout: checks and loading."""

from __future__ import annotations

import os
from typing import Union

import torch

from realhf.api.core.allocation import ParallelismConfig
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.impl.model.parallelism.grid import ParallelGrid
from realhf.impl.model.parallelism.tensor_parallel import TensorParallel, check_tensor_parallel

__all__ = ["check_layout", "load_model"]


def check_layout(config: ReaLModelConfig, layout: ParallelismConfig, what: str = "model") -> None:
    """Raise ValueError (naming the dimension and the fix) unless ``config`` can be split
    as ``layout`` says."""
    try:
        check_tensor_parallel(config, layout.tensor)
    except ValueError as e:
        raise ValueError(f"{what} in layout {layout}: {e}") from None
    if layout.pipe > config.n_layers:
        raise ValueError(
            f"{what} in layout {layout}: {layout.pipe} pipeline stages for "
            f"{config.n_layers} transformer layers; use p <= {config.n_layers}"
        )
    if layout.pipe > 1:
        raise NotImplementedError(
            f"{what} in layout {layout}: pipeline parallelism of ReaLModel is not wired yet"
        )


def load_model(
    path: Union[str, os.PathLike],
    grid: ParallelGrid,
    *,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    is_critic: bool = False,
    **kwargs,
) -> ReaLModel:
    """This rank's part of the HuggingFace checkpoint ``path`` in ``grid``'s layout.

    ``kwargs`` go to the ReaLModel constructor (``gradient_checkpointing``, ...).
    """
    from realhf.impl.model.conversion import hf

    config = hf.config_from_hf_dir(path, is_critic=is_critic)
    check_layout(config, grid.layout, f"model {str(path)!r}")
    tp = TensorParallel.from_grid(grid)
    return ReaLModel.from_hf(path, dtype=dtype, device=device, is_critic=is_critic, tp=tp, **kwargs)
