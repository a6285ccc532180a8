"""The HTTP server over real sockets: SGLang protocol, OpenAI client, errors, load, pause,
weights."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

import aiohttp
import openai
import psutil
import pytest
import requests
from weight_senders import HalfSender

from realhf.base.net.http_server import ServerThread, auth_headers
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion.flat_file import write_model
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app, prometheus_text
from realhf.impl.model.gen.loading import load_engine, load_tokenizer
from realhf.impl.model.gen.weight_update import (
    UpdateSuperseded,
    WeightUpdateError,
    update_server,
)

from .conftest import EOS, PAD, load, recompute_logprobs, reference_greedy

MAX_RUNNING = 8


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def weights_root(model_dir, model_dir_b):
    """Where the server may load weights from: the directory holding both test models."""
    return os.path.commonpath([model_dir, model_dir_b])


@pytest.fixture(scope="module")
def server(model_dir, tokenizer, weights_root):
    engine = load_engine(
        model_dir,
        EngineConfig(max_running_requests=MAX_RUNNING, context_length=400),
        tokenizer=tokenizer,
    ).start()
    app = create_app(
        engine,
        tokenizer=tokenizer,
        model_path=model_dir,
        served_model_name="tiny",
        weights_root=weights_root,
        shm_root=os.path.join(weights_root, "shm"),
    )
    srv = ServerThread(app).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close()


@pytest.fixture(scope="module")
def bare_server(model_dir_no_tokenizer):
    engine = load_engine(
        model_dir_no_tokenizer, EngineConfig(max_running_requests=2, context_length=64)
    ).start()
    srv = ServerThread(create_app(engine, model_path=model_dir_no_tokenizer)).start()
    yield srv
    srv.stop()
    engine.close()


def post(srv, path, body, timeout=60):
    """POST as the run's own clients do (control routes want the run's token)."""
    return requests.post(srv.url + path, json=body, headers=auth_headers(), timeout=timeout)


def greedy_params(n, **kw):
    return {"max_new_tokens": n, "temperature": 0, **kw}


def test_generate_input_ids_with_logprobs(server, model, tokenizer):
    prompt = [5, 17, 42, 9]
    r = post(
        server,
        "/generate",
        {
            "input_ids": prompt,
            "sampling_params": greedy_params(12, ignore_eos=True),
            "return_logprob": True,
        },
    )
    assert r.status_code == 200
    d = r.json()
    ref = reference_greedy(model, prompt, 12)
    assert d["output_ids"] == ref
    assert d["text"] == tokenizer.decode(ref, skip_special_tokens=True)
    meta = d["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 12
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == ref and all(e[2] is None for e in entries)
    lps = recompute_logprobs(model, prompt, ref)
    assert max(abs(e[0] - float(l)) for e, l in zip(entries, lps)) < 1e-4


def test_generate_text_batch_and_n(server, model, tokenizer):
    r = post(
        server,
        "/generate",
        {"text": "Compute 3+4.", "sampling_params": greedy_params(5, ignore_eos=True)},
    )
    ids = tokenizer.encode("Compute 3+4.")
    assert r.json()["output_ids"] == reference_greedy(model, ids, 5)
    r = post(
        server,
        "/generate",
        {
            "input_ids": [[3, 4], [5]],
            "sampling_params": {"n": 2, "max_new_tokens": 3},
            "return_logprob": [True, False],
            "return_text_in_logprobs": True,
        },
    )
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 4
    assert all(len(o["output_ids"]) <= 3 for o in outs)
    assert isinstance(outs[0]["meta_info"]["output_token_logprobs"][0][2], str)
    assert "output_token_logprobs" not in outs[3]["meta_info"]
    assert outs[0]["meta_info"]["prompt_tokens"] == 2 and outs[2]["meta_info"]["prompt_tokens"] == 1


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": [1, 2], "unknown_field": 3}, "unknown_field"),
        ({"input_ids": [1] * 399, "sampling_params": {"max_new_tokens": 5}}, "context length 400"),
        ({"input_ids": [1] * 401}, "prompt has 401 tokens"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature=-1"),
        ({"input_ids": [1], "sampling_params": {"top_p": 2}}, "top_p=2"),
        (
            {"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}},
            "min_new_tokens=9",
        ),
        ({"input_ids": [1, 99999]}, "outside the vocabulary"),
        ({"input_ids": [1], "stream": True}, "streaming"),
        # found by fuzzing: n = 2**63 was expanded into engine requests one by one, holding
        # the event loop for good; a request larger than the queue could never run anyway
        ({"input_ids": [1], "sampling_params": {"n": 2**63}}, "queues at most 100000"),
        ({"input_ids": [[1]] * 2, "sampling_params": {"n": 60000}}, "asks for 120000"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, needle):
    r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert (
        post(
            server, "/generate", {"input_ids": [3], "sampling_params": greedy_params(1)}
        ).status_code
        == 200
    )


def test_invalid_json_is_400(server):
    r = requests.post(server.url + "/generate", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_no_tokenizer_server(bare_server):
    r = post(bare_server, "/generate", {"text": "hello"})
    assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    d = post(
        bare_server, "/generate", {"input_ids": [3, 4], "sampling_params": greedy_params(2)}
    ).json()
    assert "text" not in d and len(d["output_ids"]) <= 2
    r = post(
        bare_server,
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_health_models_metrics_info(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 400
    text = requests.get(server.url + "/metrics", timeout=10).text
    for name in (
        "num_running_reqs",
        "num_used_tokens",
        "num_queue_reqs",
        "token_usage",
        "gen_throughput",
    ):
        assert re.search(rf'^sglang:{name}{{model_name="tiny"}} [0-9.e+-]+$', text, re.M), name
    assert "# TYPE sglang:num_used_tokens gauge" in text
    info = requests.get(server.url + "/get_model_info", headers=auth_headers(), timeout=10)
    assert info.json()["is_generation"] is True
    assert post(server, "/flush_cache", None).status_code == 200


def test_prometheus_text_counts():
    st = {
        "num_running_reqs": 3,
        "num_used_tokens": 50,
        "num_queue_reqs": 1,
        "max_total_num_tokens": 100,
        "gen_throughput": 12.5,
        "prompt_tokens_total": 7,
        "generation_tokens_total": 9,
        "num_requests_total": 2,
    }
    text = prometheus_text(st, "m")
    assert 'sglang:num_running_reqs{model_name="m"} 3.0' in text
    assert 'sglang:token_usage{model_name="m"} 0.5' in text


def test_hundreds_of_concurrent_clients(server, model):
    prompts = [[10 + i, 20 + (i * 7) % 200, 3] for i in range(20)]
    budgets = [4 + i % 9 for i in range(20)]
    refs = [reference_greedy(model, p, b) for p, b in zip(prompts, budgets)]
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    seen_running = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen_running.append(server.engine.stats()["num_running_reqs"])
            time.sleep(0.01)

    async def main():
        async with aiohttp.ClientSession() as sess:

            async def one(k):
                i = k % 20
                body = {
                    "input_ids": prompts[i],
                    "sampling_params": greedy_params(budgets[i], ignore_eos=True),
                }
                async with sess.post(
                    server.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(300)
                ) as r:
                    assert r.status == 200
                    return i, (await r.json())["output_ids"]

            return await asyncio.gather(*[one(k) for k in range(300)])

    t = threading.Thread(target=watch)
    t.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        t.join()
    assert len(results) == 300
    for i, ids in results:
        assert ids == refs[i]
    assert max(seen_running) <= MAX_RUNNING and max(seen_running) > 1
    assert server.engine.cache.n_free == server.engine.cache.n_pages
    # bounded memory: the cache is preallocated; a few hundred requests add little
    assert proc.memory_info().rss - rss0 < 300 * 2**20


def _rollout(server, prompt, budget, chunk, pause_after=None):
    """PartialRolloutManager's loop: n=1 chunks, stop on [pad, eos], resubmit after length/abort."""
    acc_ids, acc_lps, reasons = [], [], []
    while len(acc_ids) < budget:
        body = {
            "input_ids": prompt + acc_ids,
            "sampling_params": {
                "n": 1,
                "top_p": 1.0,
                "top_k": -1,
                "temperature": 0.0,
                "max_new_tokens": min(chunk, budget - len(acc_ids)),
                "stop_token_ids": [PAD, EOS],
            },
            "return_logprob": True,
            "stream": False,
        }
        if pause_after is not None and not reasons:
            box = {}
            th = threading.Thread(target=lambda: box.update(r=post(server, "/generate", body)))
            th.start()
            while server.engine.stats()["generation_tokens_total"] < pause_after:
                time.sleep(0.002)
            assert post(server, "/pause_generation", {}).json()["status"] == "ok"
            th.join(30)
            assert post(server, "/continue_generation", {}).json()["status"] == "ok"
            d = box["r"].json()
        else:
            d = post(server, "/generate", body).json()
        meta = d["meta_info"]
        acc_ids += [e[1] for e in meta["output_token_logprobs"]]
        acc_lps += [e[0] for e in meta["output_token_logprobs"]]
        reasons.append(meta["finish_reason"]["type"])
        if reasons[-1] == "stop":
            break
    return acc_ids, acc_lps, reasons


