"""The engine against the plain model: greedy parity, logprobs, batching, stops, pause, weights."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from realhf.api.core.gen_api import GenerateRequest, InvalidRequestError, SamplingParams
from realhf.impl.model.conversion.flat_file import load_flat, write_model
from realhf.impl.model.gen import EngineClosedError, EngineConfig, GenerationEngine
from realhf.impl.model.gen.cache_attention import cpp_available, numba_available
from realhf.impl.model.gen.loading import load_engine, special_token_ids
from realhf.impl.model.nn.packed_linear import packing_supported

from .conftest import EOS, PAD, VOCAB, load, recompute_logprobs, reference_greedy

PROMPTS = [
    [5, 17, 42],
    [100, 3, 3, 8, 250, 9, 11],
    [77],
    [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
]


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model(model_dir):
    return load(model_dir)


@pytest.fixture
def make_engine(model):
    engines = []

    def make(**cfg):
        cfg.setdefault("max_running_requests", 4)
        cfg.setdefault("context_length", 256)
        e = GenerationEngine(
            model, EngineConfig(**cfg), eos_token_ids=[EOS], pad_token_id=PAD
        ).start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


impls = ["padded"] + (["numba"] if numba_available() else []) + (["cpp"] if cpp_available() else [])


@pytest.mark.parametrize("impl", impls)
def test_greedy_equals_token_by_token_decoding_and_logprobs_match(model, make_engine, impl):
    eng = make_engine(decode_attn_impl=impl)
    reqs = [
        GenerateRequest(input_ids=p, sampling=greedy(12 + 3 * i)) for i, p in enumerate(PROMPTS)
    ]
    outs = eng.generate(reqs, timeout=120)
    for p, r, o in zip(PROMPTS, reqs, outs):
        assert list(o.output_ids) == reference_greedy(model, p, r.sampling.max_new_tokens)
        assert o.finish_reason.type == "length" and o.finish_reason.length == len(o.output_ids)
        ref = recompute_logprobs(model, p, o.output_ids)
        assert torch.allclose(torch.tensor(o.output_logprobs), ref, atol=1e-4)
    assert len(set(outs[1].output_ids)) > 3  # the fixture model does not degenerate


def test_sampled_logprobs_are_under_the_sampling_temperature(model, make_engine):
    eng = make_engine()
    sp = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=20, ignore_eos=True, sampling_seed=3
    )
    o = eng.generate([GenerateRequest(input_ids=PROMPTS[1], sampling=sp)])[0]
    ref = recompute_logprobs(model, PROMPTS[1], o.output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(o.output_logprobs), ref, atol=1e-4)


def test_more_requests_than_slots_join_and_leave_every_step(model, make_engine):
    eng = make_engine(max_running_requests=3, max_prefill_tokens=8)
    lens = [3, 17, 1, 9, 25, 4, 12, 2, 30, 7]
    reqs = [
        GenerateRequest(input_ids=PROMPTS[i % 4] + [i], sampling=greedy(n))
        for i, n in enumerate(lens)
    ]
    outs = eng.generate(reqs, timeout=120)
    for r, o in zip(reqs, outs):
        assert list(o.output_ids) == reference_greedy(model, list(r.input_ids), len(o.output_ids))
        assert len(o.output_ids) == r.sampling.max_new_tokens
    assert eng.cache.n_free == eng.cache.n_pages and eng.scheduler.idle
    st = eng.stats()
    assert st["generation_tokens_total"] == sum(lens) and st["num_requests_total"] == len(lens)


@pytest.mark.parametrize("impl", impls)
def test_a_group_shares_its_prompts_cache_pages_and_decodes_exactly(
    model, make_engine, impl, tmp_path, monkeypatch
):
    from realhf.impl.model.gen.engine import OCCUPANCY_DIR_ENV

    monkeypatch.setenv(OCCUPANCY_DIR_ENV, str(tmp_path))
    # A 40-token prompt (pages of 16: two full, 8 tokens on a third) and 8 new tokens:
    # unshared, 4 answers take 4 x 3 pages = 192 tokens; sharing, 3 + 3 x 1 pages = 96.
    prompt = [(7 * i) % 200 + 2 for i in range(40)]
    eng = make_engine(max_running_requests=4, kv_cache_tokens=96, decode_attn_impl=impl)
    lens = [8, 5, 8, 3]
    outs = eng.generate([GenerateRequest(input_ids=prompt, sampling=greedy(n)) for n in lens])
    for n, o in zip(lens, outs):
        assert list(o.output_ids) == reference_greedy(model, prompt, n)
    eng.close()
    (path,) = tmp_path.iterdir()
    running = [int(line.split("\t")[1]) for line in path.read_text().splitlines()]
    assert max(running) == 4  # all four ran together in 96 tokens of cache
    assert eng.cache.n_free == eng.cache.n_pages  # every page given back


def test_requests_wait_for_cache_room_and_one_larger_than_the_cache_is_refused(model, make_engine):
    eng = make_engine(max_running_requests=8, kv_cache_tokens=48)  # 3 pages of 16
    reqs = [GenerateRequest(input_ids=PROMPTS[i % 4] + [i], sampling=greedy(20)) for i in range(5)]
    for r, o in zip(reqs, eng.generate(reqs, timeout=120)):
        assert list(o.output_ids) == reference_greedy(model, list(r.input_ids), 20)
    with pytest.raises(InvalidRequestError, match="exceeds the KV cache of 48 tokens"):
        eng.submit(GenerateRequest(input_ids=PROMPTS[1], sampling=greedy(42)))
    with pytest.raises(InvalidRequestError, match="at most 47 prompt tokens fit"):
        eng.submit(GenerateRequest(input_ids=[3] * 48, sampling=greedy(1)))
    # without max_new_tokens a request gets what the cache can hold
    o = eng.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=greedy(None))])[0]
    assert len(o.output_ids) == 48 - len(PROMPTS[0])


def test_stop_tokens_min_new_tokens_and_ignore_eos(model, make_engine):
    eng = make_engine()
    p = PROMPTS[1]
    ref = reference_greedy(model, p, 20)
    stop = ref[5]
    first = ref.index(stop)
    o = eng.generate([GenerateRequest(input_ids=p, sampling=greedy(20, stop_token_ids=[stop]))])[0]
    assert list(o.output_ids) == ref[: first + 1]  # the stop token is kept
    assert o.finish_reason.to_json() == {"type": "stop", "matched": stop}
    # min_new_tokens masks the stop token, so it cannot come first
    o = eng.generate(
        [
            GenerateRequest(
                input_ids=p, sampling=greedy(20, stop_token_ids=[stop], min_new_tokens=first + 2)
            )
        ]
    )[0]
    assert stop not in o.output_ids[: first + 2]
    assert len(o.output_ids) >= first + 2
    # EOS and pad stop by default; ignore_eos turns that off
    eos_like = SamplingParams(temperature=0.0, max_new_tokens=20)
    eng2 = GenerationEngine(
        model,
        EngineConfig(max_running_requests=2, context_length=256),
        eos_token_ids=[ref[2]],
        pad_token_id=ref[3],
    ).start()
    try:
        o = eng2.generate([GenerateRequest(input_ids=p, sampling=eos_like)])[0]
        assert o.finish_reason.type == "stop" and o.output_ids[-1] in (ref[2], ref[3])
        assert len(o.output_ids) == min(ref.index(ref[2]), ref.index(ref[3])) + 1
        o = eng2.generate([GenerateRequest(input_ids=p, sampling=greedy(20))])[0]
        assert list(o.output_ids) == ref
    finally:
        eng2.close()


def test_requests_with_one_prompt_share_a_prefill_and_sample_as_if_alone(model, make_engine):
    """A group of answers to one prompt prefills the prompt once (the prompt tokens counted
    once per step) yet every answer equals its own run alone, tokens and log-probs."""
    eng = make_engine(max_running_requests=8)
    base = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, sampling_seed=7)
    group = [GenerateRequest(input_ids=PROMPTS[1], sampling=base.for_sample(j)) for j in range(5)]
    other = [GenerateRequest(input_ids=PROMPTS[0], sampling=greedy(9)) for _ in range(2)]
    before = eng.stats()["prompt_tokens_total"]
    outs = eng.generate(group + other, timeout=120)
    # All seven were admitted in one step: two distinct prompts ran.
    assert eng.stats()["prompt_tokens_total"] - before == len(PROMPTS[1]) + len(PROMPTS[0])
    assert len({tuple(o.output_ids) for o in outs[:5]}) > 1  # the answers differ
    for r, o in zip(group + other, outs):
        alone = eng.generate([r], timeout=120)[0]
        assert o.output_ids == alone.output_ids
        ref = recompute_logprobs(model, list(r.input_ids), o.output_ids)
        assert torch.allclose(torch.tensor(o.output_logprobs), ref, atol=1e-4)


def test_the_head_runs_only_at_the_rows_a_step_samples_from(model, make_engine):
    """A prefill samples from each prompt's last position only, so the LM head (the
    largest product at a real vocabulary) runs at one row per sequence of a step, never
    at every prompt position."""
    eng = make_engine(max_running_requests=4)
    rows = []
    hook = model.head.register_forward_hook(lambda mod, args, out: rows.append(out.shape[0]))
    try:
        outs = eng.generate([GenerateRequest(input_ids=p, sampling=greedy(3)) for p in PROMPTS])
    finally:
        hook.remove()
    assert rows == [len(PROMPTS)] * 3  # one prefill step (22 prompt tokens), two decode steps
    for p, o in zip(PROMPTS, outs):
        assert list(o.output_ids) == reference_greedy(model, p, 3)


def test_seeded_sampling_is_reproducible_under_other_traffic(make_engine):
    eng = make_engine(max_running_requests=6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=25, ignore_eos=True, sampling_seed=1234)
    alone = eng.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=sp)])[0]
    noise = [
        GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=30, ignore_eos=True))
        for p in PROMPTS
    ]
    mixed = eng.generate(
        noise[:2] + [GenerateRequest(input_ids=PROMPTS[0], sampling=sp)] + noise[2:]
    )[2]
    assert mixed.output_ids == alone.output_ids
    other = eng.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=sp.for_sample(1))])[0]
    assert other.output_ids != alone.output_ids


def test_pause_aborts_with_partial_outputs_and_resubmission_continues(model, make_engine):
    eng = make_engine(max_running_requests=2)
    n = 150
    futs = [eng.submit(GenerateRequest(input_ids=p, sampling=greedy(n))) for p in PROMPTS[:3]]
    while eng.stats()["generation_tokens_total"] < 20:
        time.sleep(0.005)
    aborted = eng.pause()
    outs = [f.result(timeout=30) for f in futs]
    assert {o.rid for o in aborted} == {o.rid for o in outs}
    assert all(o.finish_reason.type == "abort" for o in outs)
    running, queued = outs[:2], outs[2]
    assert all(0 < len(o.output_ids) < n for o in running)
    assert all(len(o.output_logprobs) == len(o.output_ids) for o in outs)
    assert len(queued.output_ids) == 0  # it was still waiting for a slot
    # while paused, new requests wait; after resume they run
    late = eng.submit(GenerateRequest(input_ids=PROMPTS[3], sampling=greedy(3)))
    time.sleep(0.2)
    assert not late.done()
    eng.resume()
    assert len(late.result(timeout=30).output_ids) == 3
    # the rollout protocol: resubmit prompt + generated prefix with the rest of the budget
    o = running[0]
    p = PROMPTS[0]
    rest = eng.generate(
        [GenerateRequest(input_ids=p + list(o.output_ids), sampling=greedy(n - len(o.output_ids)))]
    )[0]
    assert list(o.output_ids) + list(rest.output_ids) == reference_greedy(model, p, n)
    assert rest.finish_reason.type == "length"


def test_update_weights_while_paused(model_dir, model_dir_b):
    eng = load_engine(model_dir, EngineConfig(max_running_requests=2, context_length=256)).start()
    try:
        req = GenerateRequest(input_ids=PROMPTS[1], sampling=greedy(10))
        before = eng.generate([req])[0].output_ids
        assert list(before) == reference_greedy(load(model_dir), PROMPTS[1], 10)
        eng.pause()
        assert eng.update_weights_from_disk(model_dir_b) == 1
        eng.resume()
        after = eng.generate([req])[0]
        assert list(after.output_ids) == reference_greedy(load(model_dir_b), PROMPTS[1], 10)
        assert after.output_ids != before
        with pytest.raises((FileNotFoundError, ValueError)):  # a missing dir or checkpoint
            eng.update_weights_from_disk("/nonexistent/dir")
        assert eng.generate([req])[0].output_ids == after.output_ids  # still serving
    finally:
        eng.close()


def test_a_bf16_engine_copies_an_fp32_flat_file_and_an_fp32_one_maps_it(
    model_dir, model_dir_b, tmp_path
):
    trained = load(model_dir_b)
    path = str(tmp_path / "v4.flat")
    write_model(trained, path, 4)
    for dtype in ("bfloat16", "float32"):
        cfg = EngineConfig(max_running_requests=2, context_length=64, dtype=dtype)
        eng = load_engine(model_dir, cfg).start()
        try:
            eng.pause()
            assert eng.update_weights_from_shm(path, 4) == 1
            eng.resume()
            got = eng.model.flat_params
            assert torch.equal(got, trained.flat_params.to(got.dtype))
            with open("/proc/self/maps") as f:  # the mapping outlives the load only if served
                read_only = [ln for ln in f if ln.rstrip().endswith(path) and " r--s " in ln]
            assert bool(read_only) == (dtype == "float32")  # (rw-s: the writer's own)
            # A load that writes in place (disk, e.g. a recovery) first copies the mapped
            # weights: the file every server reads stays as written.
            eng.pause()
            assert eng.update_weights_from_disk(model_dir) == 2
            base = load(model_dir).flat_params
            assert torch.equal(eng.model.flat_params, base.to(got.dtype))
            in_file = torch.empty_like(trained.flat_params)
            load_flat(in_file, trained.param_spec, path, 4)
            assert torch.equal(in_file, trained.flat_params)
            eng.resume()
        finally:
            eng.close()
        del eng, got
        gc.collect()


def test_abort_by_rid(make_engine):
    eng = make_engine(max_running_requests=1)
    f1 = eng.submit(GenerateRequest(input_ids=[1, 2], sampling=greedy(200), rid="long"))
    f2 = eng.submit(GenerateRequest(input_ids=[1, 2], sampling=greedy(2), rid="queued"))
    while eng.stats()["generation_tokens_total"] < 3:
        time.sleep(0.005)
    assert eng.abort("long") is True
    o = f1.result(timeout=30)
    assert o.finish_reason.to_json() == {"type": "abort", "message": "aborted by request"}
    assert 0 < len(o.output_ids) < 200
    assert len(f2.result(timeout=30).output_ids) == 2
    assert eng.abort("unknown") is False


def test_a_failing_command_fails_only_its_own_caller(make_engine):
    """A refused ``add`` fails that request's future; the engine keeps serving."""
    from realhf.impl.model.gen.batch_scheduler import QueueFullError

    eng = make_engine(max_running_requests=1, max_queued_requests=1)
    eng.pause()  # nothing is admitted, so the queue fills up
    first = eng.submit(GenerateRequest(input_ids=[1, 2], sampling=greedy(2)))
    second = eng.submit(GenerateRequest(input_ids=[1, 2], sampling=greedy(2)))
    with pytest.raises(QueueFullError, match="max_queued_requests=1"):
        second.result(timeout=30)
    eng.resume()
    assert len(first.result(timeout=30).output_ids) == 2
    assert eng.abort("nobody") is False  # control commands still work


