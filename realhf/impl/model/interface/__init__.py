"""Algorithm interfaces (``ModelInterface`` subclasses), registered by name on import:

==============  ===============================================  =============================
name            class                                            methods
==============  ===============================================  =============================
``sft``         :class:`~.sft_interface.SFTInterface`            train_step, evaluate
``ppo_actor``   :class:`~.ppo.ppo_interface.PPOActorInterface`   generate, inference, train_step
``ppo_critic``  :class:`~.ppo.critic_interface.PPOCriticInterface` inference, train_step
``math_reward`` :class:`~.math_reward_interface.MathRewardInterface` (alias ``rw-math``)  inference
``math_eval``   :class:`~.math_eval_interface.MathEvalInterface`  evaluate
``rw``          :class:`~.rw_interface.RewardModelInterface`     train_step, evaluate, inference
``dpo``         :class:`~.dpo_interface.DPOInterface`            train_step, inference
==============  ===============================================  =============================

The reference model uses ``ppo_actor``'s ``inference``. Contract with the model worker: each
method gets a :class:`~realhf.api.core.model_api.Model` whose ``module`` is a backend engine
(:mod:`realhf.impl.model.backend`: ``TrainEngine`` for trained roles, ``InferenceEngine``
otherwise) wrapping a ReaLModel; ``train_step`` advances ``model.version`` itself and returns
the process stats tracker's export reduced over the engine's data-parallel group.
:mod:`~realhf.impl.model.interface.toolkit` holds the public helpers for writing an
interface of your own (README, "Writing your own algorithm").
"""

from realhf.impl.model.interface.dpo_interface import DPOInterface
from realhf.impl.model.interface.math_eval_interface import MathEvalInterface
from realhf.impl.model.interface.math_reward_interface import MathRewardInterface
from realhf.impl.model.interface.ppo.critic_interface import PPOCriticInterface
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.ppo.ppo_interface import PPOActorInterface
from realhf.impl.model.interface.rw_interface import RewardModelInterface
from realhf.impl.model.interface.sft_interface import SFTInterface

__all__ = [
    "PPOActorInterface",
    "PPOCriticInterface",
    "PPOHyperparameters",
    "SFTInterface",
    "MathRewardInterface",
    "MathEvalInterface",
    "RewardModelInterface",
    "DPOInterface",
]
