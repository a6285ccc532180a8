"""Supervised fine-tuning: one MFC (``trainDefault``) on prompt/answer pairs.

    python -m realhf.apps.quickstart sft                         # embedded tiny model + data
    python -m realhf.apps.quickstart sft model.path=DIR dataset.path=train.jsonl

The loss covers answer tokens only. With no paths it fine-tunes the embedded tiny
model on the embedded arithmetic SFT data; `examples/tiny/train_sft.sh` uses it to
train that model from scratch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from realhf.api.cli_args import (
    BaseExperimentConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimizerConfig,
)
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import DatasetAbstraction
from realhf.api.core.system_api import ExperimentConfig
from realhf.api.core.worker_api import EvalSpec
from realhf.experiments import building_blocks as blocks
from realhf.experiments.registry import register_quickstart_exp
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.sft_dataset import PromptAnswerDataset


@dataclasses.dataclass
class SFTDatasetConfig:
    path: str = field(
        default="",
        metadata={"help": "SFT jsonl ({id, prompt, answer}); empty = the task's SFT split"},
    )
    eval_path: str = field(
        default="", metadata={"help": "held-out SFT jsonl for eval loss; empty = none"}
    )
    max_length: int = field(
        default=1024, metadata={"help": "drop rows longer than this many tokens"}
    )


@dataclasses.dataclass
class SFTConfig(BaseExperimentConfig):
    """Supervised fine-tuning on prompt/answer pairs (loss on answer tokens only)."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0, warmup_steps_proportion=0.05)
        )
    )
    dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    train_batch_size: int = field(default=64, metadata={"help": "sequences per optimizer step"})
    mb: MicroBatchConfig = field(default_factory=MicroBatchConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")


def build_sft(cfg: SFTConfig) -> ExperimentConfig:
    """Compile an SFTConfig into one master and d·p·m model workers (the trainer layout)."""
    alloc = blocks.allocation(cfg, decoupled=False)
    path = blocks.model_path(cfg.model, "model", cfg.task)
    data = blocks.data_path(cfg.dataset.path, blocks.task_data(cfg.task, "sft"), "dataset.path")
    tok = blocks.load_tokenizer(path)
    try:  # load once here so malformed rows fail before any process starts
        size = blocks.checked_len(PromptAnswerDataset, data, tok, max_length=cfg.dataset.max_length)
    except DatasetError as e:
        raise blocks.ExperimentSetupError(str(e)) from None
    eval_ds = None
    if cfg.dataset.eval_path:
        eval_path = blocks.data_path(cfg.dataset.eval_path, "", "dataset.eval_path")
        eval_ds = DatasetAbstraction(
            "prompt_answer", dict(dataset_path=eval_path, max_length=cfg.dataset.max_length)
        )
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
    mb_spec = cfg.mb.spec
    mfcs = [
        MFCDef(
            name="trainDefault",
            model_name="default",
            interface_type="train_step",
            interface_impl="sft",
            n_seqs=cfg.train_batch_size,
            input_keys=blocks.with_images(
                ("packed_input_ids", "prompt_mask"), blocks.dataset_has_images(data)
            ),
            mb_spec=mb_spec,
            log_return_value=True,
        )
    ]
    models = [blocks.model_spec("default", cfg.model, path, trainable=True)]
    return blocks.trainer_experiment(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=cfg.train_batch_size,
        tokenizer_path=path,
        imports=blocks.WORKER_IMPORTS,
        log_stats_keys=("loss", "ppl"),
        eval=eval_ds is not None,
        dataset=DatasetAbstraction(
            "prompt_answer", dict(dataset_path=data, max_length=cfg.dataset.max_length)
        ),
        eval_dataset=eval_ds,
        evaluation=EvalSpec(role="default", interface_impl="sft", mb_spec=mb_spec)
        if eval_ds
        else None,
    )


register_quickstart_exp("sft", SFTConfig, build_sft)
