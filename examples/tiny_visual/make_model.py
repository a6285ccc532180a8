"""Write the tiny vision-language model that the visual task's SFT starts from.

    python examples/tiny_visual/make_model.py --out /tmp/tiny-visual-init

The language model is the embedded tiny arithmetic model (realhf/assets/tiny: qwen2,
hidden 256, 4 layers, already able to answer ``Compute 37+48.``), its vocabulary grown by
the four vision tokens; the vision tower is new and random: a Qwen2.5-VL ViT of 2 blocks,
width 64 (4 heads), patches of 14 px merged 2x2 into one language-model token, windows of
56 px in block 0 and full attention in block 1.  M-RoPE sections (8, 12, 12) are
Qwen2.5-VL's (16, 24, 24) for half its head width.  So the SFT's job is to teach the
tower to read the rendered problem and the language model to read the tower.

Written next to the weights: the tokenizer (the tiny one plus ``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, ids 268-271), a chat template
that renders an image part of a message as ``<|vision_start|><|image_pad|><|vision_end|>``
and the HF image processor's config (Qwen2-VL's, with ``min_pixels`` low enough that the
28-px-high problem images are not upscaled).  Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TEXT_MODEL = os.path.join(ROOT, "realhf", "assets", "tiny")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: an image part of a chat message renders as this
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}" + IMAGE_PLACEHOLDER +
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)  # fmt: skip
#: the image processor: 14-px patches, 2x2 merge, 2 frames per patch (an image repeated),
#: and sizes kept as they are between 28x28 and 28x28x64 pixels
IMAGE_PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2,
                       min_pixels=28 * 28, max_pixels=28 * 28 * 64)  # fmt: skip


def write_tokenizer(out: str) -> dict:
    """The tiny tokenizer plus the vision tokens in ``out``; returns their ids."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(os.path.join(TEXT_MODEL, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(TEXT_MODEL, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["extra_special_tokens"] = list(VISION_TOKENS)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    shutil.copy2(os.path.join(TEXT_MODEL, "special_tokens_map.json"), out)
    return {t: tok.token_to_id(t) for t in VISION_TOKENS}


def write_image_processor(out: str) -> None:
    """Qwen2-VL's image processor config (the PIL backend needs no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(out)


def make_model(out: str, seed: int = 1) -> str:
    """Write the untrained tiny VLM to ``out``; returns ``out``."""
    from realhf.impl.model.conversion.hf import config_from_hf_dir
    from realhf.impl.model.nn.model_config import VisionConfig
    from realhf.impl.model.nn.real_model import ReaLModel

    os.makedirs(out, exist_ok=True)
    ids = write_tokenizer(out)
    write_image_processor(out)
    text_cfg = config_from_hf_dir(TEXT_MODEL)
    text = ReaLModel.from_hf(TEXT_MODEL)
    vision = VisionConfig(
        depth=2, hidden_dim=64, n_heads=4, intermediate_dim=128, out_dim=text_cfg.hidden_dim,
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
        fullatt_block_indexes=(1,),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    cfg = dataclasses.replace(
        text_cfg,
        family="qwen2_5_vl",
        vocab_size=text_cfg.vocab_size + len(VISION_TOKENS),
        vision=vision,
        mrope_section=(8, 12, 12),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ReaLModel(cfg)
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in text.named_parameters():
            if name == "0.wte.weight":  # the new rows keep their random start
                mine[name][: p.shape[0]].copy_(p)
            else:
                mine[name].copy_(p)
    model.save_hf(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    make_model(args.out, args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
