"""Generation throughput: our engine (continuous batching, slot KV cache) vs
``transformers`` ``generate`` (static batches), and requests/s through our HTTP server.

Workload (the RL case): prompts from the embedded arithmetic data, one sample
each, sampled at temperature 1 (top-p 1, no top-k), with output lengths spread
widely — each request's budget is drawn log-uniformly from
``[--min-new, --max-new]`` and EOS is ignored, so both systems generate exactly
the same tokens' worth of work. Neither system knows the lengths in advance
(in RL they come from EOS): ``transformers`` runs batches of ``--max-running``
requests in arrival order until the longest member is done; our engine keeps
``--max-running`` sequences in flight and refills a slot the moment one
finishes. Both use the same model (the embedded default in
``realhf/assets/tiny``: qwen2, hidden 256, 4 layers, 4 q / 2 kv heads,
vocabulary 268; random weights of that shape when the checkpoint is absent),
the same prompts, the same sampling settings and the same CPU
threads, in one process; ``transformers`` uses its static KV cache (faster
than its default dynamic cache here, see ``--hf-cache``). Throughput counts requested tokens only.

Then the same engine serves ``--http-requests`` short requests
(budgets in ``[4, 64]``) sent to ``/generate`` with ``--http-clients`` in
flight by an aiohttp client in a child process (so that it does not share the
server's GIL; it does share the CPU); requests/s and tokens/s are reported,
with the engine's rate on the same workload without HTTP for comparison.

The machine this was written on is shared, and its load moves within a run, so
besides wall-clock throughput the script reports the ratio of CPU time each
system used for the same tokens (single-threaded, so CPU time is the work
done, and less sensitive to what other processes do).

Run (about 6-10 minutes on a busy 2-core CPU, most of it in ``transformers``):

    python benchmark/generation.py

The last line printed is one JSON object with the figures, including
``decode_speedup_vs_hf`` and ``http_requests_per_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import sys
import tempfile
import time

import torch
import transformers

from realhf.api.core.gen_api import GenerateRequest, SamplingParams
from realhf.base.net.http_server import ServerThread
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine

# tiny random HF models (no downloads) are test scaffolding, kept in tests/helpers/
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "helpers")
)
from tiny_models import make_tiny_hf_model  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "realhf", "assets", "tiny")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model-path",
        default=None,
        help="HF directory (default: the embedded checkpoint, else random weights of its shape)",
    )
    p.add_argument("--n-requests", type=int, default=256)
    p.add_argument(
        "--max-running", type=int, default=64, help="HF batch size = our running sequences"
    )
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--http-requests", type=int, default=1024)
    p.add_argument("--http-clients", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hf-cache",
        default="static",
        choices=["static", "dynamic"],
        help="transformers KV cache; static was the faster one here (48.7 vs 59.8 ms per step "
        "for 32 sequences at 1024 new tokens), so it is the default baseline",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for both systems; 1 keeps timings stable on a shared machine, where a "
        "multi-threaded op stalls whenever another process takes one of its cores",
    )
    p.add_argument(
        "--rl-rounds",
        type=int,
        default=5,
        help="timed rounds of the RL-shape point (32 prompts x 8 answers, <= 16 new tokens)",
    )
    p.add_argument(
        "--rl-only", action="store_true", help="run only the RL-shape point (about 30 s)"
    )
    return p.parse_args()


def make_model(path: str) -> str:
    make_tiny_hf_model(
        "qwen2",
        path,
        seed=0,
        perturb=0.3,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=268,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=1,
    )
    return path


def load_prompts(n: int, seed: int):
    tok = transformers.AutoTokenizer.from_pretrained(ASSETS)
    with open(os.path.join(ASSETS, "data", "train.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for _, line in zip(range(4 * n), f)]
    rng = random.Random(seed)
    rng.shuffle(texts)
    return [tok.encode(t) for t in texts[:n]]


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


@torch.inference_mode()
def run_hf(model_dir: str, prompts, budgets, batch_size: int, cache: str):
    """Static batches in arrival order, left-padded, sampled until the longest budget."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # lengths come from the budgets, as for us
    pad = 1
    start, cpu = time.perf_counter(), time.process_time()
    steps = 0
    for s in range(0, len(prompts), batch_size):
        ps, bs = prompts[s : s + batch_size], budgets[s : s + batch_size]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max(bs),
            min_new_tokens=max(bs),
            pad_token_id=pad,
            cache_implementation=cache,
        )
        assert out.shape[1] - width == max(bs)
        steps += max(bs)
    return time.perf_counter() - start, time.process_time() - cpu


def run_ours(engine, prompts, budgets):
    sp = [
        SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=b, ignore_eos=True)
        for b in budgets
    ]
    reqs = [GenerateRequest(input_ids=tuple(p), sampling=s) for p, s in zip(prompts, sp)]
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(reqs, timeout=3600)
    dt, dcpu = time.perf_counter() - start, time.process_time() - cpu
    assert [len(o.output_ids) for o in outs] == list(budgets)
    return dt, dcpu


