"""ReaLModel: config, layers, flat parameter buffer and the model itself."""

from realhf.impl.model.nn.flat_param import ParamSpec, flat_intervals, layer_interval
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.nn.real_model import ReaLModel, packed_position_ids

__all__ = [
    "ReaLModel",
    "ReaLModelConfig",
    "ParamSpec",
    "flat_intervals",
    "layer_interval",
    "packed_position_ids",
]
