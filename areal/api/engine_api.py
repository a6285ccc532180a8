"""Engines: what trains the model and what generates with it.

:class:`TrainEngine` is the trained model of an SPMD script: a ReaLModel in realhf's
training backend, data-parallel over ``torch.distributed``'s default group when the script
runs under ``torchrun`` with more than one process.  Algorithms are realhf's interfaces,
called on :attr:`TrainEngine.model` (e.g. ``PPOActorInterface.train_step(engine.model,
batch, mb_spec)``), so nothing of the PPO maths lives here.

:class:`InferenceEngine` is what a workflow generates with: ``agenerate`` answers a
:class:`~realhf.api.core.rollout_api.GenerateGroupRequest` with a ``GroupGeneration``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from realhf.api.cli_args import LoraConfig, OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import FinetuneSpec, Model
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import TrainEngine as _Backend
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion import flat_file
from realhf.impl.model.nn.lora import add_lora

__all__ = ["TrainEngine", "InferenceEngine"]


class TrainEngine:
    """A trained model (see the module docstring).

    Args:
        path: HuggingFace model directory (with its tokenizer).
        optimizer: AdamW settings and LR schedule.
        total_steps: optimizer steps of the run (the LR schedule's length).
        role: the model's name in logs.
        lora: LoRA adapters (rank > 0): only they train, :meth:`save` writes them as a PEFT
            directory and :meth:`upload_weights` sends them alone; start the servers from
            :meth:`serving_dir`.  Draw them alike on every rank (seed torch first).
    """

    def __init__(
        self,
        path: str,
        optimizer: Optional[OptimizerConfig] = None,
        total_steps: int = 1,
        role: str = "actor",
        lora: Optional[LoraConfig] = None,
    ):
        from transformers import AutoTokenizer

        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"TrainEngine: '{path}' is not a HuggingFace model directory")
        self.path = path
        self._last_flat: Optional[str] = None  # the flat weight file of the last upload
        self._sender: Optional[WeightSender] = None  # weight_sync=broadcast: servers pull here
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # CPU here; with CUDA, this process's GPU (torchrun's LOCAL_RANK).
        self.device = "cpu"
        if torch.cuda.is_available():
            self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(self.device)
        self.module = ReaLModel.from_hf(path, device=self.device)
        if lora is not None and lora.enabled:
            add_lora(self.module, lora)
        backend = _Backend(
            self.module,
            optimizer or OptimizerConfig(),
            FinetuneSpec(total_train_epochs=1, dataset_size=total_steps, train_batch_size=1),
        )
        #: the handle realhf's interfaces take (``interface.train_step(engine.model, ...)``)
        self.model = Model(role, backend, self.tokenizer, device=self.device)

    @property
    def version(self) -> int:
        """Optimizer steps taken (interfaces advance it)."""
        return self.model.version.global_step

    def forward(self, batch: SequenceSample, mb_spec: MicroBatchSpec, post_hook=None):
        """The model's outputs over a packed batch, micro-batch by micro-batch (no grad;
        ``post_hook(out, mb)`` maps each micro-batch's logits, e.g. to log-probs)."""
        return self.model.module.forward(batch, mb_spec, post_hook)

    def train_batch(self, batch: SequenceSample, mb_spec: MicroBatchSpec, loss_fn, weight_fn):
        """One optimizer step: ``loss_fn(out, mb) -> (loss, stats)`` per micro-batch, the
        micro-batch losses weighted by ``weight_fn(mb)`` over all data-parallel ranks (a
        collective: every rank calls it).  Returns the step's statistics."""
        stats = self.model.module.train_batch(
            batch, mb_spec, loss_fn, weight_fn, version_steps=self.version
        )
        self.model.inc_version()
        return stats

    def load(self, path: str) -> None:
        """Load the weights of the HuggingFace directory ``path`` into the model."""
        self.module.load_hf_weights(path)

    def upload_weights(self, engine: "InferenceEngine", path: str) -> None:
        """Save the weights to ``path`` and make ``engine`` generate with them, as version
        :attr:`version` (rank 0 saves; every rank waits until it is written).

        With an engine whose ``weight_sync`` is ``shm``, ``path`` is a flat weight file in
        shared memory (under the servers' ``shm_root``): written once, mapped by the
        servers; the file of the version before is then retired, and the next upload
        reuses its memory.  With ``broadcast`` nothing is written and ``path`` is unused:
        rank 0 stages a copy in its weight sender, and each server pulls it over a process
        group (:mod:`realhf.impl.model.comm.weight_broadcast`)."""
        import torch.distributed as dist

        mode = getattr(engine, "weight_sync", "disk")
        first = not dist.is_initialized() or dist.get_rank() == 0
        # The module is one whole model on every rank (data parallelism only): rank 0
        # publishes what trains (the whole model, or its LoRA adapters), in the way the
        # engine's servers load.
        m = self.module
        if mode == "disk":
            self.save(path)  # (itself rank 0 only)
        elif first and mode == "shm":
            flat_file.write_flat(m.trained_flat, m.trained_spec, path, self.version)
        elif first:  # broadcast
            if self._sender is None:
                self._sender = WeightSender()
            self._sender.stage(m.trained_flat, m.trained_spec, self.version)
            path = self._sender.address
        if dist.is_initialized():
            dist.barrier()
        if first:
            engine.update_weights(path, self.version)
            if mode == "shm":
                last, self._last_flat = self._last_flat, path
                if last is not None and last != path and os.path.exists(last):
                    flat_file.retire(last)

    def close(self) -> None:
        """Stop the weight sender, if :meth:`upload_weights` started one."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def serving_dir(self, path: str) -> str:
        """What generation servers of this model start from: its HF directory, or with LoRA
        the current adapters saved at ``path`` (a PEFT directory on the base, which servers
        load as the base with adapters; rank 0 writes)."""
        if self.module.lora is None:
            return self.path
        self.save(path)
        return path

    def save(self, path: str) -> None:
        """A HuggingFace directory of the current weights (with the tokenizer), or with LoRA
        a PEFT adapter directory on the base; written complete before it is renamed into
        place (data-parallel ranks hold the same weights: rank 0 writes)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        tmp = path + ".tmp"
        self.module.save_trained(
            tmp, base_model_path=os.path.abspath(self.path), tokenizer=self.path
        )
        if os.path.isdir(path):
            import shutil

            shutil.rmtree(path)
        os.rename(tmp, path)


class InferenceEngine:
    """What a workflow generates with (see the module docstring)."""

    async def agenerate(self, req: GenerateGroupRequest) -> GroupGeneration:
        raise NotImplementedError

    def update_weights(self, path: str, version: int) -> None:
        """Load the weights of ``path`` (a HF directory), which are version ``version``."""
        raise NotImplementedError

    @property
    def version(self) -> int:
        """The weight version the engine generates with."""
        raise NotImplementedError
