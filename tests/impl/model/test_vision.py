"""The vision-language ReaLModel (qwen2_5_vl) against HuggingFace's Qwen2.5-VL."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import VL_TOKENS, make_tiny_vl_model

from realhf.impl.model.conversion.hf_config import UnsupportedCheckpoint
from realhf.impl.model.nn.real_model import ReaLModel, packed_position_ids
from realhf.impl.model.nn.vision import VisionInputs, mrope_positions, window_order

IMG, VS, VE = (VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id",
                                      "vision_end_token_id"))  # fmt: skip
PATCH_DIM = 3 * 2 * 14 * 14

# (images as [t, h, w] patch grids, text lengths around them): two sizes (and shapes)
# in one sequence, a text-only one, one whose image ends it, a 1-token-image one.
SEQS = [
    ([[1, 4, 6], [1, 8, 4]], [3, 2, 4]),
    ([], [7]),
    ([[1, 6, 6]], [2, 0]),
    ([[1, 2, 2]], [1, 5]),
]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"))


def _sequence(grids, text_lens, g):
    ids = []
    for grid, n in zip(grids + [None], text_lens):
        ids += torch.randint(0, 100, (n,), generator=g).tolist()
        if grid is not None:
            ids += [VS] + [IMG] * (grid[0] * grid[1] * grid[2] // 4) + [VE]
    pix = torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=g)
    return ids, pix, torch.tensor(grids, dtype=torch.long).view(-1, 3)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [_sequence(grids, lens, g) for grids, lens in SEQS]


def _pack(seqs):
    ids = torch.tensor([t for s in seqs for t in s[0]])
    cu = torch.tensor([0] + [len(s[0]) for s in seqs]).cumsum(0).to(torch.int32)
    images = VisionInputs(torch.cat([s[1] for s in seqs]), torch.cat([s[2] for s in seqs]))
    return ids, cu, images


def _hf_logits(hf, ids, pix, grid):
    kw = dict(pixel_values=pix, image_grid_thw=grid) if grid.shape[0] else {}
    mm = torch.tensor([[int(t == IMG) for t in ids]])
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), mm_token_type_ids=mm, **kw).logits[0]


def test_packed_logits_equal_hf_per_sequence(vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    ours = ReaLModel.from_hf(vl_dir).eval()
    seqs = _batch()
    ids, cu, images = _pack(seqs)
    assert images.n_images == 4
    with torch.no_grad():
        out = ours(ids, cu, images=images)
    ref = torch.cat([_hf_logits(hf, *s) for s in seqs])
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # The images matter: other pixels give other logits after the first placeholder.
    other = VisionInputs(torch.randn_like(images.pixel_values), images.grid_thw)
    with torch.no_grad():
        assert not torch.allclose(ours(ids, cu, images=other), out, atol=1e-3)


def test_windows_cover_every_merge_unit_once():
    from realhf.impl.model.nn.model_config import VisionConfig

    v = VisionConfig(depth=1, hidden_dim=32, n_heads=2, intermediate_dim=8, out_dim=8,
                     image_token_id=0, vision_start_token_id=1, vision_end_token_id=2,
                     video_token_id=3, window_size=56)  # fmt: skip
    grid = torch.tensor([[1, 6, 10], [1, 2, 2]])  # merged 3x5 -> windows 2x2, 2x1, 1x2, 1x1
    order, lengths = window_order(grid, v)
    assert sorted(order.tolist()) == list(range(3 * 5 + 1))
    assert lengths == [16, 16, 8, 8, 8, 4, 4]  # in patches: 4 per merge unit
    assert sum(lengths) == 4 * (15 + 1)


def test_text_positions_are_plain_and_image_positions_are_grids():
    from realhf.impl.model.nn.model_config import VisionConfig

    v = VisionConfig(depth=1, hidden_dim=32, n_heads=2, intermediate_dim=8, out_dim=8,
                     image_token_id=9, vision_start_token_id=7, vision_end_token_id=8,
                     video_token_id=6)  # fmt: skip
    ids = torch.tensor([1, 2, 3, 4, 1, 7, 9, 9, 9, 9, 9, 9, 8, 5])
    cu = torch.tensor([0, 4, 14], dtype=torch.int32)
    p = mrope_positions(ids, cu, torch.tensor([[1, 4, 6]]), v)
    assert p.position_ids[:, :4].tolist() == [[0, 1, 2, 3]] * 3
    second = p.position_ids[:, 4:]
    assert second[:, :2].tolist() == [[0, 1]] * 3
    # a 2x3 grid of merged tokens at offset 2: t fixed, h by rows, w by columns
    assert second[0, 2:8].tolist() == [2] * 6
    assert second[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert second[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    # after the image, text continues from offset + max(h, w) / merge = 2 + 3
    assert second[:, 8:].tolist() == [[5, 6]] * 3
    assert p.deltas == [0, 7 - 10]
    # No images: the packed 1-D positions on all three axes.
    plain = mrope_positions(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]), None, v)
    assert (
        plain.position_ids.tolist()
        == [packed_position_ids(torch.tensor([0, 1, 3]), 3).tolist()] * 3
    )


@pytest.mark.parametrize(
    "ids, grid, match",
    [
        ([7, 9, 9, 9, 8], [[1, 4, 4]], "needs 4 consecutive placeholder"),
        ([7, 9, 9, 9, 9, 8], [], "more image placeholders"),
        ([1, 2, 3], [[1, 2, 2]], "1 images were given but the tokens hold placeholders for 0"),
    ],
)
def test_placeholders_that_do_not_match_the_images_are_refused(ids, grid, match):
    from realhf.impl.model.nn.model_config import VisionConfig

    v = VisionConfig(depth=1, hidden_dim=32, n_heads=2, intermediate_dim=8, out_dim=8,
                     image_token_id=9, vision_start_token_id=7, vision_end_token_id=8,
                     video_token_id=6)  # fmt: skip
    g = torch.tensor(grid, dtype=torch.long).view(-1, 3)
    with pytest.raises(ValueError, match=match):
        mrope_positions(torch.tensor(ids), torch.tensor([0, len(ids)]), g, v)


def test_save_hf_round_trip_loads_in_transformers(vl_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    ours = ReaLModel.from_hf(vl_dir)
    ours.save_hf(tmp_path / "out")
    cfg = json.load(open(os.path.join(tmp_path / "out", "config.json")))
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert cfg["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert cfg["image_token_id"] == IMG
    a = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir).state_dict()
    b = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "out").state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    back = ReaLModel.from_hf(tmp_path / "out")
    assert back.config == ours.config
    assert torch.equal(back.flat_params, ours.flat_params)


def test_images_train_the_tower_and_text_only_batches_leave_it_alone(vl_dir):
    model = ReaLModel.from_hf(vl_dir)
    ids, cu, images = _pack(_batch())
    model(ids, cu, images=images).logsumexp(-1).mean().backward()
    w = model.embedding.visual.patch_embed.weight
    assert w.grad is not None and w.grad.abs().sum() > 0
    model.zero_grad()
    text = torch.tensor([1, 2, 3, 4])
    model(text, torch.tensor([0, 4], dtype=torch.int32)).logsumexp(-1).mean().backward()
    assert w.grad is None or w.grad.abs().sum() == 0


def test_bf16_forward_is_close_to_fp32(vl_dir):
    ids, cu, images = _pack(_batch())
    with torch.no_grad():
        ref = ReaLModel.from_hf(vl_dir).eval()(ids, cu, images=images)
        out = ReaLModel.from_hf(vl_dir, dtype=torch.bfloat16).eval()(ids, cu, images=images)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_images_for_a_text_model_and_vl_critics_are_refused(vl_dir, tiny_hf_dir, tmp_path):
    text = ReaLModel.from_hf(tiny_hf_dir("qwen2"))
    _, _, images = _pack(_batch())
    with pytest.raises(ValueError, match="no vision tower"):
        text(torch.tensor([1, 2]), torch.tensor([0, 2], dtype=torch.int32), images=images)
    critic = ReaLModel.from_hf(vl_dir, is_critic=True)  # a fresh value head on the VLM
    with pytest.raises(UnsupportedCheckpoint, match="no token-classification class"):
        critic.save_hf(tmp_path / "critic")


def test_a_batch_with_and_without_images_packs_and_trains(vl_dir):
    from realhf.api.cli_args import OptimizerConfig
    from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, image_sample
    from realhf.impl.model.backend.train import TrainEngine

    seqs = _batch()  # items with two images, none, one ending the prompt, a 1-token image
    items = []
    for i, (ids, pix, grid) in enumerate(seqs):
        it = SequenceSample.from_default(
            ids=[f"q{i}"], seqlens=[[len(ids)] * 2],  # two answers per prompt, as GRPO
            data={"packed_input_ids": torch.tensor(ids * 2)},
        )  # fmt: skip
        it.update_(image_sample([f"q{i}"], pix, grid, [pix.shape[0]], [grid.shape[0]]))
        items.append(it)
    batch = SequenceSample.gather(items)
    engine = TrainEngine(
        ReaLModel.from_hf(vl_dir), OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1e-8)
    )
    before = engine.model.embedding.visual.patch_embed.weight.detach().clone()

    def loss_fn(logits, mb):
        ids = mb.data["packed_input_ids"].to(logits.device)
        loss = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:])
        return loss, {}

    losses = []
    for _ in range(3):  # micro-batches of two items: mixed and image-only ones
        stats = engine.train_batch(batch, MicroBatchSpec(n_mbs=2), loss_fn, lambda mb: 1.0)
        losses.append(stats["loss"])
    assert losses[-1] < losses[0]
    assert not torch.equal(engine.model.embedding.visual.patch_embed.weight, before)
    # Without its image keys the batch is refused, not read as plain tokens.
    with pytest.raises(ValueError, match="image placeholders .* but no images"):
        engine.train_batch(
            batch.select(["packed_input_ids"]), MicroBatchSpec(), loss_fn, lambda mb: 1.0
        )


def test_an_image_stored_once_and_indexed_equals_it_repeated(vl_dir):
    """Two answers reading one prompt's two images: encoded once (``index``) or twice, the
    same logits and the same gradients."""
    ids, pix, grid = _batch()[0]
    tokens = torch.tensor(ids + ids)
    cu = torch.tensor([0, len(ids), 2 * len(ids)], dtype=torch.int32)
    twice = VisionInputs(torch.cat([pix, pix]), torch.cat([grid, grid]))
    once = VisionInputs(pix, grid, index=torch.tensor([0, 1, 0, 1]))
    assert once.n_images == twice.n_images == 4
    outs, grads = [], []
    for images in (twice, once):
        model = ReaLModel.from_hf(vl_dir)
        out = model(tokens, cu, images=images)
        out.logsumexp(-1).mean().backward()
        outs.append(out.detach())
        grads.append(model.embedding.visual.patch_embed.weight.grad.clone())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_shared_prompts_with_images_equal_the_full_pack(vl_dir):
    """Three answers to each of two prompts with images, and a third prompt with the first
    one's tokens but other pixels: computed with each prompt once (its images encoded once)
    the logits and gradients are the full pack's; the look-alike prompt is not shared."""
    from realhf.api.core.data_api import SequenceSample, image_sample, vision_inputs_of
    from realhf.impl.model.modules.shared_prefix import SharedPrefix, prompt_lengths

    g = torch.Generator().manual_seed(5)
    items = []
    prompts = [_sequence([[1, 4, 6]], [3, 2], g), _sequence([[1, 2, 2], [1, 2, 4]], [1, 1, 2], g)]
    ids0, pix0, grid0 = prompts[0]
    prompts.append((ids0, torch.randn(pix0.shape, generator=g), grid0))  # same tokens
    for i, (ids, pix, grid) in enumerate(prompts):
        answers = [torch.randint(0, 100, (4 + j,), generator=g).tolist() for j in range(3)]
        seqs = [ids + a for a in answers]
        item = SequenceSample.from_default(
            ids=[f"p{i}"], seqlens=[[len(s) for s in seqs]],
            data={"packed_input_ids": torch.tensor([t for s in seqs for t in s]),
                  "prompt_mask": torch.tensor([t < len(ids) for s in seqs
                                               for t in range(len(s))])},
        )  # fmt: skip
        item.update_(image_sample([f"p{i}"], pix, grid, [pix.shape[0]], [grid.shape[0]]))
        items.append(item)
    batch = SequenceSample.gather(items)
    tokens, cu = batch.data["packed_input_ids"], batch.cu_seqlens("packed_input_ids")
    images = vision_inputs_of(batch)
    assert images.grid_thw.shape[0] == 4  # 1 + 2 + the look-alike's 1, however many answers
    bounds = cu.tolist()
    sp = SharedPrefix.from_prompts(
        tokens, bounds, prompt_lengths(batch.data["prompt_mask"], bounds), images.seq_images
    )
    assert sp.keeps_prompt == [True, False, False] * 3  # the look-alike leads its own group
    outs, grads = [], []
    for shared in (None, sp):
        model = ReaLModel.from_hf(vl_dir)
        out = model(tokens, cu, images=images, shared_prefix=shared)
        out.logsumexp(-1).mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4)


def test_lora_adapters_of_a_vlm_load_in_peft_and_leave_the_tower_alone(vl_dir, tmp_path):
    """save_peft names a VLM's adapters by transformers' module paths (the language model is
    ``model.language_model``) and excludes the tower, whose MLP names the targets match:
    HF + PEFT then compute our logits with images."""
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from realhf.api.cli_args import LoraConfig
    from realhf.impl.model.nn.lora import add_lora, save_peft

    model = ReaLModel.from_hf(vl_dir).eval()
    add_lora(model, LoraConfig(rank=4, alpha=8.0), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for n, p in model.lora.params.items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    save_peft(model, str(tmp_path / "adapter"), base_model_path=vl_dir)
    seqs = _batch()[:1]
    ids, pix, grid = seqs[0]
    with torch.no_grad():
        ours = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32),
                     images=VisionInputs(pix, grid))  # fmt: skip
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        assert not [n for n, _ in peft.named_modules() if ".visual." in n and "lora" in n]
        assert [n for n, _ in peft.named_modules() if "language_model" in n and "lora_A" in n]
        theirs = _hf_logits(peft, ids, pix, grid)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