def test_rollout_protocol_chunks_and_resubmission_after_pause(server, model):
    prompt = [31, 32, 33, 34]
    ref = reference_greedy(model, prompt, 60, stop=(PAD, EOS))
    ids, lps, reasons = _rollout(server, prompt, 60, chunk=16)
    assert ids == ref
    before = server.engine.stats()["generation_tokens_total"]
    ids2, lps2, reasons2 = _rollout(server, prompt, 60, chunk=60, pause_after=before + 10)
    assert reasons2[0] == "abort" and ids2 == ref
    assert max(abs(a - b) for a, b in zip(lps, lps2)) < 1e-4


def test_update_weights_from_disk(server, model_dir, model_dir_b, weights_root):
    prompt = [8, 9, 10]
    body = {"input_ids": prompt, "sampling_params": greedy_params(8, ignore_eos=True)}
    assert post(server, "/pause_generation", {}).status_code == 200
    r = post(server, "/update_weights_from_disk", {"model_path": model_dir_b})
    assert r.status_code == 200 and r.json()["success"] is True
    post(server, "/continue_generation", {})
    try:
        assert post(server, "/generate", body).json()["output_ids"] == reference_greedy(
            load(model_dir_b), prompt, 8
        )
        missing = os.path.join(weights_root, "no-such-dir")
        r = post(server, "/update_weights_from_disk", {"model_path": missing})
        assert r.status_code == 400 and r.json()["success"] is False and r.json()["message"]
        r = post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
        assert r.status_code == 403 and weights_root in r.json()["message"]
        assert post(server, "/update_weights_from_disk", {"path": "x"}).status_code == 400
    finally:
        assert post(server, "/update_weights_from_disk", {"model_path": model_dir}).json()[
            "success"
        ]


