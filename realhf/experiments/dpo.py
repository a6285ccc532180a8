"""Direct preference optimisation (DPO, or IPO) on preference pairs, against a frozen reference.

    python -m realhf.apps.quickstart dpo                        # embedded tiny model + pairs
    python -m realhf.apps.quickstart dpo dpo.loss=ipo dpo.beta=0.1
    python -m realhf.apps.quickstart dpo actor.path=DIR dataset.path=pairs.jsonl eval=false

The dataflow graph:

    ref_inf (frozen ``ref``: log-probs of chosen and rejected) ─→ actor_train (DPO / IPO)

The reference starts from the actor's weights unless ``ref.path`` is given. Pairs are
jsonl rows ``{id, prompt, chosen, rejected}``; with no paths the embedded task's pairs
(``examples/paired/make_pairs.py``: rejected answers are the SFT model's own mistakes).
Greedy accuracy on the task's held-out math split (``eval/greedy_acc``) is measured at
the start and every ``exp_ctrl.eval_freq_steps``, as in ppo-math.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from realhf.api.cli_args import (
    BaseExperimentConfig,
    ExperimentControlConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)
from realhf.api.core.data_api import MicroBatchSpec
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import DatasetAbstraction, InterfaceAbstraction
from realhf.api.core.system_api import ExperimentConfig
from realhf.experiments import building_blocks as blocks
from realhf.experiments.ppo_math import math_eval
from realhf.experiments.registry import register_quickstart_exp
from realhf.experiments.rw import PAIRED_IMPORTS, checked_pairs
from realhf.impl.algorithms.preference import PreferenceLoss
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.math_dataset import MathPromptDataset


@dataclasses.dataclass
class DPODatasetConfig:
    path: str = field(
        default="",
        metadata={
            "help": "preference pairs jsonl ({id, prompt, chosen, rejected}); empty = the "
            "task's pairs_train split"
        },
    )
    eval_path: str = field(
        default="",
        metadata={"help": "held-out math jsonl for greedy accuracy; empty = the task's eval split"},
    )
    max_length: int = field(
        default=1024, metadata={"help": "drop pairs with a sequence longer than this"}
    )
    max_prompt_len: int = field(
        default=1024, metadata={"help": "drop eval prompts longer than this many tokens"}
    )
    eval_max_new_tokens: int = field(
        default=16, metadata={"help": "most tokens of a greedy eval answer"}
    )


@dataclasses.dataclass
class DPOHyperparameters:
    beta: float = field(
        default=0.5,
        metadata={"help": "DPO's inverse temperature β (IPO: target margin 1/(2β)); > 0"},
    )
    loss: str = field(
        default="dpo", metadata={"help": f"one of {[k.value for k in PreferenceLoss]}"}
    )

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"dpo.beta={self.beta!r}: use a positive number (e.g. 0.1)")
        if self.loss not in [k.value for k in PreferenceLoss]:
            raise ValueError(
                f"dpo.loss={self.loss!r}: use one of {[k.value for k in PreferenceLoss]}"
            )


@dataclasses.dataclass
class DPOConfig(BaseExperimentConfig):
    """DPO / IPO on preference pairs with a frozen reference model."""

    actor: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            optimizer=OptimizerConfig(lr=2e-5, weight_decay=0.0, warmup_steps_proportion=0.05)
        )
    )
    ref: ModelConfig = field(default_factory=ModelConfig)
    dataset: DPODatasetConfig = field(default_factory=DPODatasetConfig)
    # Tuned on the embedded pairs (2026-11-27, 2 cores): at lr 1e-4 greedy accuracy fell
    # from 32.4% to 24.4% in one epoch (pushing the model's greedy mistake down moved its
    # mass to other wrong answers); lr 2e-5 rose to 38.6% (β 0.1) and 44.0% (β 0.5).
    dpo: DPOHyperparameters = field(default_factory=DPOHyperparameters)
    train_batch_size: int = field(default=32, metadata={"help": "pairs per optimizer step"})
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    exp_ctrl: ExperimentControlConfig = field(
        default_factory=lambda: ExperimentControlConfig(
            total_train_epochs=2, eval_freq_steps=42, eval_at_start=True, save_freq_epochs=1
        )
    )
    eval: bool = field(
        default=True,
        metadata={"help": "measure greedy accuracy on the eval split at exp_ctrl.eval_freq_*"},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")


def dpo_mfcs(cfg: DPOConfig, mb_spec: MicroBatchSpec) -> list:
    """ref_inf → actor_train."""
    iface = InterfaceAbstraction("dpo", dataclasses.asdict(cfg.dpo))
    n = cfg.train_batch_size
    return [
        MFCDef(
            name="ref_inf",
            model_name="ref",
            interface_type="inference",
            interface_impl=iface,
            n_seqs=n,
            input_keys=("packed_input_ids", "prompt_mask"),  # prompt_mask: shared prompts
            output_keys=("packed_ref_logprobs",),
            output_key_remap={"logprobs": "packed_ref_logprobs"},
            mb_spec=mb_spec,
        ),
        MFCDef(
            name="actor_train",
            model_name="actor",
            interface_type="train_step",
            interface_impl=iface,
            n_seqs=n,
            input_keys=("packed_input_ids", "prompt_mask", "packed_ref_logprobs"),
            mb_spec=mb_spec,
            log_return_value=True,
        ),
    ]


def build_dpo(cfg: DPOConfig) -> ExperimentConfig:
    """Compile a DPOConfig into one master and d·p·m model workers (the trainer layout)."""
    alloc = blocks.allocation(cfg, decoupled=False)
    actor_path = blocks.model_path(cfg.actor, "actor", cfg.task)
    ref_path = blocks.model_path(cfg.ref, "ref") if cfg.ref.path else actor_path
    tok = blocks.load_tokenizer(actor_path)
    train, _, size = checked_pairs(cfg, tok, with_eval=False)
    eval_path = blocks.data_path(
        cfg.dataset.eval_path, blocks.task_data(cfg.task, "eval"), "dataset.eval_path"
    )
    data_args = dict(max_prompt_len=cfg.dataset.max_prompt_len)
    if cfg.eval:
        try:
            MathPromptDataset(eval_path, tok, **data_args)
        except DatasetError as e:
            raise blocks.ExperimentSetupError(str(e)) from None
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
    mb_spec = cfg.mb.spec
    mfcs = dpo_mfcs(cfg, mb_spec)
    models = [
        blocks.model_spec("actor", cfg.actor, actor_path, trainable=True),
        # A LoRA actor's reference is its base with the adapters off (no second copy).
        blocks.model_spec(
            "ref",
            cfg.ref,
            ref_path,
            trainable=False,
            adapters_of="actor" if cfg.actor.lora.enabled and not cfg.ref.path else None,
        ),
    ]
    return blocks.trainer_experiment(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=cfg.train_batch_size,
        tokenizer_path=actor_path,
        imports=PAIRED_IMPORTS + ("realhf.impl.model.interface.math_eval_interface",),
        log_stats_keys=("dpo/loss", "dpo/reward_acc", "greedy_acc"),
        eval=cfg.eval,
        dataset=DatasetAbstraction(
            "paired", dict(dataset_path=train, max_length=cfg.dataset.max_length)
        ),
        **math_eval(cfg, eval_path, data_args),
    )


register_quickstart_exp("dpo", DPOConfig, build_dpo)
