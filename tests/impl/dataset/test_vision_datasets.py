"""Datasets whose rows have images: placeholders expanded, image keys per item, errors per row."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from tiny_models import make_tiny_visual_model

from realhf.api.core.data_api import (
    IMAGE_KEYS,
    SequenceSample,
    images_per_sequence,
    vision_inputs_of,
)
from realhf.impl.dataset.images import ImageError, VisionProcessor, image_to_data_url
from realhf.impl.dataset.math_dataset import MathPromptDataset
from realhf.impl.dataset.sft_dataset import PromptAnswerDataset
from realhf.impl.model.gen.loading import load_tokenizer

PH = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_visual_model(tmp_path_factory.mktemp("tiny_visual"))


@pytest.fixture(scope="module")
def tok(vl_dir):
    return load_tokenizer(vl_dir)


def _image(w, h, v=0):
    return Image.new("RGB", (w, h), (v, 255 - v, 128))


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _row(qid, images, n_placeholders=None):
    n = len(images) if n_placeholders is None else n_placeholders
    return {"query_id": qid, "prompt": PH * n + "Compute.", "images": images,
            "task": "math", "solutions": ["\\boxed{1}"]}  # fmt: skip


def test_rows_with_images_expand_placeholders_and_carry_pixels(tmp_path, tok, vl_dir):
    _image(56, 28).save(tmp_path / "a.png")
    rows = [
        _row("two", ["a.png", image_to_data_url(_image(84, 56, 9))]),  # a path, a data URL
        _row("none", []),
    ]
    ds = MathPromptDataset(_write(tmp_path / "d.jsonl", rows), tok)
    proc = VisionProcessor.from_model_dir(vl_dir)
    img = proc.image_token_id
    two, none = ds[0], ds[1]
    assert IMAGE_KEYS[0] in two.keys and IMAGE_KEYS[0] in none.keys
    assert two.data["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 6]]
    assert two.seqlens["pixel_values"] == [[8 + 24]]
    assert two.data["pixel_values"].shape == (32, 3 * 2 * 14 * 14)
    ids = two.data["packed_prompts"].tolist()
    assert ids.count(img) == 2 + 6  # 8 patches -> 2 tokens, 24 -> 6
    assert none.seqlens["pixel_values"] == [[0]] and none.data["image_grid_thw"].shape == (0, 3)
    # Items with and without images batch together; the images follow their sequences.
    batch = SequenceSample.gather([two, none])
    assert batch.data["image_grid_thw"].shape == (2, 3)
    # (ds.items keep no pixels: they are read again for each use)
    assert IMAGE_KEYS[0] not in ds.items[0].keys


def test_sft_rows_mask_the_expanded_prompt(tmp_path, tok):
    row = {"id": "a", "prompt": PH + "Compute.", "answer": "\\boxed{3}",
           "images": [image_to_data_url(_image(56, 28))]}  # fmt: skip
    ds = PromptAnswerDataset(_write(tmp_path / "s.jsonl", [row]), tok)
    item = ds[0]
    n_prompt = len(tok(PH + "Compute.", add_special_tokens=False)["input_ids"]) + 1  # +1 token
    assert int(item.data["prompt_mask"].sum()) == n_prompt
    assert item.data["image_grid_thw"].tolist() == [[1, 2, 4]]


@pytest.mark.parametrize(
    "row, match",
    [
        (_row("q1", ["missing.png"]), r"query_id q1\).*images\[0\].*does not exist"),
        (_row("q2", ["data:image/png;base64,AAAA"], 1), r"query_id q2\).*images\[0\]"),
        (_row("q3", [], 1) | {"images": ["data:image/png;base64,"]}, r"query_id q3"),
        (_row("q4", ["x.png"], 2), r"query_id q4\): holds 2 image placeholders .* for 1 images"),
    ],
)
def test_bad_images_fail_the_load_naming_the_row(tmp_path, tok, row, match):
    _image(56, 28).save(tmp_path / "x.png")
    with pytest.raises(ImageError, match=match):
        MathPromptDataset(_write(tmp_path / "d.jsonl", [row]), tok)


def test_images_for_a_text_model_are_refused(tmp_path):
    from realhf.impl.dataset.math_dataset import MathPromptDataset as DS

    text = load_tokenizer("realhf/assets/tiny")
    with pytest.raises(ImageError, match="not a vision-language model"):
        DS(_write(tmp_path / "d.jsonl", [_row("q", [image_to_data_url(_image(28, 28))])]), text)


def test_images_follow_each_sequence_of_an_item(tmp_path, tok):
    rows = [_row("a", [image_to_data_url(_image(56, 28))]), _row("b", [])]
    ds = MathPromptDataset(_write(tmp_path / "d.jsonl", rows), tok)
    a, b = ds[0], ds[1]
    # Two answers for a, three for b, as a generate MFC outputs them.
    sample = SequenceSample.from_default(
        ids=["a", "b"],
        seqlens=[[5, 6], [4, 4, 4]],
        data={"packed_input_ids": torch.zeros(23, dtype=torch.long)},
    )
    sample.update_(SequenceSample.gather([a, b]).select(IMAGE_KEYS))
    vi = vision_inputs_of(sample)
    assert vi.slot_grids.tolist() == [[1, 2, 4]] * 2  # a's image for each of its answers
    assert vi.grid_thw.tolist() == [[1, 2, 4]] and vi.index.tolist() == [0, 0]  # stored once
    assert torch.equal(vi.pixel_values, a.data["pixel_values"])
    per_seq = images_per_sequence(sample, [f"s{i}" for i in range(5)])
    assert per_seq.seqlens["image_grid_thw"] == [[1], [1], [0], [0], [0]]
    # One item per sequence (as PPO trains): the copies are found equal and stored once.
    again = vision_inputs_of(_with(per_seq))
    assert again.grid_thw.shape[0] == 1 and again.index.tolist() == [0, 0]


def _with(images):
    """``images`` (one item per sequence) beside 5 sequences of tokens."""
    s = SequenceSample.from_default(
        ids=list(images.ids),
        seqlens=[[5], [6], [4], [4], [4]],
        data={"packed_input_ids": torch.zeros(23, dtype=torch.long)},
    )
    s.update_(images)
    return s
