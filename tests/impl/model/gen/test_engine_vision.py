"""The built-in generation engine with images: greedy answers equal HF's ``generate``."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VL_TOKENS, make_tiny_vl_model

from realhf.api.core.data_api import VisionInputs
from realhf.api.core.gen_api import GenerateRequest, InvalidRequestError, SamplingParams
from realhf.impl.model.gen.engine import GenerationEngine
from realhf.impl.model.gen.engine_config import EngineConfig
from realhf.impl.model.nn.real_model import ReaLModel

IMG, VS, VE = (VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id",
                                      "vision_end_token_id"))  # fmt: skip
EOS = 1
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    # Larger weights than the default perturbation: greedy answers then vary with the image.
    return make_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl_gen"), perturb=0.2, seed=3)


def _prompt(grids, g):
    ids = torch.randint(2, 100, (3,), generator=g).tolist()
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE]
    ids += torch.randint(2, 100, (2,), generator=g).tolist()
    pix = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)
    return ids, VisionInputs(pix, torch.tensor(grids, dtype=torch.long).view(-1, 3))


def _hf_greedy(hf, ids, images, n):
    kw = {}
    if images.n_images:
        kw = dict(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
    mm = torch.tensor([[int(t == IMG) for t in ids]])
    out = hf.generate(input_ids=torch.tensor([ids]), mm_token_type_ids=mm, max_new_tokens=n,
                      do_sample=False, **kw)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_greedy_answers_with_images_equal_hf_generate(vl_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # (fixed-length answers, as ignore_eos)
    hf.generation_config.pad_token_id = 0
    # The engine bans the vision tokens from sampling; so does HF here, via bad_words_ids.
    hf.generation_config.bad_words_ids = [[t] for t in VL_TOKENS.values()]
    model = ReaLModel.from_hf(vl_dir).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [_prompt([[1, 4, 6], [1, 2, 2]], g), _prompt([[1, 6, 4]], g), _prompt([], g)]
    engine = GenerationEngine(model, EngineConfig(max_running_requests=4, context_length=128))
    engine.start()
    try:
        reqs = [GenerateRequest(ids, GREEDY, images=im if im.n_images else None)
                for ids, im in prompts]  # fmt: skip
        # A second request of the first prompt (one images object: prefilled once).
        reqs.append(GenerateRequest(prompts[0][0], GREEDY, images=reqs[0].images))
        outs = engine.generate(reqs, timeout=120)
    finally:
        engine.close()
    answers = [list(o.output_ids) for o in outs]
    for (ids, im), got in zip(prompts, answers):
        assert got == _hf_greedy(hf, ids, im, 12)
    assert answers[3] == answers[0]
    # The images steer the answers (a different image, a different answer for this model).
    assert answers[0] != answers[1] or answers[1] != answers[2]


def test_requests_whose_images_do_not_match_are_refused(vl_dir, tiny_hf_dir):
    model = ReaLModel.from_hf(vl_dir).eval()
    engine = GenerationEngine(model, EngineConfig(max_running_requests=2, context_length=64))
    g = torch.Generator().manual_seed(1)
    ids, images = _prompt([[1, 4, 4]], g)
    with pytest.raises(InvalidRequestError, match="images: .*needs 4 consecutive"):
        engine.check_request(GenerateRequest(ids[:-4] + ids[-2:], GREEDY, images=images))
    with pytest.raises(InvalidRequestError, match="more image placeholders"):
        engine.check_request(GenerateRequest(ids, GREEDY))
    text = GenerationEngine(
        ReaLModel.from_hf(tiny_hf_dir("qwen2")).eval(),
        EngineConfig(max_running_requests=2, context_length=64),
    )
    with pytest.raises(InvalidRequestError, match="no vision tower"):
        text.check_request(GenerateRequest([1, 2, 3], GREEDY, images=images))