async def _protocol_update(url: str, version: int, path: str, mode: str) -> None:
    async def healthy(_):
        return True

    async with aiohttp.ClientSession() as session:
        await update_server(session, url, version, path, 60.0, healthy, mode)


def _logprob_request():
    prompt = [8, 9, 10]
    body = {
        "input_ids": prompt,
        "sampling_params": greedy_params(8, ignore_eos=True),
        "return_logprob": True,
    }
    return prompt, body


def _served_after_disk_update(server, trained_dir, other_dir, body):
    """The (log-prob, token) entries ``body`` gets after a disk update of the server to
    ``trained_dir``; the server is then updated to ``other_dir``, which answers otherwise."""
    asyncio.run(_protocol_update(server.url, 1, trained_dir, "disk"))
    entries = post(server, "/generate", body).json()["meta_info"]["output_token_logprobs"]
    asyncio.run(_protocol_update(server.url, 2, other_dir, "disk"))
    assert post(server, "/generate", body).json()["meta_info"]["output_token_logprobs"] != entries
    return entries


def test_update_weights_from_shm_through_the_protocol(server, model_dir, model_dir_b, weights_root):
    # What the trainer publishes with weight_sync=shm, and the manager's protocol client.
    trained = load(model_dir_b)
    path = os.path.join(weights_root, "shm", "actor", "v7.flat")
    write_model(trained, path, 7)
    prompt, body = _logprob_request()
    try:
        # The same weights through the disk: what the shm update must serve, to the bit.
        from_disk = _served_after_disk_update(server, model_dir_b, model_dir, body)
        asyncio.run(_protocol_update(server.url, 7, path, "shm"))
        # Same dtype, on the CPU: the server serves from the file's pages, copying nothing.
        with open("/proc/self/maps") as f:
            assert path in f.read()
        entries = post(server, "/generate", body).json()["meta_info"]["output_token_logprobs"]
        assert entries == from_disk
        ids = [e[1] for e in entries]
        assert ids == reference_greedy(trained, prompt, 8)
        # Against a full forward (no KV cache): equal up to the float order of the two.
        lps = recompute_logprobs(trained, prompt, ids)
        assert max(abs(e[0] - float(l)) for e, l in zip(entries, lps)) < 1e-4
        # Asked for another version than the file holds: refused, named, and not gated after.
        with pytest.raises(WeightUpdateError, match="holds weight version 7, not the 8"):
            asyncio.run(_protocol_update(server.url, 8, path, "shm"))
        assert post(server, "/generate", body).json()["output_ids"] == ids
        # Only files under the server's shm root; the body is checked.
        outside = os.path.join(weights_root, "v7.flat")
        os.rename(path, outside)
        r = post(server, "/update_weights_from_shm", {"path": outside, "weight_version": 7})
        assert r.status_code == 403 and "shm" in r.json()["message"]
        for bad in ({"path": outside}, {"path": outside, "weight_version": "7"}, {"x": 1}):
            assert post(server, "/update_weights_from_shm", bad).status_code == 400
    finally:
        assert post(server, "/update_weights_from_disk", {"model_path": model_dir}).json()[
            "success"
        ]


