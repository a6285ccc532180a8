"""Build a generation engine (and its tokenizer, if any) from a HuggingFace directory."""

from __future__ import annotations

import json
import os
import threading
from typing import List, Optional, Tuple

from realhf.impl.model.gen.engine import GenerationEngine
from realhf.impl.model.gen.engine_config import EngineConfig

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _ids(value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def has_tokenizer(model_dir: str) -> bool:
    """Whether ``model_dir`` holds tokenizer files."""
    return any(os.path.exists(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str):
    """The directory's tokenizer (``AutoTokenizer``), or ``None`` when it has none."""
    if not has_tokenizer(model_dir):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def special_token_ids(model_dir: str, tokenizer=None) -> Tuple[List[int], Optional[int]]:
    """``(eos_ids, pad_id)`` from generation_config.json, config.json and the tokenizer.

    Every EOS id any of them names is a default stop token; so is the pad id.
    """
    # Sources disagree: generation_config.json often lists several ids (chat turn end and
    # end-of-text) where config.json and the tokenizer name one. Stopping at any of them
    # is what transformers' generate() does with the generation config.
    eos: List[int] = []
    pad: Optional[int] = None
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(os.path.join(model_dir, name))
        eos += _ids(cfg.get("eos_token_id"))
        if pad is None and cfg.get("pad_token_id") is not None:
            pad = int(cfg["pad_token_id"])
    if tokenizer is not None:
        eos += _ids(tokenizer.eos_token_id)
        if pad is None and tokenizer.pad_token_id is not None:
            pad = int(tokenizer.pad_token_id)
    return sorted(set(eos)), pad


def load_engine(
    model_dir: str, config: EngineConfig, tokenizer=None, lora=None
) -> GenerationEngine:
    """Load a ReaLModel from ``model_dir`` (a HuggingFace directory, or a PEFT LoRA adapter
    directory: its base with the adapters) and wrap it in a (not yet started) engine.

    ``lora`` (a :class:`~realhf.api.cli_args.LoraConfig`): serve with fresh adapters of
    that shape (they change nothing until an update brings the trained ones; every weight
    update then carries the adapters alone).

    The loading runs on a short-lived thread of its own.  Any thread that runs torch's
    parallel ops keeps a team of OpenMP threads, and with the engine thread's team on top
    there would be more of them than cores: GNU OpenMP then lets idle threads sleep between
    parallel regions, and each of the thousands of ops of a decode step waits to wake one
    (0.5B in bf16 with 2 threads on 2 cores: 49-53 ms a step against 40-42 ms).  The
    loading thread's team ends with it, so the engine thread's is the only one left."""
    box: dict = {}

    def load() -> None:
        try:
            box["engine"] = _load_engine(model_dir, config, tokenizer, lora)
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    loader = threading.Thread(target=load, name="model-load", daemon=True)
    loader.start()
    loader.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


def _load_engine(model_dir: str, config: EngineConfig, tokenizer, lora) -> GenerationEngine:
    from realhf.impl.model import ReaLModel
    from realhf.impl.model.nn.lora import adapter_base, add_lora, is_adapter_dir

    adapters = is_adapter_dir(model_dir)
    if not adapters and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(
            f"{model_dir!r} is not a HuggingFace model directory (no config.json); "
            "pass the directory that holds config.json and the safetensors weights"
        )
    model = ReaLModel.from_hf(model_dir, dtype=config.torch_dtype, device=config.torch_device)
    if lora is not None and model.lora is None:
        add_lora(model, lora)
    model.eval()
    eos, pad = special_token_ids(adapter_base(model_dir) if adapters else model_dir, tokenizer)
    return GenerationEngine(model, config, eos_token_ids=eos, pad_token_id=pad)
