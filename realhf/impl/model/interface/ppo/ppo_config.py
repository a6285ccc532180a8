"""`PPOHyperparameters`: every option of the PPO / GRPO / decoupled-PPO interfaces.

Defaults follow the original system's PPO defaults (``ppo_n_minibatches=4``,
``eps_clip=0.2``, ``kl_ctl=0.1``, ``adv_norm``, ``value_norm``, ...). Typical variants:

- GRPO-style math RL: ``group_size=G, group_adv_norm=True, disable_value=True, kl_ctl=0``
  (token-level group normalisation), or ``adv_estimator=grpo`` (per answer, as the paper);
  other estimators (Dr. GRPO, RLOO, REINFORCE++) and loss shapes (clip-higher, GSPO, TIS,
  KL and entropy terms, loss aggregation) are options below (README, "Algorithms");
- async PPO (decoupled loss): ``recompute_logprob=True, use_decoupled_loss=True``
  (the trainer's recomputed ``proximal_logprobs`` anchor the clip, the behaviour
  ``packed_logprobs`` from the generation servers weight the loss).

Unknown keys are errors naming the closest field (:meth:`PPOHyperparameters.from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import field
from typing import Any, Dict, Optional, Union

from realhf.api.core.model_api import GenerationHyperparameters, RolloutContext
from realhf.impl.algorithms.advantages import ESTIMATORS, AdvEstimator, Estimator
from realhf.impl.algorithms.policy_loss import (
    AGGREGATIONS,
    BehavWeightMode,
    ImportanceLevel,
    KLEstimator,
    LossAggMode,
    LossShape,
)

__all__ = ["PPOHyperparameters"]


def _h(text: str) -> Dict[str, str]:
    return {"help": text}


# Generated from the registries, so that a new estimator or aggregation documents itself.
_ADV_ESTIMATOR_HELP = (
    "one of: "
    + "; ".join(f"'{e.name}': {e.summary}" for e in ESTIMATORS.values())
    + ". Outcome estimators ("
    + ", ".join(e.name for e in ESTIMATORS.values() if e.outcome)
    + ") need disable_value=true and give every token of an answer the same advantage from "
    "the answers' scores r_i; "
    + ", ".join(e.name for e in ESTIMATORS.values() if e.min_group_size > 1)
    + " compare the answers of a group (group_size >= 2); "
    + ", ".join(e.name for e in ESTIMATORS.values() if not e.kl_in_reward)
    + " use the scores only and need kl_ctl=0 (put the KL in the loss: kl_loss_coef)"
)
_LOSS_AGG_HELP = (
    "how token losses make the batch loss: "
    + "; ".join(f"'{a.mode}' ({a.summary})" for a in AGGREGATIONS.values())
    + "; answers count when they have a valid token; exact over micro-batches and "
    "data-parallel ranks"
)


@dataclasses.dataclass
class PPOHyperparameters:
    """PPO options; each field's ``help`` metadata documents it (shown by ``--help``)."""

    # ---- optimisation loop
    ppo_n_minibatches: int = field(
        default=4,
        metadata=_h(
            "optimizer steps per train_step: the (shuffled) sequences are split round-robin into "
            "this many minibatches"
        ),
    )
    sample_reuse: int = field(
        default=1, metadata=_h("passes over the batch per train_step (each reshuffled)")
    )
    # ---- actor loss
    eps_clip: float = field(
        default=0.2,
        metadata=_h("PPO ratio clip: ratio is clipped to [1-eps_clip, 1+eps_clip_high]"),
    )
    eps_clip_high: Optional[float] = field(
        default=None,
        metadata=_h(
            "upper ratio clip (DAPO's clip-higher, e.g. 0.28 with eps_clip=0.2): ratio <= "
            "1+eps_clip_high; None = eps_clip"
        ),
    )
    importance_level: str = field(
        default=ImportanceLevel.TOKEN,
        metadata=_h(
            "'token': one ratio pi/pi_old per token (PPO); 'sequence' (GSPO): one ratio per "
            "answer, s_i = exp(mean over its valid tokens of log(pi/pi_old)), clipped per answer, "
            "loss -min(s_i A_i, clip(s_i) A_i) with A_i the mean advantage of its tokens (= the "
            "answer's advantage for outcome estimators); use small clips, e.g. eps_clip=3e-4, "
            "eps_clip_high=4e-4, and loss_agg_mode=seq-mean-token-mean"
        ),
    )
    loss_agg_mode: str = field(default=LossAggMode.TOKEN_MEAN, metadata=_h(_LOSS_AGG_HELP))
    loss_agg_constant: Optional[float] = field(
        default=None,
        metadata=_h(
            "the constant of loss_agg_mode='constant' (a length in tokens); None = "
            "gen.max_new_tokens"
        ),
    )
    entropy_coef: float = field(
        default=0.0,
        metadata=_h(
            "entropy bonus c: loss -= c * entropy of the policy (softmax at the log-prob "
            "temperature) on answer tokens, aggregated like the loss; logged as "
            "ppo_actor/entropy when > 0"
        ),
    )
    kl_loss_coef: float = field(
        default=0.0,
        metadata=_h(
            "KL to the reference model as a loss term: loss += coef * k(pi, pi_ref), aggregated "
            "like the loss (GRPO's way; kl_ctl puts it in the reward instead); > 0 runs the "
            "reference model; logged as ppo_actor/kl_loss"
        ),
    )
    kl_estimator: str = field(
        default=KLEstimator.K3,
        metadata=_h(
            "estimator of the kl_loss_coef term, with d = log pi_ref - log pi: 'k1' = -d, "
            "'k2' = d^2/2, 'k3' = exp(d) - d - 1"
        ),
    )
    c_clip: Optional[float] = field(
        default=None,
        metadata=_h(
            "dual clip (> 1): for negative advantages the loss is at most c_clip*|A|; None disables"
        ),
    )
    early_stop_imp_ratio: Optional[float] = field(
        default=5.0,
        metadata=_h(
            "a micro-batch whose data-parallel mean importance ratio exceeds this contributes no "
            "gradient; None disables"
        ),
    )
    use_decoupled_loss: bool = field(
        default=False,
        metadata=_h(
            "decoupled PPO: clip around proximal_logprobs, weight by exp(prox - behaviour); with "
            "one optimizer step per batch and recompute_logprob=false the proximal log-probs come "
            "from the train forward itself"
        ),
    )
    behav_imp_weight_cap: Optional[float] = field(
        default=None,
        metadata=_h(
            "decoupled loss only: cap C of the behaviour weight w = exp(prox - behaviour); see "
            "behav_imp_weight_mode"
        ),
    )
    behav_imp_weight_mode: str = field(
        default=BehavWeightMode.MASK,
        metadata=_h(
            "decoupled loss: 'mask' drops tokens with w > behav_imp_weight_cap (or w < "
            "behav_imp_weight_floor); 'truncate' keeps them with w = min(w, cap) (truncated "
            "importance sampling, TIS; needs a cap; logged as ppo_actor/behave_truncated_ratio)"
        ),
    )
    behav_imp_weight_floor: Optional[float] = field(
        default=None,
        metadata=_h(
            "decoupled loss, mode 'mask': tokens with w below it (in (0, 1)) are dropped too, so "
            "w must lie in [floor, cap]; None: no floor"
        ),
    )
    recompute_logprob: bool = field(
        default=False,
        metadata=_h(
            "the trainer recomputes log-probs before training (actor inference -> "
            "proximal_logprobs); without the decoupled loss they replace the behaviour log-probs "
            "as the PPO anchor"
        ),
    )
    temperature: Optional[float] = field(
        default=None,
        metadata=_h(
            "logits are divided by it when (re)computing log-probs; None: gen.temperature (1 for "
            "greedy)"
        ),
    )
    # ---- rewards
    max_reward_clip: float = field(
        default=20.0, metadata=_h("task scores are clipped to [-clip, clip]")
    )
    reward_output_scaling: float = field(
        default=1.0,
        metadata=_h(
            "score = (verdict - bias) * scaling, applied once where the verdict is made (the "
            "math_reward interface, or the rollout agent in async runs)"
        ),
    )
    reward_output_bias: float = field(
        default=0.0, metadata=_h("score = (verdict - bias) * scaling (see reward_output_scaling)")
    )
    mask_no_eos_with_zero: bool = field(
        default=False, metadata=_h("sequences cut before EOS get score 0 instead of their reward")
    )
    mask_too_long: bool = field(
        default=False,
        metadata=_h(
            "answers cut before EOS (truncated at gen.max_new_tokens, seq_no_eos_mask) are left "
            "out of the loss entirely (DAPO's overlong filtering); their scores still count in "
            "their group's statistics"
        ),
    )
    overlong_penalty_len: int = field(
        default=0,
        metadata=_h(
            "DAPO's soft overlong penalty zone L_c in tokens (0 = off): an answer of |o| "
            "generated tokens gets score += min(0, -(|o| - (L_max - L_c)) / L_c) * "
            "overlong_penalty_factor, L_max = gen.max_new_tokens"
        ),
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata=_h(
            "the overlong penalty at |o| = L_max (in score units: after reward_output_scaling)"
        ),
    )
    kl_ctl: float = field(
        default=0.1,
        metadata=_h(
            "KL penalty coefficient beta: r_t = -beta (logp - ref_logp); 0 needs no reference model"
        ),
    )
    adaptive_kl_ctl: bool = field(
        default=False, metadata=_h("adapt beta towards adaptive_kl_target")
    )
    adaptive_kl_target: float = field(
        default=6.0, metadata=_h("target KL of the adaptive controller")
    )
    adaptive_kl_horizon: float = field(
        default=10000.0, metadata=_h("horizon (in sequences) of the adaptive controller")
    )
    success_rate_lb: float = field(
        default=0.0,
        metadata=_h(
            "prompts whose answers' success rate (share with score > 0) is below it are left out "
            "of the loss"
        ),
    )
    success_rate_ub: float = field(
        default=1.0,
        metadata=_h(
            "prompts whose answers' success rate is above it are left out of the loss (e.g. 0.99: "
            "drop all-solved)"
        ),
    )
    # ---- advantages
    adv_estimator: str = field(default=AdvEstimator.GAE, metadata=_h(_ADV_ESTIMATOR_HELP))
    discount: float = field(
        default=1.0, metadata=_h("discount gamma of GAE and of REINFORCE++'s reward-to-go")
    )
    gae_lambda: float = field(default=1.0, metadata=_h("GAE lambda"))
    adv_norm: bool = field(
        default=True,
        metadata=_h(
            "adv_estimator=gae: normalise advantages to zero mean / unit std over valid tokens "
            "(global over data-parallel ranks); outcome estimators normalise as their formula "
            "says and ignore it"
        ),
    )
    group_adv_norm: bool = field(
        default=False,
        metadata=_h(
            "adv_estimator=gae, with adv_norm: normalise per group of group_size answers to one "
            "prompt, over their tokens, locally"
        ),
    )
    group_size: int = field(
        default=1, metadata=_h("answers generated per prompt (one item carries its group)")
    )
    # ---- critic
    disable_value: bool = field(
        default=False, metadata=_h("no critic: values are 0 (use with group_adv_norm)")
    )
    value_eps_clip: float = field(
        default=0.2, metadata=_h("critic value clip around the old values")
    )
    value_norm: bool = field(default=True, metadata=_h("the critic learns EMA-normalised returns"))
    value_norm_beta: float = field(
        default=0.99995, metadata=_h("EMA decay of the value normaliser")
    )
    # ---- generation
    gen: GenerationHyperparameters = field(
        default_factory=GenerationHyperparameters,
        metadata=_h(
            "sampling settings of the actor's generate call; gen.n is taken from group_size"
        ),
    )
    gen_max_running_requests: int = field(
        default=256,
        metadata=_h(
            "sequences the built-in engine decodes together during the actor's generate call "
            "(a batch of 32 prompts x 8 answers is 256: one wave; each slot holds the longest "
            "prompt + answer of the call)"
        ),
    )
    gen_timeout_s: float = field(
        default=3600.0, metadata=_h("most seconds one generate call may take")
    )
    seed: int = field(
        default=1,
        metadata=_h(
            "base seed of sampling and minibatch shuffling (combined with the global step and item "
            "ids)"
        ),
    )

    def __post_init__(self):
        if isinstance(self.gen, dict):
            self.gen = GenerationHyperparameters(**self.gen)
        if not isinstance(self.gen, GenerationHyperparameters):
            self._bad("gen", "use a GenerationHyperparameters or a dict of its fields")
        for name in ("ppo_n_minibatches", "sample_reuse", "group_size", "gen_max_running_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                self._bad(name, "use an integer >= 1")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            self._bad("seed", "use an integer")
        positive = [
            "eps_clip",
            "value_eps_clip",
            "max_reward_clip",
            "adaptive_kl_target",
            "adaptive_kl_horizon",
            "gen_timeout_s",
        ]
        for name in positive:
            if not self._finite(name) or getattr(self, name) <= 0:
                self._bad(name, "use a finite number > 0")
        for name in ("reward_output_scaling", "reward_output_bias"):
            if not self._finite(name):
                self._bad(name, "use a finite number")
        if not self._finite("kl_ctl") or self.kl_ctl < 0:
            self._bad("kl_ctl", "use a number >= 0 (0 disables the KL penalty)")
        for name in ("discount", "gae_lambda"):
            if not self._finite(name) or not 0 <= getattr(self, name) <= 1:
                self._bad(name, "use a number in [0, 1]")
        if not (self._finite("value_norm_beta") and 0 < self.value_norm_beta < 1):
            self._bad("value_norm_beta", "use a number in (0, 1), e.g. 0.99995")
        if self.c_clip is not None and not (self._finite("c_clip") and self.c_clip > 1):
            self._bad("c_clip", "use a number > 1 or None")
        for name in ("early_stop_imp_ratio", "behav_imp_weight_cap"):
            v = getattr(self, name)
            if v is not None and not (self._finite(name) and v > 1):
                self._bad(name, "use a number > 1 or None")
        if self.behav_imp_weight_cap is not None and not self.use_decoupled_loss:
            self._bad(
                "behav_imp_weight_cap",
                "it only acts with use_decoupled_loss=True; set that or use None",
            )
        if self.temperature is not None and not (
            self._finite("temperature") and self.temperature > 0
        ):
            self._bad("temperature", "use a number > 0 or None (None: gen.temperature)")
        for name in ("success_rate_lb", "success_rate_ub"):
            if not self._finite(name) or not 0 <= getattr(self, name) <= 1:
                self._bad(name, "use a number in [0, 1]")
        if self.success_rate_lb > self.success_rate_ub:
            self._bad("success_rate_lb", f"must not exceed success_rate_ub={self.success_rate_ub}")
        if self.group_adv_norm and not self.adv_norm:
            self._bad(
                "group_adv_norm", "needs adv_norm=True (it selects how advantages are normalised)"
            )
        self._check_algorithm_options()
        if self.gen.n not in (1, self.group_size):
            self._bad(
                "gen",
                f"gen.n={self.gen.n} differs from group_size={self.group_size}; set group_size "
                "only",
            )

    # One check per option, in the order of the fields; long but flat.
    def _check_algorithm_options(self):
        # Each choice is looked up once: from here on it is its enum member (still a str, so
        # YAML, the command line and the saved config see the same string).
        for name, choice in (
            ("adv_estimator", AdvEstimator),
            ("importance_level", ImportanceLevel),
            ("loss_agg_mode", LossAggMode),
            ("behav_imp_weight_mode", BehavWeightMode),
            ("kl_estimator", KLEstimator),
        ):
            if getattr(self, name) not in choice.values():
                self._bad(name, f"use one of {choice.values()}")
            setattr(self, name, choice(getattr(self, name)))
        est = self.estimator
        if est.outcome and not self.disable_value:
            self._bad(
                "adv_estimator",
                "outcome estimators use no critic; set disable_value=true (or use "
                "adv_estimator=gae)",
            )
        if self.group_size < est.min_group_size:
            self._bad(
                "adv_estimator",
                f"it compares the answers of a group; set group_size >= {est.min_group_size} "
                f"(got {self.group_size})",
            )
        if not est.kl_in_reward and self.kl_ctl > 0:
            in_reward = [e.name.value for e in ESTIMATORS.values() if e.outcome and e.kl_in_reward]
            self._bad(
                "adv_estimator",
                f"it uses the answers' scores only, so kl_ctl={self.kl_ctl} (KL in the reward) "
                "would be ignored; set kl_ctl=0 and use kl_loss_coef for a KL loss term, or "
                f"adv_estimator in {in_reward} for KL in the reward",
            )
        if self.eps_clip_high is not None and not (
            self._finite("eps_clip_high") and self.eps_clip_high > 0
        ):
            self._bad("eps_clip_high", "use a number > 0 or None (None: eps_clip)")
        if self.loss_agg_constant is not None:
            if not (self._finite("loss_agg_constant") and self.loss_agg_constant > 0):
                self._bad("loss_agg_constant", "use a number > 0 or None (gen.max_new_tokens)")
            if not AGGREGATIONS[self.loss_agg_mode].scaled:
                self._bad(
                    "loss_agg_constant", "it only acts with loss_agg_mode='constant'; use None"
                )
        for name in ("entropy_coef", "kl_loss_coef", "overlong_penalty_factor"):
            if not self._finite(name) or getattr(self, name) < 0:
                self._bad(name, "use a finite number >= 0 (0 disables it)")
        truncate = self.behav_imp_weight_mode is BehavWeightMode.TRUNCATE
        if truncate and self.behav_imp_weight_cap is None:
            self._bad("behav_imp_weight_mode", "'truncate' needs behav_imp_weight_cap (the C)")
        if self.behav_imp_weight_floor is not None:
            if not (self._finite("behav_imp_weight_floor") and 0 < self.behav_imp_weight_floor < 1):
                self._bad("behav_imp_weight_floor", "use a number in (0, 1) or None")
            if not self.use_decoupled_loss or truncate:
                self._bad(
                    "behav_imp_weight_floor",
                    "it only acts with use_decoupled_loss=True and behav_imp_weight_mode='mask'",
                )
        n = self.overlong_penalty_len
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= self.gen.max_new_tokens:
            self._bad(
                "overlong_penalty_len",
                f"use an integer in [0, gen.max_new_tokens={self.gen.max_new_tokens}] (0 = off)",
            )

    def _finite(self, name: str) -> bool:
        v = getattr(self, name)
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    @property
    def one_step_per_batch(self) -> bool:
        """Whether each train step makes exactly one optimizer step (one minibatch, no reuse)."""
        return self.ppo_n_minibatches == 1 and self.sample_reuse == 1

    @property
    def proximal_from_train_forward(self) -> bool:
        """Decoupled loss whose proximal policy is the one the train step runs.

        The proximal policy is the actor just before the update.  With one optimizer step per
        batch that is exactly the policy of the train forward pass (every micro-batch is
        computed before the single step), so its detached log-probs are the proximal
        log-probs and a separate ``actor_inf`` pass would recompute the same numbers.
        """
        return self.use_decoupled_loss and not self.recompute_logprob and self.one_step_per_batch

    @property
    def needs_proximal_recompute(self) -> bool:
        """Whether the dataflow needs ``actor_inf`` to produce ``proximal_logprobs``."""
        return self.recompute_logprob or (self.use_decoupled_loss and not self.one_step_per_batch)

    def _bad(self, name: str, fix: str):
        raise ValueError(f"PPOHyperparameters.{name}={getattr(self, name)!r}: {fix}")

    # ---- derived values
    @property
    def estimator(self) -> Estimator:
        """The registered advantage estimator ``adv_estimator`` names."""
        return ESTIMATORS[self.adv_estimator]

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are computed at (matches the sampler's)."""
        if self.temperature is not None:
            return float(self.temperature)
        return 1.0 if self.gen.is_greedy else float(self.gen.temperature)

    @property
    def rollout(self) -> RolloutContext:
        """What these options tell every interface of the run: ``group_size`` and
        :attr:`logprob_temperature`."""
        return RolloutContext(self.group_size, self.logprob_temperature)

    @property
    def needs_ref(self) -> bool:
        """Whether training needs the reference model's log-probs (a KL in the reward or in
        the loss)."""
        return self.kl_ctl > 0 or self.kl_loss_coef > 0

    @property
    def loss_agg_denominator(self) -> float:
        """The constant of ``loss_agg_mode='constant'`` (``gen.max_new_tokens`` by default)."""
        if self.loss_agg_constant is not None:
            return float(self.loss_agg_constant)
        return float(self.gen.max_new_tokens)

    @property
    def loss_shape(self) -> LossShape:
        """The policy-loss options as the loss function takes them."""
        return LossShape(
            eps_clip_high=self.eps_clip_high,
            importance_level=self.importance_level,
            loss_agg_mode=self.loss_agg_mode,
            loss_agg_constant=self.loss_agg_denominator,
            behav_imp_weight_mode=self.behav_imp_weight_mode,
            behav_imp_weight_floor=self.behav_imp_weight_floor,
            kl_loss_coef=self.kl_loss_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
        )

    @property
    def filters_by_success_rate(self) -> bool:
        """Whether success-rate filtering is on."""
        return self.success_rate_lb > 0.0 or self.success_rate_ub < 1.0

    @property
    def generation(self) -> GenerationHyperparameters:
        """``gen`` with ``n = group_size``."""
        return self.gen.new(n=self.group_size)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "PPOHyperparameters":
        """Build from a plain dict; unknown keys raise naming the closest field."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown PPO option {key!r}{hint}; options: {names}")
        return cls(**d)

    @classmethod
    def coerce(
        cls,
        hparams: Union["PPOHyperparameters", Dict[str, Any], None],
        fields: Dict[str, Any],
        rollout: Optional[RolloutContext] = None,
        who: str = "PPO",
    ) -> "PPOHyperparameters":
        """What an interface constructor accepts: a ``PPOHyperparameters``, a dict, or fields
        as keyword arguments (not both), and the run's ``rollout``.  Options given as a dict
        or fields take ``group_size`` from ``rollout`` when they omit it; then they must
        agree with ``rollout`` (group size and log-prob temperature), or ``who`` fails
        naming both values."""
        if hparams is not None and fields:
            raise ValueError(
                "pass PPO options either as hparams or as keyword arguments, not both (got "
                f"{sorted(fields)})"
            )
        if hparams is not None and not isinstance(hparams, (cls, dict)):
            raise TypeError(
                f"hparams must be a PPOHyperparameters or a dict, got {type(hparams).__name__}"
            )
        if isinstance(hparams, cls):
            hp = hparams
        else:
            d = dict(fields if hparams is None else hparams)
            if rollout is not None:
                d.setdefault("group_size", rollout.group_size)
            hp = cls.from_dict(d)
        if rollout is not None:
            rollout.require(
                who,
                "give it the run's ppo.* options, from which the experiment builds the "
                "RolloutContext (options passed as keywords may leave group_size out: it then "
                "comes from rollout)",
                group_size=hp.group_size,
                temperature=hp.logprob_temperature,
            )
        return hp
