"""Images through the HTTP server: SGLang's ``image_data`` and OpenAI ``image_url`` parts."""

from __future__ import annotations

import openai
import pytest
import requests
from PIL import Image
from tiny_models import make_tiny_visual_model

from realhf.api.core.data_api import VisionInputs
from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.base.net.http_server import ServerThread
from realhf.impl.dataset.images import VisionProcessor, image_to_data_url
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine, load_tokenizer

PH = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return make_tiny_visual_model(tmp_path_factory.mktemp("tiny_visual_http"))


@pytest.fixture(scope="module")
def server(vl_dir):
    tok = load_tokenizer(vl_dir)
    engine = load_engine(
        vl_dir, EngineConfig(max_running_requests=4, context_length=128), tokenizer=tok
    ).start()
    srv = ServerThread(create_app(engine, tokenizer=tok, model_path=vl_dir)).start()
    srv.engine, srv.tok = engine, tok
    yield srv
    srv.stop()
    engine.close()


def _image(text_px: int) -> Image.Image:
    img = Image.new("RGB", (84, 28), "white")
    for x in range(text_px, text_px + 10):
        for y in range(4, 24):
            img.putpixel((x, y), (0, 0, 0))
    return img


def _direct(srv, vl_dir, prompt: str, images, n: int):
    """The engine's greedy answer for the processed prompt (no HTTP)."""
    ids = srv.tok(prompt, add_special_tokens=False)["input_ids"]
    expanded, pixels, grid = VisionProcessor.from_model_dir(vl_dir)(ids, images)
    req = GenerateRequest(
        expanded,
        SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True),
        images=VisionInputs(pixels, grid),
    )
    return list(srv.engine.generate([req], timeout=60)[0].output_ids)


def _hf_greedy(srv, vl_dir, prompt: str, images, n: int):
    """transformers' greedy answer (the vision tokens banned, as the engine bans them)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    proc = VisionProcessor.from_model_dir(vl_dir)
    ids, pixels, grid = proc(srv.tok(prompt, add_special_tokens=False)["input_ids"], images)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    vision_ids = srv.tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    )
    out = hf.generate(
        input_ids=torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([[int(t == proc.image_token_id) for t in ids]]),
        pixel_values=pixels,
        image_grid_thw=grid,
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bad_words_ids=[[t] for t in vision_ids],
    )
    return out[0, len(ids) :].tolist()


def test_generate_with_image_data_equals_the_engine_and_hf_generate(server, vl_dir):
    img = _image(20)
    ids = server.tok(PH + "Compute.", add_special_tokens=False)["input_ids"]
    body = {
        "input_ids": ids,
        "image_data": image_to_data_url(img),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["output_ids"]
    assert got == _direct(server, vl_dir, PH + "Compute.", [img], 8)
    assert got == _hf_greedy(server, vl_dir, PH + "Compute.", [img], 8)
    assert r.json()["meta_info"]["prompt_tokens"] == len(ids) + 2  # 1 placeholder -> 3 tokens


def test_openai_chat_with_an_image_gets_an_answer(server, vl_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    img = _image(40)
    chat = client.chat.completions.create(
        model="default",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_to_data_url(img)}},
                    {"type": "text", "text": "Compute."},
                ],
            }
        ],  # fmt: skip
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    ref = _direct(server, vl_dir, PH + "Compute.", [img], 6)
    assert chat.choices[0].message.content == server.tok.decode(ref, skip_special_tokens=True)
    assert chat.usage.completion_tokens == 6


@pytest.mark.parametrize(
    "image_data, n_placeholders, status, needle",
    [
        ("/etc/passwd", 1, 400, "data URLs"),
        ("https://example.com/a.png", 1, 400, "fetches no URLs"),
        ("data:image/png;base64,@@@", 1, 400, "base64"),
        ("data:text/plain;base64,aGk=", 1, 400, "image"),
        (None, 1, 400, "more image placeholders"),
        ("IMG", 2, 400, "holds 2 image placeholders"),
    ],
)
def test_bad_images_are_400_and_the_server_keeps_serving(
    server, image_data, n_placeholders, status, needle
):
    if image_data == "IMG":
        image_data = image_to_data_url(_image(10))
    ids = server.tok(PH * n_placeholders + "Compute.", add_special_tokens=False)["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    if image_data is not None:
        body["image_data"] = image_data
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == status and needle in r.text, r.text
    ok = requests.post(
        server.url + "/generate",
        json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_images_to_a_text_model_are_400(model_dir):
    engine = load_engine(model_dir, EngineConfig(max_running_requests=2, context_length=64))
    engine.start()
    srv = ServerThread(create_app(engine, model_path=model_dir)).start()
    try:
        body = {"input_ids": [5, 6], "image_data": image_to_data_url(_image(3))}
        r = requests.post(srv.url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and "not a vision-language model" in r.text
    finally:
        srv.stop()
        engine.close()
