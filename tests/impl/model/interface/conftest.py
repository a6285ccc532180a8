"""Fixtures for the interface tests: the embedded tiny tokenizer, a tiny random qwen2
checkpoint with its vocabulary, models wrapped in engines, and arithmetic prompts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import realhf
import realhf.impl.model.interface  # noqa: F401  (registers the interfaces)
from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import FinetuneSpec, Model
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.testing import make_tiny_hf_model

# Tests import the helpers in interface_testlib.py by name.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

ASSETS = os.path.join(os.path.dirname(realhf.__file__), "assets", "tiny")


@pytest.fixture(scope="session")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="session")
def actor_hf_dir(tmp_path_factory, tokenizer):
    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("actor"), vocab_size=len(tokenizer), seed=3)


@pytest.fixture
def make_model(actor_hf_dir, tokenizer):
    """``make_model(role, train=True, is_critic=False, lr=1e-3, **opt) -> Model``."""

    def make(role: str = "actor", *, train: bool = True, is_critic: bool = False, **opt) -> Model:
        torch.manual_seed(0)  # a critic's value head starts random: keep tests deterministic
        net = ReaLModel.from_hf(actor_hf_dir, is_critic=is_critic)
        if train:
            cfg = OptimizerConfig(**{"lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8, **opt})
            engine = TrainEngine(net, cfg, FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=4))
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


def prompt_answer_sample(tokenizer, pairs, *, group: int = 1, ids=None, solutions=None) -> SequenceSample:
    """Items of ``group`` consecutive (prompt, answer) pairs each; answers end with EOS."""
    toks, pmask, lens = [], [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt).input_ids
        a = tokenizer(answer).input_ids + [tokenizer.eos_token_id]
        toks += p + a
        pmask += [True] * len(p) + [False] * len(a)
        lens.append(len(p) + len(a))
    n_items = len(pairs) // group
    per_item = [lens[i * group : (i + 1) * group] for i in range(n_items)]
    meta = {} if solutions is None else {"solutions": solutions}
    return SequenceSample.from_default(
        ids=ids or [f"q{i}" for i in range(n_items)],
        seqlens=per_item,
        data={
            "packed_input_ids": torch.tensor(toks, dtype=torch.long),
            "prompt_mask": torch.tensor(pmask, dtype=torch.bool),
        },
        metadata=meta,
    )


@pytest.fixture
def pa_sample(tokenizer):
    """``pa_sample(pairs, group=1, ids=None, solutions=None)``: see ``prompt_answer_sample``."""
    return lambda pairs, **kw: prompt_answer_sample(tokenizer, pairs, **kw)
