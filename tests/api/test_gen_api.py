"""The generation protocol types: parsing SGLang bodies, validation, response shapes."""

import pytest

from realhf.api.core.gen_api import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    derive_seed,
    new_rid,
    parse_generate_body,
    parse_sglang_output,
)


def test_sampling_params_from_sglang_dict_and_greedy_rule():
    sp = SamplingParams.from_dict(
        {
            "n": 2,
            "temperature": 0.0,
            "top_p": 0.9,
            "top_k": -1,
            "max_new_tokens": 7,
            "min_new_tokens": 1,
            "stop_token_ids": [0, 1],
            "frequency_penalty": 0.0,
            "stop": None,
        }
    )
    assert sp.n == 2 and sp.max_new_tokens == 7 and sp.stop_token_ids == (0, 1)
    assert sp.greedy
    assert SamplingParams(top_k=1, temperature=1.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams.from_dict(None) == SamplingParams()
    # null means default, as in SGLang; max_new_tokens null means "up to the context"
    assert SamplingParams.from_dict({"temperature": None}).temperature == 1.0
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens is None


@pytest.mark.parametrize(
    "d, needle",
    [
        ({"temperature": -1}, "temperature=-1"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_k": 0}, "top_k=0"),
        ({"n": 0}, "n=0"),
        ({"max_new_tokens": -2}, "max_new_tokens=-2"),
        ({"max_new_tokens": 3, "min_new_tokens": 4}, "min_new_tokens=4"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature='hot'"),
        ({"ignore_eos": 1}, "ignore_eos=1"),
        ({"frobnicate": 1}, "sampling_params.frobnicate=1 is invalid: unknown field"),
        ({"repetition_penalty": 1.2}, "not supported by the built-in engine"),
        ({"stop": ["\n"]}, "sampling_params.stop"),
        # found by fuzzing (tests/impl/model/gen/test_http_fuzz.py): accepted before, they
        # failed the engine's step (an int64 tensor or a generator seed) with a 500
        ({"top_k": 2**63}, "use -1 for the whole vocabulary"),
        ({"sampling_seed": 2**64}, "sampling_seed=18446744073709551616"),
        ({"temperature": 10**400}, "temperature=1000"),
        ({"temperature": float("nan")}, "temperature=nan"),
    ],
)
def test_bad_sampling_params_name_the_field(d, needle):
    with pytest.raises(InvalidRequestError, match=None) as info:
        SamplingParams.from_dict(d)
    assert needle in str(info.value)


def test_temperature_and_top_p_are_stored_as_floats():
    # an integer temperature of 2**63 (valid JSON) reached a torch tensor as an int64 and
    # overflowed it; as a float it is a (very flat) temperature like any other
    sp = SamplingParams.from_dict({"temperature": 2**63, "top_p": 1})
    assert (sp.temperature, sp.top_p) == (float(2**63), 1.0)
    assert isinstance(sp.temperature, float) and isinstance(sp.top_p, float)


def test_seeds_of_samples_are_distinct_and_stable():
    seeds = {derive_seed(s, j) for s in range(20) for j in range(20)}
    assert len(seeds) == 400
    sp = SamplingParams(n=3, sampling_seed=5)
    assert sp.for_sample(0).sampling_seed == 5 and sp.for_sample(0).n == 1
    assert sp.for_sample(2).sampling_seed == derive_seed(5, 2)
    assert SamplingParams(n=2).for_sample(1).sampling_seed is None
    one = SamplingParams(temperature=0.5, sampling_seed=7)
    assert one.for_sample(0) == one and one.for_sample(0).n == 1


def test_request_ids_are_unique_also_across_a_fork():
    import os

    ids = [new_rid() for _ in range(1000)] + [GenerateRequest(input_ids=[1]).rid]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's ids: what it would make after fork
        os.write(w, " ".join(new_rid() for _ in range(3)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    child = os.read(r, 4096).decode().split()
    os.close(r)
    parent = [new_rid() for _ in range(3)]  # the same counter values as the child's
    assert len(set(ids + child + parent)) == len(ids) + 6


def test_parse_single_prompt_body():
    b = parse_generate_body(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4},
            "return_logprob": True,
            "stream": False,
            "rid": "abc",
        }
    )
    assert not b.returns_list and b.prompts == [[1, 2, 3]] and b.return_logprob == [True]
    [[req]] = b.requests(b.prompts)
    assert req.rid == "abc" and req.input_ids == (1, 2, 3) and req.sampling.max_new_tokens == 4


def test_parse_batch_and_n_expand_grouped_by_prompt():
    b = parse_generate_body(
        {"input_ids": [[1], [2, 3]], "sampling_params": [{"n": 2}, {"n": 1}], "rid": ["a", "b"]}
    )
    assert b.returns_list
    groups = b.requests(b.prompts)
    assert [[r.rid for r in g] for g in groups] == [["a-0", "a-1"], ["b"]]
    assert all(r.sampling.n == 1 for g in groups for r in g)
    b = parse_generate_body({"input_ids": [4], "sampling_params": {"n": 3}})
    assert b.returns_list and len(b.requests(b.prompts)[0]) == 3


def test_parse_text_body():
    b = parse_generate_body({"text": ["x", "y"]})
    assert b.texts == ["x", "y"] and b.prompts == [None, None] and b.batched


@pytest.mark.parametrize(
    "body, needle",
    [
        ([1, 2], "JSON object"),
        ({}, "exactly one of input_ids or text"),
        ({"input_ids": [1], "text": "a"}, "exactly one"),
        ({"input_ids": []}, "non-empty"),
        ({"input_ids": [[1], []]}, "every prompt"),
        ({"input_ids": [1, "a"]}, "every prompt"),
        ({"input_ids": [1], "stream": True}, "streaming is not supported"),
        ({"input_ids": [1], "bogus": 1}, "bogus=1 is invalid: unknown field"),
        ({"input_ids": [1], "image_data": 7}, "image_data"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "one value per prompt"),
        ({"input_ids": [1], "top_logprobs_num": 5}, "top logprobs"),
        ({"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
        ({"input_ids": [1], "rid": 5}, "rid=5"),
    ],
)
def test_bad_bodies_are_rejected_with_the_field(body, needle):
    with pytest.raises(InvalidRequestError) as info:
        parse_generate_body(body)
    assert needle in str(info.value)


def test_output_in_sglang_form_and_back():
    out = GenerateOutput(
        rid="r",
        prompt_len=3,
        output_ids=(7, 0),
        output_logprobs=(-0.5, -1.25),
        finish_reason=FinishReason("stop", matched=0),
        e2e_latency=0.1,
    )
    d = out.to_sglang(text="hi", return_logprob=True)
    assert d["text"] == "hi" and d["output_ids"] == [7, 0]
    m = d["meta_info"]
    assert m["finish_reason"] == {"type": "stop", "matched": 0}
    assert m["output_token_logprobs"] == [[-0.5, 7, None], [-1.25, 0, None]]
    assert m["prompt_tokens"] == 3 and m["completion_tokens"] == 2
    assert parse_sglang_output(d) == out
    # SGLang with a tokenizer omits output_ids; the ids come from the logprob entries
    del d["output_ids"]
    assert parse_sglang_output(d).output_ids == (7, 0)
    d = out.to_sglang(text=None, return_logprob=False, token_texts=None)
    assert "text" not in d and "output_token_logprobs" not in d["meta_info"]
    assert FinishReason("length", length=4).to_json() == {"type": "length", "length": 4}
    assert FinishReason("abort", message="m").to_json() == {"type": "abort", "message": "m"}
    with pytest.raises(ValueError):
        FinishReason("eos")


def test_request_validation():
    with pytest.raises(InvalidRequestError, match="non-empty"):
        GenerateRequest(input_ids=())
    with pytest.raises(InvalidRequestError, match="-3"):
        GenerateRequest(input_ids=(1, -3))
    with pytest.raises(InvalidRequestError, match="for_sample"):
        GenerateRequest(input_ids=(1,), sampling=SamplingParams(n=2))
    assert len(GenerateRequest(input_ids=[1]).rid) == 32
