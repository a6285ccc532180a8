"""Fixtures for the interface tests: the embedded tiny tokenizer, a tiny random qwen2
checkpoint with its vocabulary, models wrapped in engines, and arithmetic prompts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from tiny_models import make_tiny_hf_model

import realhf.impl.model.interface  # noqa: F401  (registers the interfaces)
from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import FinetuneSpec, Model
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import InferenceEngine, TrainEngine

# Tests import the helpers in interface_testlib.py by name.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from interface_testlib import ASSETS, prompt_answer_sample  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="session")
def actor_hf_dir(tmp_path_factory, tokenizer):
    return make_tiny_hf_model(
        "qwen2", tmp_path_factory.mktemp("actor"), vocab_size=len(tokenizer), seed=3
    )


@pytest.fixture
def make_model(actor_hf_dir, tokenizer):
    """``make_model(role, train=True, is_critic=False, critic_lm_logits=False, lr=1e-3,
    **opt) -> Model``."""

    def make(
        role: str = "actor",
        *,
        train: bool = True,
        is_critic: bool = False,
        critic_lm_logits: bool = False,
        **opt,
    ) -> Model:
        torch.manual_seed(0)  # a critic's value head starts random: keep tests deterministic
        net = ReaLModel.from_hf(
            actor_hf_dir, is_critic=is_critic, critic_lm_logits=critic_lm_logits
        )
        if train:
            cfg = OptimizerConfig(**{"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, **opt})
            engine = TrainEngine(
                net, cfg, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=4)
            )
        else:
            engine = InferenceEngine(net)
        return Model(role, engine, tokenizer, device="cpu")

    return make


def math_records(n: int, split: str = "train"):
    with open(os.path.join(ASSETS, "data", f"{split}.jsonl")) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


@pytest.fixture
def prompts(tokenizer):
    """Four arithmetic prompts as a ``packed_prompts`` sample with ``solutions`` metadata."""
    recs = math_records(4)
    toks = [tokenizer(r["prompt"]).input_ids for r in recs]
    return SequenceSample.from_default(
        ids=[r["query_id"] for r in recs],
        seqlens=[len(t) for t in toks],
        data={"packed_prompts": torch.tensor([t for ts in toks for t in ts], dtype=torch.long)},
        metadata={"solutions": [r["solutions"] for r in recs]},
    )


@pytest.fixture
def pa_sample(tokenizer):
    """``pa_sample(pairs, group=1, ids=None, solutions=None)``: see ``prompt_answer_sample``."""
    return lambda pairs, **kw: prompt_answer_sample(tokenizer, pairs, **kw)
