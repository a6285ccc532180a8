"""Fuzzing the HTTP bodies of every route of the built-in generation server (hypothesis).

Each route gets bodies it accepts with one field made awkward, dropped or added, random JSON,
and bytes that are no JSON (tests/helpers/http_fuzz.py), with the run's token so that they
reach the handlers.  Every answer must be 2xx or 4xx: a bad body is the client's error (400
naming it), never the server's (5xx); afterwards the server still answers ``/health`` and is
neither paused nor dead.  One server for the module (tiny model, 64-token context).
"""

from __future__ import annotations

import shutil

import pytest
import requests
from http_fuzz import ANY_JSON, check_route, mutants
from hypothesis import strategies as st

from realhf.base.net.http_server import ServerThread, auth_headers
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine, load_tokenizer

from .conftest import VOCAB

TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
SAMPLING = mutants(
    st.fixed_dictionaries(
        {"max_new_tokens": st.integers(0, 8)},  # the default (128) exceeds the context
        optional={
            "min_new_tokens": st.integers(0, 2),
            "temperature": st.floats(0, 2),
            "top_p": st.floats(0.01, 1),
            "top_k": st.sampled_from([-1, 1, 5, 50]),
            "n": st.integers(1, 3),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "ignore_eos": st.booleans(),
            "sampling_seed": st.integers(0, 2**32),
        },
    )
)
GENERATE = mutants(
    st.fixed_dictionaries(
        {
            "input_ids": TOKENS | st.lists(TOKENS, min_size=1, max_size=3),
            "sampling_params": SAMPLING,
        },
        optional={
            "return_logprob": st.booleans(),
            "return_text_in_logprobs": st.booleans(),
            "rid": st.text(min_size=1, max_size=8),
        },
    )
) | mutants(st.fixed_dictionaries({"text": st.text(max_size=20), "sampling_params": SAMPLING}))
OPENAI = {
    "model": st.text(max_size=8),
    "max_tokens": st.integers(0, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 5]),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**32),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 2),
}
COMPLETIONS = mutants(
    st.fixed_dictionaries(
        {"prompt": TOKENS | st.lists(TOKENS, min_size=1, max_size=3) | st.text(max_size=20)},
        optional={**OPENAI, "best_of": st.integers(1, 3), "echo": st.just(False)},
    )
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
)
CHAT = mutants(
    st.fixed_dictionaries(
        {
            "messages": st.lists(MESSAGE, min_size=1, max_size=3)
            | st.lists(mutants(MESSAGE), min_size=1, max_size=2)
        },
        optional={
            **OPENAI,
            "logprobs": st.booleans(),
            "max_completion_tokens": st.integers(0, 8),
            "top_logprobs": st.integers(0, 2),
        },
    )
)


@pytest.fixture(scope="module")
def published(tmp_path_factory, model_dir_b):
    root = tmp_path_factory.mktemp("fuzz_published")
    shutil.copytree(model_dir_b, root / "v1")
    return root


@pytest.fixture(scope="module")
def server(model_dir, published):
    tok = load_tokenizer(model_dir)
    engine = load_engine(
        model_dir,
        EngineConfig(max_running_requests=4, context_length=64, request_timeout_s=30),
        tokenizer=tok,
    ).start()
    app = create_app(engine, tokenizer=tok, model_path=model_dir, weights_root=str(published))
    srv = ServerThread(app).start()
    srv.engine = engine
    srv.session = requests.Session()
    srv.session.headers.update(auth_headers())
    yield srv
    srv.session.close()
    srv.stop()
    engine.close()


def _update_bodies(root):
    paths = st.sampled_from([str(root / "v1"), str(root / "missing"), str(root), "/etc", "v1"])
    return mutants(
        st.fixed_dictionaries(
            {"model_path": paths},
            optional={
                "abort_all_requests": st.booleans(),
                "load_format": st.none(),
                "weight_version": st.text(max_size=4),
            },
        )
    )


#: every route; None: the body is made by the test (it needs the module's fixtures)
ROUTES = {
    ("POST", "/generate"): GENERATE,
    ("PUT", "/generate"): GENERATE,
    ("POST", "/v1/completions"): COMPLETIONS,
    ("POST", "/v1/chat/completions"): CHAT,
    ("POST", "/abort_request"): mutants(st.fixed_dictionaries({"rid": st.text(max_size=8)})),
    ("POST", "/update_weights_from_disk"): None,
    ("POST", "/pause_generation"): ANY_JSON,
    ("POST", "/continue_generation"): ANY_JSON,
    ("POST", "/flush_cache"): ANY_JSON,
    ("GET", "/flush_cache"): ANY_JSON,
    ("GET", "/v1/models"): ANY_JSON,
    ("GET", "/get_model_info"): ANY_JSON,
    ("GET", "/get_server_info"): ANY_JSON,
    ("GET", "/health"): ANY_JSON,
    ("GET", "/metrics"): ANY_JSON,
}


@pytest.mark.parametrize("method,path", list(ROUTES))
def test_random_bodies_get_2xx_or_4xx_and_the_server_keeps_serving(server, published, method, path):
    shaped = ROUTES[(method, path)]
    if shaped is None:
        shaped = _update_bodies(published)

    def resume():  # a pause must not turn the other examples into instant "aborted" answers
        server.session.post(server.url + "/continue_generation", timeout=30).raise_for_status()

    check_route(
        server.session, server.url, method, path, shaped, resume if "pause" in path else None
    )
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert server.engine.alive and not server.engine.paused
