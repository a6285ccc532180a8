"""Write a random HuggingFace model of a real model's shape, with the embedded tokenizer.

    python -m realhf.apps.make_model --shape qwen2.5-0.5b OUT_DIR [--layers N] [--dtype float32]
    python -m realhf.apps.make_model --list

Users bring 0.5B-7B models with vocabularies of 128k-152k; the embedded task's model has 4M
parameters and 268 tokens.  A directory written here has a real model's exact shape (hidden
and MLP widths, layers, heads, KV heads, vocabulary, tied head, RoPE) with random weights, so
every memory and time term of the real model can be rehearsed without a download: point
``actor.path`` (or ``realhf.apps.serve --model-path``, or a benchmark) at it.

The tokenizer is the embedded task's (268 tokens): prompts encode to ids far below the
vocabulary, and generated ids it lacks decode to nothing (fast tokenizers skip unknown ids),
so the whole pipeline runs; the EOS and pad ids are the tokenizer's, so answers can end.
Such a model answers nothing correctly: use it for speed and memory, not for learning.

``--layers N`` keeps every width and cuts the depth (fast tests of the vocabulary-sized
terms); the weights are drawn with ``--seed`` (the same directory for the same arguments).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional

import realhf

#: the embedded task's model directory, whose tokenizer files every shape gets
TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(realhf.__file__)), "assets", "tiny")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A released model's architecture, as its HuggingFace ``config.json`` gives it."""

    model_type: str  # transformers' name of the family (qwen2, qwen3, llama)
    architecture: str  # the ForCausalLM class
    params: str  # what the released model has, for --list
    fields: Dict[str, Any]
    #: the embedded asset directory whose tokenizer (and image processor) the shape gets
    tokenizer: str = "tiny"


# Public config.json fields of each released model (architecture only: no weights).
SHAPES: Dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(
        "qwen2", "Qwen2ForCausalLM", "494M",
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=32768),
    ),
    "qwen2.5-1.5b": Shape(
        "qwen2", "Qwen2ForCausalLM", "1.54B",
        dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=32768),
    ),
    "qwen3-0.6b": Shape(
        "qwen3", "Qwen3ForCausalLM", "596M",
        dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=40960),
    ),
    "llama3.2-1b": Shape(
        "llama", "LlamaForCausalLM", "1.24B",
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
             tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
             max_position_embeddings=131072,
             rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=8192)),
    ),
    # Qwen2.5-VL-3B's language model and vision tower; its vision token ids are the embedded
    # visual task's tokenizer's (which the directory gets), not the released 151652-151656.
    "qwen2.5-vl-3b": Shape(
        "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "3.75B",
        dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
             num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
             tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=128000,
             rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                  mrope_section=[16, 24, 24]),
             vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                num_heads=16, out_hidden_size=2048, patch_size=14,
                                spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                                hidden_act="silu")),
        tokenizer="tiny_visual",
    ),
}  # fmt: skip

#: the vision token ids a vision-language shape takes from its tokenizer directory
_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id",
                  "vision_end_token_id")  # fmt: skip
#: files of a vision-language shape's asset directory it gets beside the tokenizer's
VISION_FILES = ("preprocessor_config.json",)


def _tokenizer_dir(shape: str) -> str:
    return os.path.join(os.path.dirname(TOKENIZER_DIR), SHAPES[shape].tokenizer)


def _special_ids(shape: str = "qwen2.5-0.5b") -> Dict[str, int]:
    """bos/eos/pad ids (and a vision shape's vision token ids) of the shape's embedded
    tokenizer, from its directory's config.json."""
    with open(os.path.join(_tokenizer_dir(shape), "config.json")) as f:
        cfg = json.load(f)
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    if "text_config" in cfg:  # (a vision-language config keeps them there)
        ids.update({k: cfg["text_config"][k] for k in ("bos_token_id", "eos_token_id",
                                                      "pad_token_id")})  # fmt: skip
        ids.update({k: cfg[k] for k in _VISION_TOKENS})
    return ids


def hf_config(shape: str, layers: Optional[int] = None, dtype: str = "bfloat16"):
    """The transformers config of ``shape`` (``layers`` to cut its depth)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    s = SHAPES[shape]
    fields = dict(s.fields)
    if layers is not None:
        if layers < 1 or layers > fields["num_hidden_layers"]:
            raise ValueError(
                f"--layers {layers}: give 1..{fields['num_hidden_layers']} (the depth of {shape})"
            )
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(
        s.model_type, architectures=[s.architecture], dtype=dtype, **fields, **_special_ids(shape)
    )


def build_hf_model(config, **kwargs):
    """The transformers model of ``config`` (a vision-language config is no causal LM's)."""
    import transformers

    if config.model_type == "qwen2_5_vl":
        return transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs)


def make_model(
    shape: str,
    out_dir: str,
    *,
    layers: Optional[int] = None,
    dtype: str = "bfloat16",
    seed: int = 1,
    overwrite: bool = False,
) -> str:
    """Write the random model of ``shape`` to ``out_dir``; return ``out_dir``."""
    import torch

    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"--dtype {dtype!r}: give bfloat16, float16 or float32")
    config = hf_config(shape, layers, dtype)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass --overwrite to replace)")
    # Built without storage, then drawn here in the target dtype: transformers' own init
    # takes ~7x as long (a 152k x 896 embedding: 17 s against 2.5 s).  Matrices
    # N(0, initializer_range), norm weights 1, biases 0, as transformers initialises them.
    text = config.get_text_config()
    with torch.device("meta"):
        model = build_hf_model(config, dtype=getattr(torch, dtype))
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives a tied head storage of its own: share it again
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head is listed once
            if p.dim() > 1:
                p.normal_(0.0, text.initializer_range, generator=gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok_dir = _tokenizer_dir(shape)
    for name in TOKENIZER_FILES + (VISION_FILES if tok_dir != TOKENIZER_DIR else ()):
        shutil.copy(os.path.join(tok_dir, name), out_dir)
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(out_dir, "shape.json"), "w") as f:
        json.dump({"shape": shape, "layers": text.num_hidden_layers, "dtype": dtype,
                   "seed": seed, "parameters": n}, f, indent=1)  # fmt: skip
    return out_dir


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m realhf.apps.make_model", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("out_dir", nargs="?", help="directory to write (a HuggingFace model dir)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="the released model to copy")
    ap.add_argument("--layers", type=int, help="keep only this many layers (all widths kept)")
    ap.add_argument("--dtype", default="bfloat16", help="weights on disk (default bfloat16)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty out_dir")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            f = s.fields
            print(
                f"{name:14s} {s.params:>6s}  hidden {f['hidden_size']}, MLP "
                f"{f['intermediate_size']}, {f['num_hidden_layers']} layers, heads "
                f"{f['num_attention_heads']}/{f['num_key_value_heads']}, vocab {f['vocab_size']}"
            )
        return 0
    if args.shape is None or args.out_dir is None:
        ap.error("give --shape NAME and OUT_DIR (or --list)")
    try:
        out = make_model(
            args.shape, args.out_dir, layers=args.layers, dtype=args.dtype, seed=args.seed,
            overwrite=args.overwrite,
        )  # fmt: skip
    except (ValueError, FileExistsError) as e:
        print(f"make_model: {e}", file=sys.stderr)
        return 2
    with open(os.path.join(out, "shape.json")) as f:
        info = json.load(f)
    print(f"wrote {args.shape} ({info['parameters'] / 1e6:.0f}M parameters, "
          f"{info['layers']} layers, {args.dtype}) to {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
