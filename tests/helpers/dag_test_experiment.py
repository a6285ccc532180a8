"""``dag-test``: the DAG executor end to end on a toy graph, with a real trainable model.

Graph (``graph="dag"``)::

    gen    (actor,  generate)   packed_input_ids -> a_out = 2 x
    plus1  (ref,    inference)  a_out -> b_out = a_out + 1
    times3 (ref,    inference)  a_out -(remap x)-> y -(remap c_out)-> c_out = 3 a_out
    train  (actor,  train_step) packed_input_ids, b_out, c_out: checks b = 2x + 1 and
                                c = 6x, then one AdamW step of next-token cross entropy

``graph="sft"`` keeps only ``train`` (reading ``packed_input_ids``).  The dataset
``dag_test_numbers`` holds ``n_items`` random token sequences.  ``train`` appends the
ids it trained on to ``{log_dir}/train_ids_rank{r}.jsonl`` (one line per step), so tests
can check that every item was used once per epoch; ``crash_at_step`` SIGKILLs one model
worker when that global step's ``train`` starts (failure injection for recovery tests).
``layout`` (``"dXpYmZ"``) lays the model workers out as a trainer layout (default: one
data-parallel rank per worker).

    launch_experiment(make_experiment("dag-test", ...), "dag-test", trial, ...)
"""

from __future__ import annotations

import json
import os
import signal
from typing import Optional

import numpy as np
import torch

from realhf.api.cli_args import ExperimentControlConfig, OptimizerConfig
from realhf.api.core.allocation import parse_parallelism
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec, ModelInterface
from realhf.api.core.registry import (
    DatasetAbstraction,
    InterfaceAbstraction,
    register_dataset,
    register_interface,
)
from realhf.api.core.system_api import ExperimentConfig, register_experiment
from realhf.api.core.worker_api import EvalSpec, MasterWorkerConfig, ModelSpec, ModelWorkerConfig
from realhf.base import seeding
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

__all__ = ["NumbersDataset", "ScaleInterface", "CheckAndTrainInterface", "dag_test_experiment"]