def test_invalid_requests_fail_at_submit(make_engine):
    eng = make_engine(context_length=32)
    with pytest.raises(InvalidRequestError, match="context length 32"):
        eng.submit(GenerateRequest(input_ids=[1] * 20, sampling=greedy(20)))
    with pytest.raises(InvalidRequestError, match="prompt has 40 tokens"):
        eng.submit(GenerateRequest(input_ids=[1] * 40, sampling=greedy(1)))
    with pytest.raises(InvalidRequestError, match=f"vocabulary of {VOCAB}"):
        eng.submit(GenerateRequest(input_ids=[1, VOCAB], sampling=greedy(1)))
    o = eng.submit(GenerateRequest(input_ids=[1], sampling=greedy(0))).result(timeout=5)
    assert o.output_ids == () and o.finish_reason.type == "length"
    # max_new_tokens=None fills the context
    o = eng.generate(
        [
            GenerateRequest(
                input_ids=[1] * 30,
                sampling=SamplingParams(temperature=0, max_new_tokens=None, ignore_eos=True),
            )
        ]
    )[0]
    assert len(o.output_ids) == 2


def test_close_fails_in_flight_requests(model):
    eng = GenerationEngine(model, EngineConfig(max_running_requests=1, context_length=512)).start()
    futs = [eng.submit(GenerateRequest(input_ids=[3], sampling=greedy(500))) for _ in range(2)]
    while eng.stats()["generation_tokens_total"] < 2:
        time.sleep(0.005)
    eng.close()
    for f in futs:
        with pytest.raises(EngineClosedError):
            f.result(timeout=5)
    with pytest.raises(EngineClosedError):
        eng.submit(GenerateRequest(input_ids=[3], sampling=greedy(1)))
    with pytest.raises(EngineClosedError):
        eng.pause()


