"""ReaLModel <-> HuggingFace directories: config, weights, tokenizer files.

Used through :meth:`ReaLModel.from_hf`, :meth:`ReaLModel.load_hf_weights` and
:meth:`ReaLModel.save_hf`.  Every failure names the file and, for weights, the
parameter: a missing ``config.json``, an unsupported ``model_type`` or option, a
missing weight file or shard, a missing tensor, a tensor of the wrong shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from typing import Any, Dict, Optional, Union

import torch

from realhf.impl.model.conversion.checkpoint import (
    SHARD_BYTES,
    CheckpointReader,
    remove_weight_files,
    write_safetensors,
)
from realhf.impl.model.conversion.families import family_of_hf_config, get_family
from realhf.impl.model.conversion.hf_config import CheckpointError
from realhf.impl.model.nn.model_config import ReaLModelConfig

logger = logging.getLogger("realhf.model.conversion")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    # Not a tokenizer file, but it names the EOS ids generation stops at: it travels with
    # the tokenizer so a saved directory generates like the source.
    "generation_config.json",
    # A vision-language model's image processor: its prompts cannot be built without it.
    "preprocessor_config.json",
    "processor_config.json",
)

# Prefixes some checkpoints of a family omit (old gpt2 files have "h.0...").
_OPTIONAL_PREFIXES = ("transformer.",)


def read_config_json(model_dir: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The raw config.json of a HF directory."""
    path = os.path.join(str(model_dir), "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path}: not found; {model_dir} is not a HuggingFace model directory"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e


def config_from_hf_dir(
    model_dir: Union[str, os.PathLike], is_critic: bool = False
) -> ReaLModelConfig:
    """Our config for the model in ``model_dir`` (family from config.json)."""
    import transformers

    path = os.path.join(str(model_dir), "config.json")
    raw = read_config_json(model_dir)
    fam = family_of_hf_config(raw, path)
    if fam.critic_arch in (raw.get("architectures") or []) and not is_critic:
        raise CheckpointError(
            f"{path}: {fam.critic_arch} is a critic (value-head) checkpoint; load it "
            "with is_critic=True"
        )
    try:
        hf = transformers.AutoConfig.from_pretrained(str(model_dir))
    except Exception as e:
        raise CheckpointError(f"{path}: transformers cannot parse this config ({e})") from e
    return fam.config_from_hf(hf, path, is_critic)


def _diff_fields(a: ReaLModelConfig, b: ReaLModelConfig):
    skip = {"hf_extra", "init_std"}
    return [
        f"{f.name}: model has {getattr(a, f.name)!r}, checkpoint has {getattr(b, f.name)!r}"
        for f in dataclasses.fields(a)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    ]


def load_weights(model, model_dir: Union[str, os.PathLike], *, check_config: bool) -> None:
    """Copy the weights of ``model_dir`` into ``model``'s flat buffer in place.

    Args:
        model: a ``ReaLModel``.
        check_config: compare the directory's architecture with the model's
            first (``load_hf_weights``); ``from_hf`` built the model from it.
            A critic model built by ``from_hf`` from a causal-LM checkpoint
            gets a freshly initialised value head; ``load_hf_weights`` requires
            the value head in the checkpoint.
    """
    cfg: ReaLModelConfig = model.config
    model_dir = str(model_dir)
    if check_config:
        theirs = config_from_hf_dir(model_dir, is_critic=cfg.is_critic)
        diff = _diff_fields(cfg, theirs)
        if diff:
            raise CheckpointError(
                f"{os.path.join(model_dir, 'config.json')}: architecture differs from the "
                f"model's, cannot load weights in place: {'; '.join(diff)}"
            )
    fam = get_family(cfg.family)
    reader = CheckpointReader(model_dir)
    params = dict(model.named_parameters())
    rules = fam.converter.weight_rules(cfg)
    if cfg.is_critic:
        head_rules = fam.critic_head_rules(cfg)
        # A causal-LM checkpoint has no value head: from_hf starts a fresh one (the usual
        # PPO start, critic from the actor's checkpoint). load_hf_weights replaces the
        # weights of a built critic, so there a missing head is an error (via the rules).
        if reader.resolve(head_rules[0].hf_name) is not None or check_config:
            rules = rules + head_rules
        else:
            _init_value_head(model)
            logger.info("%s has no value head; initialised a new one", model_dir)
    with torch.no_grad():
        for rule in rules:
            key = reader.resolve(rule.hf_name, _OPTIONAL_PREFIXES)
            if key is None:
                raise CheckpointError(
                    f"{model_dir}: parameter {rule.hf_name!r} (-> {', '.join(rule.ours)}) is "
                    f"missing from the weight files ({reader.describe()})"
                )
            t = reader.get(key)
            if tuple(t.shape) != rule.hf_shape:
                raise CheckpointError(
                    f"{reader.file_of(key)}: parameter {key!r} has shape {tuple(t.shape)}, "
                    f"expected {rule.hf_shape} from config.json"
                )
            for name, value in zip(rule.ours, rule.to_ours(t)):
                params[name].copy_(value)


def _init_value_head(model) -> None:
    head = model.head
    with torch.no_grad():
        head.weight.normal_(0.0, model.config.init_std)
        head.bias.zero_()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def save(
    model,
    model_dir: Union[str, os.PathLike],
    *,
    tokenizer=None,
    max_shard_bytes: Optional[int] = None,
) -> None:
    """Write ``model`` as a HuggingFace directory (see ``ReaLModel.save_hf``).

    Existing weight files in ``model_dir`` are removed first so no stale shard
    of an earlier save can be picked up by a loader.
    """
    import transformers

    cfg: ReaLModelConfig = model.config
    model_dir = str(model_dir)
    fam = get_family(cfg.family)
    kwargs = fam.config_to_hf_kwargs(cfg)
    hf_config = transformers.AutoConfig.for_model(fam.model_type, **kwargs)
    hf_config.dtype = _dtype_name(model.dtype)  # what loaders take as the default dtype
    os.makedirs(model_dir, exist_ok=True)
    remove_weight_files(model_dir)

    params = {n: p.detach() for n, p in model.named_parameters()}
    elem = model.flat_params.element_size()

    def maker(rule):
        # clone(): the parameters are views of one buffer, and safetensors
        # refuses tensors that share storage.
        return lambda: rule.to_hf([params[n] for n in rule.ours]).to("cpu").clone()

    # Sizes up front and tensors on demand: the writer plans the shards first and then
    # materialises one shard at a time.
    entries = [
        (rule.hf_name, math.prod(rule.hf_shape) * elem, maker(rule))
        for rule in fam.weight_rules(cfg)
    ]
    write_safetensors(model_dir, entries, max_shard_bytes or SHARD_BYTES)
    hf_config.save_pretrained(model_dir)
    if tokenizer is not None:
        save_tokenizer(tokenizer, model_dir)


def save_tokenizer(tokenizer, model_dir: str) -> None:
    """Save a tokenizer object, or copy the tokenizer files of a directory."""
    if isinstance(tokenizer, (str, os.PathLike)):
        src = str(tokenizer)
        if not os.path.isdir(src):
            raise CheckpointError(f"tokenizer directory {src} does not exist")
        copied = []
        for name in TOKENIZER_FILES:
            p = os.path.join(src, name)
            if os.path.isfile(p) and os.path.abspath(src) != os.path.abspath(model_dir):
                shutil.copy2(p, os.path.join(model_dir, name))
                copied.append(name)
        if not copied and os.path.abspath(src) != os.path.abspath(model_dir):
            raise CheckpointError(
                f"tokenizer directory {src} holds none of the tokenizer files {TOKENIZER_FILES}"
            )
    elif hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(model_dir)
    else:
        raise TypeError(
            f"tokenizer must be a directory path or an object with save_pretrained, got "
            f"{type(tokenizer).__name__}"
        )