def test_update_weights_from_broadcast_through_the_protocol(server, model_dir, model_dir_b):
    # What the trainer stages with weight_sync=broadcast, and the manager's protocol client.
    trained = load(model_dir_b)
    sender = WeightSender(timeout=10.0)
    prompt, body = _logprob_request()
    try:
        # The same weights through the disk: what the pulled update must serve, to the bit.
        from_disk = _served_after_disk_update(server, model_dir_b, model_dir, body)
        sender.stage(trained.flat_params, trained.param_spec, 7)
        asyncio.run(_protocol_update(server.url, 7, sender.address, "broadcast"))
        entries = post(server, "/generate", body).json()["meta_info"]["output_token_logprobs"]
        assert entries == from_disk
        ids = [e[1] for e in entries]
        lps = recompute_logprobs(trained, prompt, ids)
        assert max(abs(e[0] - float(l)) for e, l in zip(entries, lps)) < 1e-4
        # Another version than the sender holds: refused before anything moved; still serving.
        with pytest.raises(WeightUpdateError, match="holds weight version 7, not the 8"):
            asyncio.run(_protocol_update(server.url, 8, sender.address, "broadcast"))
        assert post(server, "/generate", body).json()["output_ids"] == ids
        # An older one: the trainer moved on.  Not a failure: 409 names the newer version,
        # the weights stay, and the server serves again.
        with pytest.raises(UpdateSuperseded) as e:
            asyncio.run(_protocol_update(server.url, 6, sender.address, "broadcast"))
        assert (e.value.version, e.value.newer) == (6, 7)
        assert post(server, "/generate", body).json()["output_ids"] == ids
        r = post(
            server,
            "/update_weights_from_broadcast",
            {"sender": sender.address, "weight_version": 5},
        )
        assert r.status_code == 409 and r.json()["superseded_by"] == 7
        assert post(server, "/continue_generation", {}).status_code == 200
        # A transfer that breaks off (the trainer dies after one bucket) leaves the server
        # holding neither version: it refuses to continue, and /generate gets no tokens,
        # until an update succeeds.
        broken = HalfSender(timeout=10.0, bucket_bytes=4096)
        broken.stage(load(model_dir).flat_params, trained.param_spec, 9)
        with pytest.raises(WeightUpdateError, match=r"after 4096 bytes"):
            asyncio.run(_protocol_update(server.url, 9, broken.address, "broadcast"))
        broken.close()
        r = post(server, "/continue_generation", {})
        assert r.status_code == 500 and "neither the old version nor the new" in r.text
        out = post(server, "/generate", body).json()
        assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "abort"
        sender.stage(trained.flat_params, trained.param_spec, 10)
        asyncio.run(_protocol_update(server.url, 10, sender.address, "broadcast"))
        assert post(server, "/generate", body).json()["meta_info"]["output_token_logprobs"] == (
            from_disk
        )
        for bad in ({"sender": "x"}, {"sender": "x", "weight_version": "7"}, {"x": 1}):
            assert post(server, "/update_weights_from_broadcast", bad).status_code == 400
    finally:
        sender.close()
        asyncio.run(_protocol_update(server.url, 11, model_dir, "disk"))


def test_openai_completions_and_chat(server, model, tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    c = client.completions.create(
        model="tiny",
        prompt="Compute 3+4.",
        max_tokens=6,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    ids = tokenizer.encode("Compute 3+4.")
    ref = reference_greedy(model, ids, 6)
    assert c.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(ids) and c.usage.completion_tokens == 6
    lps = recompute_logprobs(model, ids, ref)
    assert max(abs(a - float(b)) for a, b in zip(c.choices[0].logprobs.token_logprobs, lps)) < 1e-4
    c = client.completions.create(model="tiny", prompt=[[5, 6], [7]], max_tokens=3, n=2)
    assert len(c.choices) == 4 and [ch.index for ch in c.choices] == [0, 1, 2, 3]

    msgs = [{"role": "user", "content": "Compute 12+30."}]
    chat = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    ref = reference_greedy(model, chat_ids, 8)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)
    assert len(chat.choices[0].logprobs.content) == 8
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="tiny", messages=msgs, stream=True)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny", prompt="x", presence_penalty=1.0)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt=[1] * 390, max_tokens=20)
