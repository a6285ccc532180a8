"""Fixtures for the generation engine tests: tiny qwen2 checkpoints with the embedded tokenizer."""

from __future__ import annotations

import os
import shutil
from typing import List

import pytest
import torch
from tiny_models import make_tiny_hf_model

from realhf.impl.model import ReaLModel

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "realhf", "assets", "tiny")
VOCAB = 268  # the embedded tokenizer's size
EOS, PAD = 0, 1


def make_model_dir(path, *, seed: int, tokenizer: bool = True) -> str:
    """A tiny qwen2 checkpoint whose greedy outputs vary (large weight noise)."""
    make_tiny_hf_model(
        "qwen2",
        path,
        seed=seed,
        perturb=0.3,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_position_embeddings=512,
    )
    if tokenizer:
        for f in [os.path.join(ASSETS, f) for f in TOKENIZER_FILES]:
            shutil.copy(f, path)
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("gen_model"), seed=0)


@pytest.fixture(scope="session")
def model_dir_b(tmp_path_factory) -> str:
    """The same architecture with other weights (weight-update tests)."""
    return make_model_dir(tmp_path_factory.mktemp("gen_model_b"), seed=1)


@pytest.fixture(scope="session")
def model_dir_no_tokenizer(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("gen_model_notok"), seed=0, tokenizer=False)


def load(model_dir: str) -> ReaLModel:
    return ReaLModel.from_hf(model_dir).eval()


@torch.no_grad()
def reference_greedy(model, prompt: List[int], n: int, stop=()) -> List[int]:
    """Greedy decoding one token at a time with full forwards (no cache)."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32))
        t = int(logits[-1].argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


@torch.no_grad()
def recompute_logprobs(model, prompt: List[int], output: List[int], temperature: float = 1.0):
    """log p(output[i] | prompt + output[:i]) under logits / temperature, from one forward."""
    ids = list(prompt) + list(output)
    logits = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32)).float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0]
