"""``algo=NAME``: the ``ppo.*`` options of each known algorithm, as typed objects.

A preset is merged above the task's defaults and below the YAML file and the command line
(:mod:`realhf.api.cli_parser`), so ``algo=dapo ppo.eps_clip_high=0.3`` changes one option
of it. Presets keep the run's group size, batch, learning rate and answer budget, which
the embedded task tunes. Every preset is checked by ``tests/experiments/
test_algo_presets.py``: its keys are options of ``ppo-math`` and ``async-ppo-math`` and
the config they make passes validation.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Dict, List, Mapping

from realhf.impl.algorithms.advantages import AdvEstimator
from realhf.impl.algorithms.choices import Choice
from realhf.impl.algorithms.policy_loss import ImportanceLevel, LossAggMode
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters

__all__ = ["AlgoPreset", "ALGO_PRESETS", "algo_preset"]

_PPO_FIELDS = frozenset(f.name for f in dataclasses.fields(PPOHyperparameters))
#: the experiment-level (not ``ppo.*``) options a preset may set
_EXPERIMENT_FIELDS = frozenset({"dynamic_sampling"})


@dataclasses.dataclass(frozen=True)
class AlgoPreset:
    """One ``algo=`` preset.

    Attributes:
        name: its ``algo=`` value ("" is no preset).
        description: what it is, one line.
        ppo: ``PPOHyperparameters`` field -> value (choices as their enum member).
        experiment: top-level experiment option -> value (``dynamic_sampling``).
    """

    name: str
    description: str
    ppo: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    experiment: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for where, given, known in (
            ("ppo", self.ppo, _PPO_FIELDS),
            ("experiment", self.experiment, _EXPERIMENT_FIELDS),
        ):
            unknown = sorted(set(given) - known)
            if unknown:
                raise ValueError(f"algo preset {self.name!r}: unknown {where} options {unknown}")
            object.__setattr__(self, where, MappingProxyType(dict(given)))

    def overrides(self) -> List[str]:
        """The preset as ``key=value`` overrides, in the order they were declared."""
        items = [(f"ppo.{k}", v) for k, v in self.ppo.items()] + list(self.experiment.items())
        return [f"{key}={_dotlist_value(v)}" for key, v in items]


def _dotlist_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Choice):
        return v.value
    if isinstance(v, (int, float)):
        return repr(v)
    raise TypeError(f"a preset value must be a bool, a number or a choice, got {v!r}")


_NO_CRITIC: Dict[str, Any] = {"disable_value": True, "kl_ctl": 0.0}

#: every ``algo=`` preset, by name (README, "Algorithms"). DAPO's overlong zone (4 of the
#: tiny task's 16 answer tokens; its correct answers take ~6) and penalty (5 = the ±5
#: score scale) fit the tiny task; scale them with the budget.
ALGO_PRESETS: Dict[str, AlgoPreset] = {
    p.name: p
    for p in (
        AlgoPreset("", "no preset: the task's defaults"),
        AlgoPreset(
            "grpo",
            "GRPO: group-normalised outcome advantages, per-answer token means",
            ppo={
                "adv_estimator": AdvEstimator.GRPO,
                **_NO_CRITIC,
                "loss_agg_mode": LossAggMode.SEQ_MEAN_TOKEN_MEAN,
            },
        ),
        AlgoPreset(
            "drgrpo",
            "Dr. GRPO: unnormalised group advantages, a constant loss denominator",
            ppo={
                "adv_estimator": AdvEstimator.DRGRPO,
                **_NO_CRITIC,
                "loss_agg_mode": LossAggMode.CONSTANT,
            },
        ),
        AlgoPreset(
            "dapo",
            "DAPO: clip-higher, token-mean loss, overlong penalty, dynamic sampling",
            ppo={
                "adv_estimator": AdvEstimator.GRPO,
                **_NO_CRITIC,
                "eps_clip": 0.2,
                "eps_clip_high": 0.28,
                "loss_agg_mode": LossAggMode.TOKEN_MEAN,
                "overlong_penalty_len": 4,
                "overlong_penalty_factor": 5.0,
                # dynamic sampling: keep the groups with 0 < accuracy < 1, generate more
                "success_rate_lb": 0.001,
                "success_rate_ub": 0.999,
            },
            experiment={"dynamic_sampling": True},
        ),
        AlgoPreset(
            "gspo",
            "GSPO: one clipped importance ratio per answer",
            ppo={
                "adv_estimator": AdvEstimator.GRPO,
                **_NO_CRITIC,
                "importance_level": ImportanceLevel.SEQUENCE,
                "loss_agg_mode": LossAggMode.SEQ_MEAN_TOKEN_MEAN,
                "eps_clip": 3e-4,
                "eps_clip_high": 4e-4,
            },
        ),
        AlgoPreset(
            "rloo",
            "RLOO: leave-one-out group baseline",
            ppo={"adv_estimator": AdvEstimator.RLOO, **_NO_CRITIC},
        ),
        AlgoPreset(
            "reinforce++",
            "REINFORCE++: batch-normalised reward-to-go",
            ppo={"adv_estimator": AdvEstimator.REINFORCE_PP, **_NO_CRITIC},
        ),
        AlgoPreset(
            "reinforce++-baseline",
            "REINFORCE++ with the group mean as baseline",
            ppo={"adv_estimator": AdvEstimator.REINFORCE_PP_BASELINE, **_NO_CRITIC},
        ),
    )
}


def algo_preset(name: str) -> AlgoPreset:
    """The preset called ``name``; a ValueError listing the valid ones otherwise."""
    if name not in ALGO_PRESETS:
        valid = sorted(a for a in ALGO_PRESETS if a)
        raise ValueError(f"algo={name!r}: use one of {valid}, or empty for no preset")
    return ALGO_PRESETS[name]
