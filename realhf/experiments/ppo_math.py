"""Synchronous PPO / GRPO on math prompts with the verifier's reward.

    python -m realhf.apps.quickstart ppo-math                    # embedded tiny model + data
    python -m realhf.apps.quickstart ppo-math ppo.kl_ctl=0.05 ppo.disable_value=false
    python -m realhf.apps.quickstart ppo-math algo=dapo          # an algorithm preset

The dataflow graph (MFCs), pruned by the options:

    actor_gen ─┬─ rew_inf ────┐
               ├─ ref_inf ────┤   (kl_ctl > 0 or kl_loss_coef > 0)
               ├─ critic_inf ─┤   (unless disable_value)
               ├─ actor_inf ──┤   (proximal log-probs: recompute_logprob, or the
               │              │    decoupled loss with several optimizer steps per batch)
               └──────────────┴─ actor_train, critic_train

The defaults are GRPO for the embedded tiny task (no critic, no KL, group-normalised
advantages over ``group_size`` answers per prompt, one optimizer step per batch), the
setting ../shared/reference/tiny_task_notes.md found to learn on 2 CPU cores.
The reward MFC runs on the actor's model role: it only needs the tokenizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional, Tuple

from realhf.api.cli_args import (
    BaseExperimentConfig,
    ExperimentControlConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)
from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec, GenerationHyperparameters
from realhf.api.core.registry import DatasetAbstraction, InterfaceAbstraction
from realhf.api.core.system_api import ExperimentConfig
from realhf.api.core.worker_api import EvalSpec
from realhf.experiments import building_blocks as blocks
from realhf.experiments.actor_interfaces import ActorConfig
from realhf.experiments.algo_presets import ALGO_PRESETS, algo_preset
from realhf.experiments.registry import register_quickstart_exp
from realhf.impl.dataset.bad_rows import DEFAULT_MAX_FRACTION
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.math_dataset import MathPromptDataset
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters

GEN_KEYS = (
    "packed_input_ids",
    "prompt_mask",
    "packed_logprobs",
    "seq_no_eos_mask",
    "version_start",
    "version_end",
)


@dataclasses.dataclass
class MathDatasetConfig:
    path: str = field(
        default="",
        metadata={
            "help": "math jsonl ({query_id, prompt, task, solutions}); "
            "empty = the task's train split"
        },
    )
    eval_path: str = field(
        default="",
        metadata={"help": "held-out math jsonl for greedy accuracy; empty = the task's eval split"},
    )
    max_prompt_len: int = field(
        default=1024, metadata={"help": "drop prompts longer than this many tokens"}
    )
    eval_max_new_tokens: int = field(
        default=16, metadata={"help": "most tokens of a greedy eval answer"}
    )
    max_bad_row_fraction: float = field(
        default=DEFAULT_MAX_FRACTION,
        metadata={
            "help": "rows that load but cannot be graded mid-run are skipped with a warning; "
            "the run fails once more than this share of the rows used were bad (0: at the "
            "first one)"
        },
    )

    def __post_init__(self):
        if not 0.0 <= self.max_bad_row_fraction <= 1.0:
            raise ValueError(
                f"dataset.max_bad_row_fraction={self.max_bad_row_fraction!r}: use a share in "
                "[0, 1] (e.g. 0.05), or 0 to fail at the first bad row"
            )


#: answer budget of the embedded long-reasoning task (its longest worked answer is ~240 tokens)
LONG_MAX_NEW_TOKENS = 256


def _tiny_ppo() -> PPOHyperparameters:
    return PPOHyperparameters(
        group_size=8,
        ppo_n_minibatches=1,
        kl_ctl=0.0,
        disable_value=True,
        group_adv_norm=True,
        # verifier ±1 → ±5 (README, "Rewards"); group norm makes the scale moot
        reward_output_scaling=5.0,
        gen=GenerationHyperparameters(max_new_tokens=16, temperature=1.0),
    )


@dataclasses.dataclass
class PPOMathConfig(BaseExperimentConfig):
    """PPO / GRPO on math prompts, rewarded by the math verifier (sync generate → train).

    The ppo.* options configure the built-in ppo_actor interface (its loss, advantages and
    generation) and which MFCs run (ref for a KL, critic unless disable_value, actor_inf);
    an algorithm of your own (actor.train_interface=NAME, registered by a module given to
    --import) ignores the ppo_actor loss options and takes actor.train_interface_args.*.
    Sampling (ppo.gen.*), group_size and the reward scaling still shape its input.
    """

    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(optimizer=OptimizerConfig(lr=2e-4, weight_decay=0.0))
    )
    critic: ModelConfig = field(
        default_factory=lambda: ModelConfig(optimizer=OptimizerConfig(lr=2e-4, weight_decay=0.0))
    )
    ref: ModelConfig = field(default_factory=ModelConfig)
    reward_model: ModelConfig = field(
        default_factory=ModelConfig,
        metadata={
            "help": "a trained reward model (a checkpoint of `quickstart rw`) that scores every "
            "answer beside the verifier (MFC rm_inf); empty path = none"
        },
    )
    reward_model_scaling: float = field(
        default=1.0,
        metadata={
            "help": "the reward model's score times this is added to each answer's reward "
            "(its scores are logged as rm_inf/rw/score)"
        },
    )
    verifier: bool = field(
        default=True,
        metadata={
            "help": "grade answers with the math verifier (MFC rew_inf); false: the reward "
            "model's score is the whole reward (needs reward_model.path)"
        },
    )
    dataset: MathDatasetConfig = field(default_factory=MathDatasetConfig)
    train_batch_size: int = field(
        default=32, metadata={"help": "prompts per step (each with group_size answers)"}
    )
    ppo: PPOHyperparameters = field(default_factory=_tiny_ppo)
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    exp_ctrl: ExperimentControlConfig = field(
        default_factory=lambda: ExperimentControlConfig(
            benchmark_steps=60, eval_freq_steps=10, eval_at_start=True, save_freq_epochs=1
        )
    )
    eval: bool = field(
        default=True,
        metadata={"help": "measure greedy accuracy on the eval split at exp_ctrl.eval_freq_*"},
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop the prompts whose share of correct answers "
            "lies outside [ppo.success_rate_lb, ppo.success_rate_ub] right after the reward "
            "and generate more prompts until the batch is full (false: such prompts stay "
            "in the batch, masked out of the loss); async-ppo-math: the rollout workers drop "
            "them and roll out the next prompts in their place"
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={
            "help": "most generate-and-filter rounds per step with dynamic_sampling; after "
            "them the step trains on the prompts it kept"
        },
    )
    algo: str = field(
        default="",
        metadata={
            "help": f"algorithm preset, one of {sorted(a for a in ALGO_PRESETS if a)} (empty: "
            "none): sets the ppo.* options of that algorithm (README, 'Algorithms'); the YAML "
            "file and the command line still override them"
        },
    )

    @classmethod
    def algo_overrides(cls, algo: str) -> list[str]:
        """``key=value`` options of algorithm preset ``algo`` (above the task's, below the
        user's own)."""
        return algo_preset(algo).overrides()

    @classmethod
    def task_overrides(cls, task: str) -> list[str]:
        # tiny_long's answers run to ~240 tokens (examples/tiny_long/make_data.py).  Its
        # chains fail on one wrong line, so most sampled answers are wrong and the negative
        # advantages cover long runs of correct lines: at lr 2e-4 greedy accuracy fell from
        # 34.8% to 9.6% in 20 steps; 1e-4 rose to 40.2% in 40 (2026-11-26, an earlier version
        # of the task with a drawn with weight 1/a).
        if task == "tiny_long":
            return [
                f"ppo.gen.max_new_tokens={LONG_MAX_NEW_TOKENS}",
                f"dataset.eval_max_new_tokens={LONG_MAX_NEW_TOKENS}",
                "actor.optimizer.lr=1e-4",
            ]
        return []

    def __post_init__(self):
        super().__post_init__()
        algo_preset(self.algo)  # an unknown name fails here, listing the known ones
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")
        if self.dynamic_sampling_max_rounds < 1:
            raise ValueError(
                f"dynamic_sampling_max_rounds must be >= 1, got {self.dynamic_sampling_max_rounds}"
            )
        if not self.verifier and not self.reward_model.path:
            raise ValueError(
                "verifier=false leaves no reward: give a trained reward model "
                "(reward_model.path=DIR, e.g. a checkpoint of `quickstart rw`) or keep the verifier"
            )
        if self.dynamic_sampling and not self.verifier:
            raise ValueError(
                "dynamic_sampling judges groups by the verifier's verdicts; it needs verifier=true"
            )
        if self.dynamic_sampling and not self.ppo.filters_by_success_rate:
            raise ValueError(
                "dynamic_sampling=true drops the prompts whose success rate lies outside "
                "[ppo.success_rate_lb, ppo.success_rate_ub] = [0, 1], which is none: narrow it, "
                "e.g. ppo.success_rate_lb=0.001 ppo.success_rate_ub=0.999 (drop the groups "
                "whose answers all agree), or use algo=dapo"
            )


# Long on purpose: one block per MFC of the graph, each pruned by the options that need it,
# so the whole dataflow graph can be read in one place.
def ppo_mfcs(
    cfg: PPOMathConfig, mb_spec: MicroBatchSpec, include_gen: bool = True, images: bool = False
) -> list:
    """The MFCs of PPO for `cfg` (without actor_gen for async PPO); with ``images`` the
    prompts' images go to every MFC that runs the policy, its reference or the critic."""
    hp = dataclasses.replace(cfg.ppo, seed=cfg.seed)  # one seed for the whole run
    n = cfg.train_batch_size
    actor = cfg.actor.interfaces(hp)  # ppo_actor unless actor.*_interface say otherwise
    seq_keys = blocks.with_images(("packed_input_ids", "prompt_mask"), images)
    train_keys = [
        *seq_keys,
        "packed_logprobs",
        "rewards",
        "seq_no_eos_mask",
    ]
    mfcs = []
    if include_gen:
        mfcs.append(
            MFCDef(
                name="actor_gen",
                model_name="actor",
                interface_type="generate",
                interface_impl=actor.gen,
                n_seqs=n,
                input_keys=blocks.with_images(("packed_prompts",), images),
                output_keys=GEN_KEYS,
                mb_spec=mb_spec,
            )
        )
        if cfg.verifier:
            mfcs.append(
                MFCDef(
                    name="rew_inf",
                    model_name="actor",
                    interface_type="inference",
                    interface_impl=InterfaceAbstraction(
                        "math_reward",
                        {
                            "output_scaling": hp.reward_output_scaling,
                            "output_bias": hp.reward_output_bias,
                            "max_bad_row_fraction": cfg.dataset.max_bad_row_fraction,
                            **(
                                {"keep_success_rate": [hp.success_rate_lb, hp.success_rate_ub]}
                                if cfg.dynamic_sampling
                                else {}
                            ),
                        },
                    ),
                    n_seqs=n,
                    input_keys=("packed_input_ids", "prompt_mask"),
                    output_keys=("rewards",),
                    mb_spec=mb_spec,
                    drops_items=cfg.dynamic_sampling,
                )
            )
    if cfg.reward_model.path:
        # With the verifier, its rewards and the model's scores (rm_rewards) are summed in
        # the PPO batch; without, the model's scores are the rewards.
        key = "rm_rewards" if cfg.verifier else "rewards"
        mfcs.append(
            MFCDef(
                name="rm_inf",
                model_name="reward",
                interface_type="inference",
                interface_impl=InterfaceAbstraction(
                    "rw", {"output_scaling": cfg.reward_model_scaling}
                ),
                n_seqs=n,
                input_keys=("packed_input_ids", "prompt_mask"),
                output_keys=(key,),
                output_key_remap={"rewards": key} if cfg.verifier else {},
                mb_spec=mb_spec,
            )
        )
        if cfg.verifier:
            train_keys.append("rm_rewards")
    if hp.needs_ref:
        mfcs.append(
            MFCDef(
                name="ref_inf",
                model_name="ref",
                interface_type="inference",
                interface_impl=actor.inf,
                n_seqs=n,
                input_keys=seq_keys,  # prompt_mask: shared prompts
                output_keys=("packed_ref_logprobs",),
                output_key_remap={"logprobs": "packed_ref_logprobs"},
                mb_spec=mb_spec,
            )
        )
        train_keys.append("packed_ref_logprobs")
    if hp.needs_proximal_recompute:
        mfcs.append(
            MFCDef(
                name="actor_inf",
                model_name="actor",
                interface_type="inference",
                interface_impl=actor.inf,
                n_seqs=n,
                input_keys=seq_keys,  # prompt_mask: shared prompts
                output_keys=("proximal_logprobs",),
                output_key_remap={"logprobs": "proximal_logprobs"},
                mb_spec=mb_spec,
            )
        )
        train_keys.append("proximal_logprobs")
    if not hp.disable_value:
        critic = InterfaceAbstraction("ppo_critic", {"hparams": hp, "rollout": hp.rollout})
        mfcs.append(
            MFCDef(
                name="critic_inf",
                model_name="critic",
                interface_type="inference",
                interface_impl=critic,
                n_seqs=n,
                input_keys=(*seq_keys, "seq_no_eos_mask"),
                output_keys=("values",),
                mb_spec=mb_spec,
            )
        )
        train_keys.append("values")
        mfcs.append(
            MFCDef(
                name="critic_train",
                model_name="critic",
                interface_type="train_step",
                interface_impl=critic,
                n_seqs=n,
                input_keys=tuple(train_keys),
                mb_spec=mb_spec,
                log_return_value=True,
            )
        )
    mfcs.append(
        MFCDef(
            name="actor_train",
            model_name="actor",
            interface_type="train_step",
            interface_impl=actor.train,
            n_seqs=n,
            input_keys=tuple(train_keys),
            mb_spec=mb_spec,
            log_return_value=True,
        )
    )
    return mfcs


def model_specs(cfg: PPOMathConfig, actor_path: str, publish_weights: bool = False) -> list:
    """Model roles of PPO: actor (trained), ref (ppo.needs_ref: a KL in the reward or the
    loss), reward (reward_model.path: a scalar-head model that scores answers), critic
    (unless disable_value)."""
    specs = [
        blocks.model_spec(
            "actor", cfg.actor, actor_path, trainable=True, publish_weights=publish_weights
        )
    ]
    # ref and critic start from the actor's weights unless given their own:
    # the KL reference is the initial policy, and a critic gets a fresh value
    # head on the actor's body (is_critic).
    if cfg.ppo.needs_ref:
        # A LoRA actor's reference is its own base with the adapters off (no second copy),
        # unless the ref has weights of its own.
        on_base = cfg.actor.lora.enabled and not cfg.ref.path
        specs.append(
            blocks.model_spec(
                "ref",
                cfg.ref,
                blocks.model_path(cfg.ref, "ref") if cfg.ref.path else actor_path,
                trainable=False,
                adapters_of="actor" if on_base else None,
            )
        )
    if cfg.reward_model.path:
        path = blocks.model_path(cfg.reward_model, "reward_model")
        specs.append(
            blocks.model_spec("reward", cfg.reward_model, path, trainable=False, is_critic=True)
        )
    if not cfg.ppo.disable_value:
        critic_path = blocks.model_path(cfg.critic, "critic") if cfg.critic.path else actor_path
        specs.append(
            blocks.model_spec("critic", cfg.critic, critic_path, trainable=True, is_critic=True)
        )
    return specs


def checked_math_data(
    cfg: PPOMathConfig, tokenizer, context: Optional[Tuple[int, str]] = None
) -> tuple:
    """(train path, eval path, train size), loading both files once to fail early.

    ``context``: (positions, what sets them) — the longest a sequence may be (the model's
    limit, or a server's context length).  The longest prompt kept plus its answer budget
    must fit in it, or the run would fail at its first request for that prompt."""
    train = blocks.data_path(cfg.dataset.path, blocks.task_data(cfg.task, "train"), "dataset.path")
    eval_ = blocks.data_path(
        cfg.dataset.eval_path, blocks.task_data(cfg.task, "eval"), "dataset.eval_path"
    )
    limit = cfg.dataset.max_prompt_len
    try:
        size, longest = blocks.checked_sizes(
            MathPromptDataset, train, tokenizer, max_prompt_len=limit
        )
        files = [(train, longest, cfg.ppo.gen.max_new_tokens, "ppo.gen.max_new_tokens")]
        if cfg.eval:
            _, longest = blocks.checked_sizes(
                MathPromptDataset, eval_, tokenizer, max_prompt_len=limit
            )
            budget = cfg.dataset.eval_max_new_tokens
            files.append((eval_, longest, budget, "dataset.eval_max_new_tokens"))
    except DatasetError as e:
        raise blocks.ExperimentSetupError(str(e)) from None
    for path, longest, budget, key in files if context else ():
        positions, source = context
        if longest + budget > positions:
            fixes = []
            if longest < positions:
                fixes.append(f"set {key}={positions - longest}")
            if budget < positions:
                drop = positions - budget
                fixes.append(f"set dataset.max_prompt_len={drop} to drop the longer prompts")
            fixes.append("use a model with a longer context")
            raise blocks.ExperimentSetupError(
                f"{path}: its longest prompt has {longest} tokens, and with {key}={budget} "
                f"an answer would reach {longest + budget} tokens, past the {positions} "
                f"positions of {source}; {', or '.join(fixes)}"
            )
    return train, eval_, size


def math_eval(cfg: PPOMathConfig, eval_path: str, data_args: dict) -> dict:
    """The model worker's ``eval_dataset`` and ``evaluation`` fields: greedy accuracy of
    the actor on the held-out prompts, or neither when ``cfg.eval`` is off."""
    if not cfg.eval:
        return {"eval_dataset": None, "evaluation": None}
    return {
        "eval_dataset": DatasetAbstraction(
            "math_prompt", dict(dataset_path=eval_path, **data_args)
        ),
        "evaluation": EvalSpec(
            role="actor",
            interface_impl=InterfaceAbstraction(
                "math_eval", {"max_new_tokens": cfg.dataset.eval_max_new_tokens}
            ),
        ),
    }


def build_ppo_math(cfg: PPOMathConfig) -> ExperimentConfig:
    """Compile a PPOMathConfig into one master and d·p·m model workers (the trainer layout)."""
    alloc = blocks.allocation(cfg, decoupled=False)
    actor_path = blocks.model_path(cfg.actor, "actor", cfg.task)
    tok = blocks.load_tokenizer(actor_path)
    context = (blocks.model_positions(actor_path), f"the model at {actor_path}")
    train, eval_, size = checked_math_data(cfg, tok, context)
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
    mb_spec = cfg.mb.spec
    mfcs = ppo_mfcs(cfg, mb_spec, images=blocks.dataset_has_images(train))
    data_args = dict(max_prompt_len=cfg.dataset.max_prompt_len)
    models = model_specs(cfg, actor_path)
    return blocks.trainer_experiment(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=cfg.train_batch_size,
        tokenizer_path=actor_path,
        imports=blocks.WORKER_IMPORTS + ("realhf.impl.model.interface.math_eval_interface",),
        log_stats_keys=("math_reward/reward", "math_reward/accuracy", "greedy_acc")
        + (("dynamic_sampling/rounds", "dynamic_sampling/kept") if cfg.dynamic_sampling else ()),
        eval=cfg.eval,
        max_fill_rounds=cfg.dynamic_sampling_max_rounds if cfg.dynamic_sampling else 1,
        dataset=DatasetAbstraction("math_prompt", dict(dataset_path=train, **data_args)),
        **math_eval(cfg, eval_, data_args),
    )


register_quickstart_exp("ppo-math", PPOMathConfig, build_ppo_math)
