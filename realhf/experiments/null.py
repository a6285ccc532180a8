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
from realhf.api.core.worker_api import MasterWorkerConfig, ModelWorkerConfig
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
    layout = alloc.train
    n_workers = layout.world_size
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
    places = blocks.placements(alloc, mfcs, models, cfg.keep_replicas)
    worker = ModelWorkerConfig(
        seed=cfg.seed,
        models=models,
        layout=layout,
        placements=places,
        mfcs=mfcs,
        dataset=DatasetAbstraction(
            "prompt_answer", dict(dataset_path=data, max_length=cfg.dataset.max_length)
        ),
        tokenizer_path=path,
        dataset_batch_size=n,
        timeout=cfg.worker_timeout,
        ft_spec=ft_spec,
        torch_num_threads=blocks.torch_threads(cfg, n_workers),
        imports=blocks.WORKER_IMPORTS + ("realhf.impl.model.interface.null_interface",),
    )
    master = MasterWorkerConfig(
        seed=cfg.seed,
        mfcs=mfcs,
        exp_ctrl=cfg.exp_ctrl,
        n_model_workers=n_workers,
        layout=layout,
        placements=places,
        train_batch_size=n,
        ft_spec=ft_spec,
        timeout=cfg.worker_timeout,
        recover_mode=cfg.recover_mode,
        max_recover_checkpoints=cfg.max_recover_checkpoints,
        **blocks.tracking(cfg),
        log_stats_keys=("null/",),
    )
    return ExperimentConfig(
        workers={"model_worker": [worker] * n_workers, "master_worker": [master]},
        completion_types=("master_worker",),
        scheduling=blocks.scheduling(alloc),
    )


register_quickstart_exp("null", NullConfig, build_null)