@torch.inference_mode()
def greedy_match(model_dir: str, engine, prompts, n: int = 16) -> bool:
    """Sanity: our greedy continuation equals HF's on a few prompts."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos lets EOS be generated without stopping; HF's equivalent is no
    # EOS id at all (min_new_tokens would instead forbid the token).
    hf.generation_config.eos_token_id = None
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    outs = engine.generate([GenerateRequest(input_ids=tuple(p), sampling=sp) for p in prompts])
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, pad_token_id=1)[
            0, len(p) :
        ].tolist()
        if ref != list(o.output_ids):
            return False
    return True


def rl_shape_point(model_dir: str, threads: int, rounds: int, seed: int) -> dict:
    """The sync RL step's generation: 32 prompts x 8 answers, at most 16 new tokens,
    temperature 1, stopping at EOS.

    Ours is exactly what ``ppo-math``'s ``actor_gen`` runs (``generate_offline``: an engine
    over the training model, built for the call, all answers in one wave, the group's
    prompt prefilled once); ``transformers`` runs what TRL's ``GRPOTrainer`` runs: one
    ``generate`` over the 256 left-padded rows (each prompt repeated 8 times) with its
    default cache, stopping when every row has ended. The two alternate round by round;
    the medians are compared. The answers are sampled, so the work differs a little
    (mean new tokens are printed for both).
    """
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.impl.model.interface.offline_generation import generate_offline
    from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
    from realhf.impl.model.nn.real_model import ReaLModel

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(32, seed)
    group, max_new, pad, eos = 8, 16, tok.pad_token_id, tok.eos_token_id
    ours_model = ReaLModel.from_hf(model_dir).eval()
    sample = SequenceSample.from_default(
        ids=[f"p{i}" for i in range(len(prompts))],
        seqlens=[len(p) for p in prompts],
        data={"packed_prompts": torch.tensor(sum(prompts, []))},
    )
    gconfig = GenerationHyperparameters(n=group, max_new_tokens=max_new, temperature=1.0)
    slots = PPOHyperparameters().gen_max_running_requests  # what actor_gen runs with
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [p for p in prompts for _ in range(group)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])

    def ours(version):
        out = generate_offline(
            ours_model, sample, gconfig, tok, version=version, max_running_requests=slots
        )
        lens, plens = out.flat_seqlens("packed_input_ids"), [len(p) for p in rows]
        return sum(lens) - sum(plens)

    @torch.inference_mode()
    def theirs():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        new = out[:, width:]
        ended = (new == eos) | (new == pad)
        # tokens up to and including each row's first EOS (or all of them)
        first = torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1])
        return int(first.sum())

    ours(0), theirs()  # warm-up (numba kernels, allocator)
    t_ours, t_hf, n_ours, n_hf = [], [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        n_ours.append(ours(r + 1))
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        n_hf.append(theirs())
        t_hf.append(time.perf_counter() - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {
        "rl_shape_ours_s": round(med(t_ours), 3),
        "rl_shape_hf_s": round(med(t_hf), 3),
        "rl_shape_speedup_vs_hf": round(med(t_hf) / med(t_ours), 2),
        "rl_shape_ours_mean_new_tokens": round(sum(n_ours) / len(n_ours) / len(rows), 2),
        "rl_shape_hf_mean_new_tokens": round(sum(n_hf) / len(n_hf) / len(rows), 2),
    }
    print(
        f"RL shape (32 prompts x 8 answers, <= {max_new} new tokens, EOS stops, {threads} "
        f"thread(s)): ours {res['rl_shape_ours_s']:.3f} s, transformers generate "
        f"{res['rl_shape_hf_s']:.3f} s (median of {rounds}) = "
        f"{res['rl_shape_speedup_vs_hf']:.2f}x; mean answer {res['rl_shape_ours_mean_new_tokens']}"
        f" vs {res['rl_shape_hf_mean_new_tokens']} tokens"
    )
    return res


def _http_client(url: str, prompts, budgets, clients: int):
    """Send every request to ``url/generate`` with ``clients`` in flight; runs in a
    child process so that the client does not share the server's GIL."""
    import aiohttp

    async def main():
        sem = asyncio.Semaphore(clients)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as sess:

            async def one(p, b):
                body = {
                    "input_ids": p,
                    "sampling_params": {"max_new_tokens": b, "ignore_eos": True},
                    "return_logprob": True,
                }
                async with sem, sess.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    return len((await r.json())["output_ids"])

            return await asyncio.gather(*[one(p, b) for p, b in zip(prompts, budgets)])

    start = time.perf_counter()
    lens = asyncio.run(main())
    return time.perf_counter() - start, lens


