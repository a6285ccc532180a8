"""Model backends: how a ReaLModel is run (``InferenceEngine``) or trained (``TrainEngine``).

Registered as backends ``"inference"`` and ``"train"``; a model worker builds one with
``make_backend(BackendAbstraction("train", {"optimizer": OptimizerConfig(...)}),
model=real_model, ft_spec=ft_spec, dp_group=group)`` and puts it in ``Model.module``.
"""

from realhf.api.core.registry import register_backend
from realhf.impl.model.backend.inference import InferenceEngine
from realhf.impl.model.backend.lr_schedule import LRSchedule
from realhf.impl.model.backend.train import TrainEngine

register_backend("inference", InferenceEngine)
register_backend("train", TrainEngine)

__all__ = ["InferenceEngine", "TrainEngine", "LRSchedule"]
