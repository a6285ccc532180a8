"""Reward-model training: the Bradley–Terry loss on preference pairs.

    python -m realhf.apps.quickstart rw                         # embedded tiny model + pairs
    python -m realhf.apps.quickstart rw model.path=DIR dataset.path=pairs.jsonl \
        dataset.eval_path=held_out_pairs.jsonl

One MFC (``rw_train``, interface ``rw``) on a critic-style model: the SFT model's body with
a fresh scalar head (``is_critic``); the reward of an answer is the head's value at its EOS.
``lm_coef`` (default 3) adds a language-model loss on the chosen answers, which keeps the
body learning to answer correctly while the head learns to rank (needs tied embeddings;
``lm_coef=0`` trains the plain Bradley–Terry loss).
Pairs are jsonl rows ``{id, prompt, chosen, rejected}`` (``paired_dataset``); with no paths
the embedded task's pairs (``examples/paired/make_pairs.py``: ``pairs_rw_train``, every
distinct mistake among 8 samples of each train problem, and the held-out ``pairs_eval``)
are used. Held-out pair accuracy (``rw_eval/pair_acc``) is measured at the start and every
``eval_freq_steps``.
The saved checkpoints (``checkpoints/reward``) load as a critic (``is_critic=True``).
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
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import DatasetAbstraction, InterfaceAbstraction
from realhf.api.core.system_api import ExperimentConfig
from realhf.api.core.worker_api import EvalSpec
from realhf.experiments import building_blocks as blocks
from realhf.experiments.registry import register_quickstart_exp
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.paired_dataset import PairedDataset

#: modules the workers import for the paired data and the rw / dpo interfaces
PAIRED_IMPORTS = blocks.WORKER_IMPORTS + (
    "realhf.impl.dataset.paired_dataset",
    "realhf.impl.model.interface.rw_interface",
    "realhf.impl.model.interface.dpo_interface",
)


@dataclasses.dataclass
class PairedDatasetConfig:
    path: str = field(
        default="",
        metadata={
            "help": "preference pairs jsonl ({id, prompt, chosen, rejected}); empty = the "
            "task's pairs_rw_train split"
        },
    )
    eval_path: str = field(
        default="",
        metadata={"help": "held-out pairs jsonl; empty = the task's pairs_eval split"},
    )
    max_length: int = field(
        default=1024, metadata={"help": "drop pairs with a sequence longer than this"}
    )


def checked_pairs(
    cfg, tokenizer, with_eval: bool = True, train_split: str = "pairs_train"
) -> tuple:
    """(train path, eval path or None, train size) of ``cfg.dataset`` (a
    :class:`PairedDatasetConfig`; ``train_split`` is the task's default training file),
    each file loaded once so that malformed rows fail before any process starts."""
    ds = cfg.dataset
    train = blocks.data_path(ds.path, blocks.task_data(cfg.task, train_split), "dataset.path")
    eval_ = None
    if with_eval:
        eval_ = blocks.data_path(
            ds.eval_path, blocks.task_data(cfg.task, "pairs_eval"), "dataset.eval_path"
        )
    try:
        size = blocks.checked_len(PairedDataset, train, tokenizer, max_length=ds.max_length)
        if eval_:
            blocks.checked_len(PairedDataset, eval_, tokenizer, max_length=ds.max_length)
    except DatasetError as e:
        raise blocks.ExperimentSetupError(str(e)) from None
    return train, eval_, size


@dataclasses.dataclass
class RWConfig(BaseExperimentConfig):
    """Bradley–Terry reward model on preference pairs (critic-style scalar head)."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            optimizer=OptimizerConfig(lr=5e-4, weight_decay=0.0, warmup_steps_proportion=0.05)
        )
    )
    dataset: PairedDatasetConfig = field(default_factory=PairedDatasetConfig)
    train_batch_size: int = field(default=32, metadata={"help": "pairs per optimizer step"})
    lm_coef: float = field(
        default=3.0,
        metadata={
            "help": "weight of the language-model loss on the chosen answers, added to the "
            "Bradley-Terry loss (keeps the body learning to answer while the head learns "
            "to rank; needs tied embeddings and p=1); 0 = the plain Bradley-Terry loss"
        },
    )
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)
    # 488 steps per epoch on the embedded pairs_rw_train (15,620 pairs): evaluate twice an
    # epoch. See benchmark/results/algorithms.md for the figures and what was tried.
    exp_ctrl: ExperimentControlConfig = field(
        default_factory=lambda: ExperimentControlConfig(
            total_train_epochs=5, eval_freq_steps=244, eval_at_start=True, save_freq_epochs=1
        )
    )

    def __post_init__(self):
        super().__post_init__()
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")
        if not self.lm_coef >= 0:
            raise ValueError(f"lm_coef must be >= 0 (0 turns it off), got {self.lm_coef}")


def build_rw(cfg: RWConfig) -> ExperimentConfig:
    """Compile an RWConfig into one master and d·p·m model workers (the trainer layout)."""
    alloc = blocks.allocation(cfg, decoupled=False)
    path = blocks.model_path(cfg.model, "model", cfg.task)
    tok = blocks.load_tokenizer(path)
    train, eval_, size = checked_pairs(cfg, tok, train_split="pairs_rw_train")
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
    mb_spec = cfg.mb.spec
    mfcs = [
        MFCDef(
            name="rw_train",
            model_name="reward",
            interface_type="train_step",
            interface_impl=InterfaceAbstraction("rw", {"lm_coef": cfg.lm_coef}),
            n_seqs=cfg.train_batch_size,
            input_keys=("packed_input_ids", "prompt_mask"),
            mb_spec=mb_spec,
            log_return_value=True,
        )
    ]
    models = [
        blocks.model_spec(
            "reward",
            cfg.model,
            path,
            trainable=True,
            is_critic=True,
            critic_lm_logits=cfg.lm_coef > 0,
        )
    ]
    data_args = dict(max_length=cfg.dataset.max_length)
    return blocks.trainer_experiment(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=cfg.train_batch_size,
        tokenizer_path=path,
        imports=PAIRED_IMPORTS,
        log_stats_keys=("rw/loss", "rw/pair_acc", "pair_acc"),
        eval=True,
        dataset=DatasetAbstraction("paired", dict(dataset_path=train, **data_args)),
        eval_dataset=DatasetAbstraction("paired", dict(dataset_path=eval_, **data_args)),
        evaluation=EvalSpec(role="reward", interface_impl="rw", mb_spec=mb_spec),
    )


register_quickstart_exp("rw", RWConfig, build_rw)