def test_special_token_ids_from_the_directory(model_dir, model_dir_no_tokenizer):
    from realhf.impl.model.gen.loading import load_tokenizer

    assert special_token_ids(model_dir_no_tokenizer) == ([EOS], PAD)
    tok = load_tokenizer(model_dir)
    assert tok is not None and load_tokenizer(model_dir_no_tokenizer) is None
    eos, pad = special_token_ids(model_dir, tok)
    assert EOS in eos and pad == PAD


def test_concurrent_submitters(model, make_engine):
    eng = make_engine(max_running_requests=4)
    results = {}

    def client(i):
        p = PROMPTS[i % 4] + [i]
        results[i] = (
            p,
            eng.generate([GenerateRequest(input_ids=p, sampling=greedy(5 + i % 7))])[0],
        )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 24
    for i, (p, o) in results.items():
        assert list(o.output_ids) == reference_greedy(model, p, 5 + i % 7)


class _FailingOnce(torch.nn.Module):
    """The real model, with one injected failure on its third forward."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.calls = model, model.config, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("injected forward failure")
        return self.inner(*args, **kwargs)


def test_a_failed_step_fails_in_flight_requests_and_the_engine_keeps_serving(model):
    eng = GenerationEngine(
        _FailingOnce(model), EngineConfig(max_running_requests=2, context_length=64)
    ).start()
    try:
        futs = [
            eng.submit(GenerateRequest(input_ids=[4, 5], sampling=greedy(10))) for _ in range(2)
        ]
        for f in futs:
            with pytest.raises(RuntimeError, match="injected forward failure"):
                f.result(timeout=30)
        assert "injected forward failure" in eng.last_error
        o = eng.generate([GenerateRequest(input_ids=[4, 5], sampling=greedy(5))], timeout=30)[0]
        assert list(o.output_ids) == reference_greedy(model, [4, 5], 5)
        assert eng.cache.n_free == eng.cache.n_pages
    finally:
        eng.close()


def test_a_cache_that_cannot_fit_is_refused(model):
    with pytest.raises(ValueError, match="lower EngineConfig.kv_cache_tokens to at most"):
        GenerationEngine(model, EngineConfig(max_running_requests=100_000, context_length=100_000))
    with pytest.raises(ValueError, match="KV cache needs .* GiB for 10000000000 tokens"):
        GenerationEngine(model, EngineConfig(kv_cache_tokens=10**10))


def test_occupancy_log_records_every_step_when_asked(model, make_engine, tmp_path, monkeypatch):
    from realhf.impl.model.gen.engine import OCCUPANCY_DIR_ENV

    monkeypatch.setenv(OCCUPANCY_DIR_ENV, str(tmp_path / "occ"))
    e = make_engine(max_running_requests=4)
    # 6 requests of 5 tokens for 4 slots: two waves, the second runs with 2 sequences
    e.generate([GenerateRequest(input_ids=PROMPTS[0], sampling=greedy(5)) for _ in range(6)])
    e.close()
    (path,) = (tmp_path / "occ").iterdir()
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    running = [int(r[1]) for r in rows]
    assert sum(running) == 6 * 5 and max(running) == 4 and {int(r[2]) for r in rows} == {4}
    times = [float(r[0]) for r in rows]
    assert times == sorted(times)
    monkeypatch.delenv(OCCUPANCY_DIR_ENV)
    assert make_engine()._occupancy is None


@pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no bf16 kernels to pack for",
)
def test_a_bf16_engine_packs_its_weights_while_idle_and_again_after_an_update(
    model_dir, model_dir_b
):
    def run(pack: bool):
        cfg = EngineConfig(max_running_requests=4, context_length=64, dtype="bfloat16")
        cfg.pack_weights = pack
        eng = load_engine(model_dir, cfg).start()
        try:
            packer = eng._packer
            assert (packer is not None) == pack
            deadline = time.monotonic() + 30
            while pack and not packer.done and time.monotonic() < deadline:
                time.sleep(0.01)  # packed while idle
            assert not pack or packer.done
            req = [eng.submit(GenerateRequest(input_ids=p, sampling=greedy(8))) for p in PROMPTS]
            before = [list(f.result(timeout=60).output_logprobs) for f in req]
            eng.pause()
            eng.update_weights_from_disk(model_dir_b)
            assert not pack or packer.next == 0  # the old packs were dropped
            eng.resume()
            req = [eng.submit(GenerateRequest(input_ids=p, sampling=greedy(8))) for p in PROMPTS]
            after = [f.result(timeout=60) for f in req]
            return before, [list(o.output_ids) for o in after], [o.output_logprobs for o in after]
        finally:
            eng.close()
            # The model outlives the engine (a trainer's generation): no packed copy stays.
            assert not pack or all(a not in o.__dict__ for o, a, _ in packer.jobs)

    packed, plain = run(True), run(False)
    # bf16 products that accumulate in another order: logprobs agree to bf16's precision.
    for a, b in zip(packed[0] + packed[2], plain[0] + plain[2]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=0.05, rtol=0.05)
    assert packed[1] == plain[1]  # greedy after the update: the new weights, packed or not


def test_run_until_idle_serves_on_the_calling_thread_like_the_engine_thread(model):
    reqs = [GenerateRequest(input_ids=p, sampling=greedy(6 + i)) for i, p in enumerate(PROMPTS)]
    eng = GenerationEngine(model, EngineConfig(max_running_requests=2, context_length=64))
    threads, packed, late = set(), [], []
    step = eng.step
    extra = GenerateRequest(input_ids=PROMPTS[2], sampling=greedy(3))

    def recording_step():
        threads.add(threading.current_thread())
        packed.append(eng._packer.done)  # every step decodes with packed weights
        if not late:  # another thread submits while the run goes on: it is served too
            t = threading.Thread(target=lambda: late.append(eng.submit(extra)))
            t.start()
            t.join()
        step()

    eng.step = recording_step
    try:
        futs = eng.submit_all(reqs)
        eng.run_until_idle(timeout=60)
        assert threads == {threading.current_thread()} and not eng.alive
        assert eng._packer is not None and all(packed)
        # 4 requests through 2 rows: later ones joined as earlier ones finished
        outs = eng.collect(reqs, futs, timeout=1)
        for p, r, o in zip(PROMPTS, reqs, outs):
            assert list(o.output_ids) == reference_greedy(model, p, r.sampling.max_new_tokens)
        assert list(late[0].result(timeout=1).output_ids) == reference_greedy(model, PROMPTS[2], 3)
        assert eng.cache.n_free == eng.cache.n_pages
        eng.run_until_idle(timeout=60)  # nothing queued: returns at once
    finally:
        eng.close()


def test_run_until_idle_times_out_naming_what_was_left_and_fails_their_futures(model):
    eng = GenerationEngine(model, EngineConfig(max_running_requests=2, context_length=64))
    try:
        futs = eng.submit_all(
            [GenerateRequest(input_ids=PROMPTS[0], sampling=greedy(40)) for _ in range(3)]
        )
        with pytest.raises(TimeoutError, match=r"within 0.0 s: 3 requests were still queued"):
            eng.run_until_idle(timeout=0.0)
        for f in futs:
            with pytest.raises(TimeoutError):
                f.result(timeout=1)
        assert eng.scheduler.idle and eng.cache.n_free == eng.cache.n_pages
    finally:
        eng.close()
    started = GenerationEngine(model, EngineConfig(max_running_requests=2, context_length=64))
    started.start()
    try:
        with pytest.raises(RuntimeError, match="the engine thread runs already"):
            started.run_until_idle(timeout=1)
    finally:
        started.close()


def test_load_engine_loads_on_a_thread_that_ends_and_raises_its_errors_here(
    model_dir, tmp_path, monkeypatch
):
    seen = []
    init = GenerationEngine.__init__

    def recording_init(self, *a, **kw):
        seen.append(threading.current_thread())
        init(self, *a, **kw)

    monkeypatch.setattr(GenerationEngine, "__init__", recording_init)
    load_engine(model_dir, EngineConfig(max_running_requests=2, context_length=64)).close()
    # built off the caller's thread (its OpenMP team must not outlive the load), which ended
    assert seen[0].name == "model-load" and not seen[0].is_alive()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_engine(str(tmp_path), EngineConfig())