def run_http(engine, prompts, budgets, clients: int):
    import concurrent.futures
    import multiprocessing

    srv = ServerThread(create_app(engine)).start()
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            pool.submit(_http_client, srv.url, prompts[:4], [2] * 4, 4).result(
                timeout=600
            )  # warm-up
            dt, lens = pool.submit(_http_client, srv.url, prompts, budgets, clients).result(
                timeout=3600
            )
    finally:
        srv.stop()
    assert lens == list(budgets)
    return dt


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="gen_bench_")
    model_dir = args.model_path
    if model_dir is None:
        has_ckpt = os.path.isfile(os.path.join(ASSETS, "model.safetensors"))
        model_dir = ASSETS if has_ckpt else make_model(tmp)
    if args.rl_only or os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        rl = rl_shape_point(model_dir, args.threads, args.rl_rounds, args.seed)
    else:
        rl = {}  # random weights without a tokenizer: no EOS behaviour to compare
    if args.rl_only:
        print(
            json.dumps({**rl, "threads": args.threads, "date": datetime.date.today().isoformat()})
        )
        return
    prompts = load_prompts(args.n_requests, args.seed)
    budgets = [log_uniform(rng, args.min_new, args.max_new) for _ in prompts]
    useful = sum(budgets)
    ctx = max(len(p) for p in prompts) + args.max_new + 1
    cfg = EngineConfig(
        max_running_requests=args.max_running,
        context_length=max(ctx, 128),
        num_threads=args.threads,
        seed=args.seed,
    )
    engine = load_engine(model_dir, cfg).start()
    print(
        f"model {model_dir}; {len(prompts)} requests, prompts {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, budgets {min(budgets)}-{max(budgets)} "
        f"(mean {useful / len(budgets):.0f}); {args.threads} thread(s); decode attention "
        f"{engine.decode_impl}; load average {os.getloadavg()[0]:.1f}"
    )
    try:
        match = greedy_match(model_dir, engine, prompts[:4])
        print(f"greedy outputs equal to transformers: {match}")
        run_ours(engine, prompts[:8], [4] * 8)  # warm-up

        ours_s, ours_cpu = run_ours(engine, prompts, budgets)
        ours_tps = useful / ours_s
        print(f"ours: {ours_s:.1f} s ({ours_cpu:.1f} s CPU), {ours_tps:.0f} tokens/s")
        hf_s, hf_cpu = run_hf(model_dir, prompts, budgets, args.max_running, args.hf_cache)
        hf_tps = useful / hf_s
        hf_computed = sum(
            min(args.max_running, len(prompts) - s) * max(budgets[s : s + args.max_running])
            for s in range(0, len(prompts), args.max_running)
        )
        print(
            f"transformers generate ({args.hf_cache} cache): {hf_s:.1f} s ({hf_cpu:.1f} s CPU), "
            f"{hf_tps:.0f} useful tokens/s "
            f"({useful / hf_computed:.0%} of its {hf_computed} generated tokens were requested)"
        )
        speedup = ours_tps / hf_tps
        speedup_cpu = hf_cpu / ours_cpu
        print(
            f"decode speedup vs transformers: {speedup:.1f}x wall clock, "
            f"{speedup_cpu:.1f}x CPU time"
        )

        hrng = random.Random(args.seed + 1)
        hp = [prompts[i % len(prompts)] for i in range(args.http_requests)]
        hb = [log_uniform(hrng, 4, 64) for _ in hp]
        direct_s, _ = run_ours(engine, hp, hb)
        http_s = run_http(engine, hp, hb, args.http_clients)
        print(
            f"HTTP: {len(hp)} requests from {args.http_clients} clients in {http_s:.1f} s = "
            f"{len(hp) / http_s:.1f} requests/s, {sum(hb) / http_s:.0f} tokens/s "
            f"(engine without HTTP: {len(hp) / direct_s:.1f} requests/s)"
        )
    finally:
        engine.close()
    result = {
        "decode_speedup_vs_hf": round(speedup, 2),
        "decode_speedup_vs_hf_cpu_time": round(speedup_cpu, 2),
        "ours_decode_tokens_per_s": round(ours_tps, 1),
        "hf_decode_tokens_per_s": round(hf_tps, 1),
        "hf_requested_fraction": round(useful / hf_computed, 3),
        "http_requests_per_s": round(len(hp) / http_s, 2),
        "http_tokens_per_s": round(sum(hb) / http_s, 1),
        "engine_requests_per_s_same_http_workload": round(len(hp) / direct_s, 2),
        "n_requests": len(prompts),
        "max_running": args.max_running,
        "new_tokens_range": [args.min_new, args.max_new],
        "requested_tokens": useful,
        "threads": args.threads,
        "hf_cache": args.hf_cache,
        "greedy_equal_to_hf": match,
        "load_average": round(os.getloadavg()[0], 2),
        "date": datetime.date.today().isoformat(),
        **rl,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
