"""The null experiment: the system without model compute.

    python -m realhf.apps.quickstart null [allocation_mode=d2p1m1] [exp_ctrl.benchmark_steps=N]

The SFT data flows through an inference MFC (``null_inf``) and a train MFC
(``null_train``) running the ``null`` interface, so a run measures and tests the
plumbing (launch, data loading, DP split, data transfer, stats, checkpoints) alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from realhf.api.cli_args import BaseExperimentConfig, ExperimentControlConfig, ModelConfig
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import DatasetAbstraction
from realhf.api.core.system_api import ExperimentConfig
from realhf.experiments import building_blocks as blocks
from realhf.experiments.registry import register_quickstart_exp
from realhf.experiments.sft import SFTDatasetConfig


@dataclasses.dataclass
class NullConfig(BaseExperimentConfig):
    """The whole system with a null interface: no model compute (plumbing tests and timing)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: SFTDatasetConfig = field(default_factory=SFTDatasetConfig)
    train_batch_size: int = field(default=64, metadata={"help": "items per step"})
    exp_ctrl: ExperimentControlConfig = field(
        default_factory=lambda: ExperimentControlConfig(benchmark_steps=10)
    )


def build_null(cfg: NullConfig) -> ExperimentConfig:
    alloc = blocks.allocation(cfg, decoupled=False)
    path = blocks.model_path(cfg.model, "model", cfg.task)
    data = blocks.data_path(cfg.dataset.path, blocks.task_data(cfg.task, "sft"), "dataset.path")
    with open(data) as f:
        size = sum(1 for line in f if line.strip())
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, size, cfg.train_batch_size)
    n = cfg.train_batch_size
    mfcs = [
        MFCDef(
            name="null_inf",
            model_name="default",
            interface_type="inference",
            interface_impl="null",
            n_seqs=n,
            input_keys=("packed_input_ids",),
            output_keys=("rewards",),
        ),
        MFCDef(
            name="null_train",
            model_name="default",
            interface_type="train_step",
            interface_impl="null",
            n_seqs=n,
            input_keys=("packed_input_ids", "rewards"),
            log_return_value=True,
        ),
    ]
    models = [blocks.model_spec("default", cfg.model, path, trainable=True)]
    return blocks.trainer_experiment(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=n,
        tokenizer_path=path,
        imports=blocks.WORKER_IMPORTS + ("realhf.impl.model.interface.null_interface",),
        log_stats_keys=("null/",),
        dataset=DatasetAbstraction(
            "prompt_answer", dict(dataset_path=data, max_length=cfg.dataset.max_length)
        ),
    )


register_quickstart_exp("null", NullConfig, build_null)