class NumbersDataset:
    """``n_items`` random token sequences (ids ``item{i}``), sharded by ``i % world_size``."""

    def __init__(
        self,
        seed: int,
        dp_rank: int,
        world_size: int,
        tokenizer=None,
        n_items: int = 16,
        min_len: int = 3,
        max_len: int = 12,
        vocab_size: int = 128,
        seed_key: str = "train",
        prefix: str = "item",
    ):
        rng = np.random.default_rng(seeding.derive_seed(seed, f"dag_test_numbers:{seed_key}"))
        lens = rng.integers(min_len, max_len + 1, size=n_items)
        self.items = []
        for i in range(n_items):
            toks = rng.integers(0, vocab_size, size=int(lens[i]))
            if i % world_size != dp_rank:
                continue
            self.items.append(
                SequenceSample.from_default(
                    ids=[f"{prefix}{i}"],
                    seqlens=[int(lens[i])],
                    data={"packed_input_ids": torch.tensor(toks, dtype=torch.long)},
                    metadata={"index": [i]},
                )
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> SequenceSample:
        return self.items[i]


class ScaleInterface(ModelInterface):
    """``out = in * factor + offset`` (float32), as ``generate`` or ``inference``."""

    def __init__(self, in_key: str, out_key: str, factor: float = 1.0, offset: float = 0.0):
        self.in_key, self.out_key, self.factor, self.offset = in_key, out_key, factor, offset

    def _run(self, data: SequenceSample) -> SequenceSample:
        x = data.data[self.in_key].float() * self.factor + self.offset
        return SequenceSample(
            keys={self.out_key},
            trailing_shapes={self.out_key: ()},
            dtypes={self.out_key: torch.float32},
            ids=list(data.ids),
            seqlens={self.out_key: [list(l) for l in data.seqlens[self.in_key]]},
            data={self.out_key: x},
        )

    def generate(self, model, data, mb_spec):
        return self._run(data)

    def inference(self, model, data, mb_spec):
        return self._run(data)


class CheckAndTrainInterface(ModelInterface):
    """Checks the toy graph's arithmetic, logs the ids, takes one AdamW step (see module doc)."""

    def __init__(
        self,
        log_dir: str = "",
        check_keys: bool = True,
        crash_at_step: Optional[int] = None,
        crash_rank: int = 1,
    ):
        self.log_dir, self.check_keys = log_dir, check_keys
        self.crash_at_step, self.crash_rank = crash_at_step, crash_rank

    def train_step(self, model, data, mb_spec):
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        step = model.version.global_step
        if (
            self.crash_at_step is not None
            and step == self.crash_at_step
            and rank == self.crash_rank
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        mismatches = 0
        if self.check_keys:
            x = data.data["packed_input_ids"].float()
            mismatches += int((data.data["b_out"] != 2 * x + 1).sum())
            mismatches += int((data.data["c_out"] != 6 * x).sum())
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            with open(os.path.join(self.log_dir, f"train_ids_rank{rank}.jsonl"), "a") as f:
                f.write(
                    json.dumps({"step": step, "epoch": model.version.epoch, "ids": list(data.ids)})
                    + "\n"
                )

        tp = model.module.tp  # logits are vocabulary-sharded under tensor parallelism

        def loss_fn(logits, mb):
            cu = mb.cu_seqlens("packed_input_ids").to(logits.device)
            ids = mb.data["packed_input_ids"].to(logits.device)
            return -gather_packed_shifted_log_probs(logits, cu, ids, tp=tp).mean(), {}

        def weight_fn(mb):
            return sum(l - 1 for l in mb.flat_seqlens("packed_input_ids"))

        stats = model.module.train_batch(data, mb_spec, loss_fn, weight_fn, version_steps=step)
        stats["mismatches"] = float(mismatches)
        stats["n_items"] = float(len(data))
        return stats

    def evaluate(self, model, data, mb_spec):
        """Mean next-token log-probability of ``data`` (this rank's items)."""

        tp = model.module.tp

        def hook(logits, mb):
            cu = mb.cu_seqlens("packed_input_ids").to(logits.device)
            return gather_packed_shifted_log_probs(
                logits, cu, mb.data["packed_input_ids"].to(logits.device), tp=tp
            )

        lens = [[l - 1 for l in ls] for ls in data.seqlens["packed_input_ids"]]
        logp = model.module.forward(data, mb_spec, hook, output_seqlens=lens)
        return {"logprob": float(logp.mean()), "n_items": float(len(data))}


register_dataset("dag_test_numbers", NumbersDataset)
register_interface("dag_test_scale", ScaleInterface)
register_interface("dag_test_train", CheckAndTrainInterface)


def dag_test_experiment(
    *,
    model_path: str,
    n_model_workers: int = 2,
    n_items: int = 16,
    max_len: int = 12,
    train_batch_size: int = 4,
    total_train_epochs: int = 1,
    graph: str = "dag",
    seed: int = 1,
    lr: float = 1e-3,
    log_dir: str = "",
    ckpt_freq_steps: Optional[int] = None,
    save_freq_steps: Optional[int] = None,
    eval_freq_steps: Optional[int] = None,
    benchmark_steps: Optional[int] = None,
    recover_mode: str = "disabled",
    crash_at_step: Optional[int] = None,
    crash_rank: int = 1,
    timeout: float = 120.0,
    torch_num_threads: Optional[int] = 1,
    eval: bool = False,
    publish_weights: bool = False,
    plot_curves: bool = False,
    layout: Optional[str] = None,
) -> ExperimentConfig:
    """Build the ``dag-test`` experiment (see the module docstring)."""
    if graph not in ("dag", "sft"):
        raise ValueError(f"dag-test: graph={graph!r}; use 'dag' or 'sft'")
    par = None
    if layout is not None:
        par = parse_parallelism(layout, "layout")
        n_model_workers = par.world_size
    bs = train_batch_size
    train_keys = ["packed_input_ids"] + (["b_out", "c_out"] if graph == "dag" else [])
    train = MFCDef(
        name="train",
        model_name="actor",
        interface_type="train_step",
        n_seqs=bs,
        interface_impl=InterfaceAbstraction(
            "dag_test_train",
            {
                "log_dir": log_dir,
                "check_keys": graph == "dag",
                "crash_at_step": crash_at_step,
                "crash_rank": crash_rank,
            },
        ),
        input_keys=train_keys,
        mb_spec=MicroBatchSpec(n_mbs=1),
        log_return_value=True,
    )
    mfcs = [train]
    if graph == "dag":
        mfcs = [
            MFCDef(
                name="gen",
                model_name="actor",
                interface_type="generate",
                n_seqs=bs,
                interface_impl=InterfaceAbstraction(
                    "dag_test_scale",
                    {"in_key": "packed_input_ids", "out_key": "a_out", "factor": 2.0},
                ),
                input_keys=["packed_input_ids"],
                output_keys=["a_out"],
            ),
            MFCDef(
                name="plus1",
                model_name="ref",
                interface_type="inference",
                n_seqs=bs,
                interface_impl=InterfaceAbstraction(
                    "dag_test_scale", {"in_key": "a_out", "out_key": "b_out", "offset": 1.0}
                ),
                input_keys=["a_out"],
                output_keys=["b_out"],
            ),
            # Remaps both ways: the interface reads "x" and writes "y".
            MFCDef(
                name="times3",
                model_name="ref",
                interface_type="inference",
                n_seqs=bs,
                interface_impl=InterfaceAbstraction(
                    "dag_test_scale", {"in_key": "x", "out_key": "y", "factor": 3.0}
                ),
                input_keys=["a_out"],
                output_keys=["c_out"],
                input_key_remap={"a_out": "x"},
                output_key_remap={"y": "c_out"},
            ),
            train,
        ]
    ft_spec = FinetuneSpec(total_train_epochs, n_items, bs)
    models = [
        ModelSpec(
            "actor",
            model_path,
            trainable=True,
            publish_weights=publish_weights,
            optimizer=OptimizerConfig(lr=lr, weight_decay=0.0, gradient_clipping=1.0),
        )
    ]
    if graph == "dag":
        models.append(ModelSpec("ref", model_path))
    mw = ModelWorkerConfig(
        seed=seed,
        models=models,
        mfcs=mfcs,
        ft_spec=ft_spec,
        dataset=DatasetAbstraction("dag_test_numbers", {"n_items": n_items, "max_len": max_len}),
        eval_dataset=(
            DatasetAbstraction(
                "dag_test_numbers", {"n_items": 4, "seed_key": "eval", "prefix": "eval"}
            )
            if eval
            else None
        ),
        evaluation=EvalSpec("actor", InterfaceAbstraction("dag_test_train")) if eval else None,
        dataset_batch_size=max(1, bs // 2),
        timeout=timeout,
        imports=(__name__,),
        torch_num_threads=torch_num_threads,
        layout=par,
    )
    master = MasterWorkerConfig(
        seed=seed,
        mfcs=mfcs,
        n_model_workers=n_model_workers,
        layout=par,
        train_batch_size=bs,
        ft_spec=ft_spec,
        exp_ctrl=ExperimentControlConfig(
            total_train_epochs=total_train_epochs,
            benchmark_steps=benchmark_steps,
            ckpt_freq_steps=ckpt_freq_steps,
            save_freq_steps=save_freq_steps,
            eval_freq_steps=eval_freq_steps,
        ),
        timeout=timeout,
        recover_mode=recover_mode,
        log_stats_keys=("loss", "mismatches"),
        eval=eval,
        plot_curves=plot_curves,
    )
    return ExperimentConfig(
        workers={"model_worker": [mw] * n_model_workers, "master_worker": [master]},
        completion_types=("master_worker",),
    )


register_experiment("dag-test", dag_test_experiment)
