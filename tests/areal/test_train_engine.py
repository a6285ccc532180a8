"""The light API's TrainEngine: forward, one optimizer step, save / load, upload."""

from __future__ import annotations

import os

import torch
from tiny_models import make_tiny_hf_model

from areal.api.engine_api import InferenceEngine, TrainEngine
from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.impl.model.conversion.hf import save_tokenizer

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "realhf", "assets", "tiny")


class _Recorder(InferenceEngine):
    def __init__(self):
        self.updates = []

    def update_weights(self, path, version):
        self.updates.append((path, version))


def _batch():
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11], dtype=torch.long)
    return SequenceSample.from_default(
        ids=["a", "b"], seqlens=[4, 3], data={"packed_input_ids": ids}
    )


def test_forward_train_save_load_and_upload(tmp_path):
    path = str(tmp_path / "m")
    make_tiny_hf_model("qwen2", path, seed=0, vocab_size=268, eos_token_id=0, pad_token_id=1)
    save_tokenizer(TINY, path)
    eng = TrainEngine(path, OptimizerConfig(lr=1e-2, weight_decay=0.0), total_steps=4)
    logits = eng.forward(_batch(), MicroBatchSpec())
    assert logits.shape == (7, 268)

    def loss_fn(out, mb):
        loss = torch.nn.functional.cross_entropy(out[:-1].float(), mb.data["packed_input_ids"][1:])
        return loss, {}

    before = eng.module.flat_params.detach().clone()
    eng.train_batch(_batch(), MicroBatchSpec(), loss_fn, lambda mb: 1.0)
    assert eng.version == 1 and not torch.equal(before, eng.module.flat_params)
    rec = _Recorder()
    eng.upload_weights(rec, str(tmp_path / "v1"))
    assert rec.updates == [(str(tmp_path / "v1"), 1)]
    other = TrainEngine(path)
    other.load(str(tmp_path / "v1"))
    assert torch.equal(other.module.flat_params, eng.module.flat_params)
