"""Who may call the built-in generation server: control routes want the run's token,
generation routes the server's api key (when it has one), weight updates load from under the
publication directory only.  The attacker is a process on the same host without the run's
secret (tests/helpers/engine_servers.py: as_another_run)."""

from __future__ import annotations

import os
import shutil

import pytest
import requests
from engine_servers import as_another_run

from realhf.base.net import auth
from realhf.base.net.http_server import (
    ServerThread,
    auth_headers,
    bearer_refusal,
    generation_api_keys,
    is_loopback,
)
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine, load_tokenizer
from realhf.impl.model.gen.weight_update import WeightPathRefused, allowed_weight_path

from .conftest import load, reference_greedy

API_KEY = "sk-external-client"
KEY = {"Authorization": f"Bearer {API_KEY}"}
GENERATE = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
}
#: every control route, with a body it accepts
CONTROL = [
    ("POST", "/pause_generation", {}),
    ("POST", "/continue_generation", {}),
    ("POST", "/update_weights_from_disk", {"model_path": "/etc"}),
    ("POST", "/flush_cache", None),
    ("GET", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "x"}),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
]
#: every generation route, with a body it accepts
GENERATION = [
    ("POST", "/generate", GENERATE),
    ("PUT", "/generate", GENERATE),  # served by FastAPI's routing, not the POST shortcut
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    ("GET", "/v1/models", None),
]


@pytest.fixture(scope="module")
def published(tmp_path_factory, model_dir_b):
    """The publication directory with one version in it, and a directory outside it."""
    root = tmp_path_factory.mktemp("published")
    shutil.copytree(model_dir_b, root / "v1")
    outside = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(model_dir_b, outside / "v1")
    os.symlink(outside / "v1", root / "link-out")
    return root, outside


@pytest.fixture(scope="module")
def server(model_dir, published):
    tok = load_tokenizer(model_dir)
    engine = load_engine(
        model_dir, EngineConfig(max_running_requests=4, context_length=64), tokenizer=tok
    ).start()
    app = create_app(
        engine,
        tokenizer=tok,
        model_path=model_dir,
        weights_root=str(published[0]),
        api_keys=generation_api_keys(API_KEY, "127.0.0.1"),
    )
    srv = ServerThread(app).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close()


def call(srv, method, path, body, headers=None):
    return requests.request(method, srv.url + path, json=body, headers=headers, timeout=60)


def update(srv, path):
    """A weight update as the gserver manager sends it (with the run's token)."""
    return call(srv, "POST", "/update_weights_from_disk", {"model_path": path}, auth_headers())


def test_another_run_gets_401_on_every_control_and_generation_route(server):
    calls = CONTROL + GENERATION
    statuses = as_another_run(server.url, calls)
    assert statuses == [401] * (2 * len(calls)), list(zip(calls, statuses[::2], statuses[1::2]))
    # ...and none of it had an effect: the server was not paused, nothing was loaded
    assert not server.engine.paused and server.engine.weight_version == 0
    r = call(server, "POST", "/generate", GENERATE, KEY)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3
    # open: health and metrics
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 200


def test_a_401_says_what_is_wanted_and_reveals_no_key(server):
    for headers in (None, {"Authorization": "Bearer nope"}, {"Authorization": "Basic x"}, KEY):
        r = call(server, "POST", "/pause_generation", {}, headers)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        detail = r.json()["detail"]
        assert "/pause_generation" in detail and "run's token" in detail
        assert auth.http_token() not in detail and API_KEY not in detail
    r = call(server, "POST", "/generate", GENERATE)
    assert r.status_code == 401 and "api key" in r.json()["detail"]


def test_the_run_token_works_on_every_route_and_the_api_key_on_generation_only(server, published):
    for method, path, body in CONTROL:
        r = call(server, method, path, body, auth_headers())
        # /update_weights_from_disk of /etc: past the token, refused for the path
        assert r.status_code == (403 if "weights" in path else 200), (path, r.text)
        assert call(server, method, path, body, KEY).status_code == 401, path
    for method, path, body in GENERATION:
        for headers in (KEY, auth_headers()):
            assert call(server, method, path, body, headers).status_code == 200, path


def test_weights_load_from_under_the_publication_directory_only(server, published, model_dir):
    root, outside = published
    refused = [
        str(outside / "v1"),  # absolute path elsewhere
        str(root / ".." / outside.name / "v1"),  # .. out of the root
        str(root / "link-out"),  # a symlink inside that points out
        "v1",  # relative: to the server's working directory, not the root
        "",
    ]
    for path in refused:
        r = update(server, path)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["success"] is False and str(root) in r.json()["message"]
    assert server.engine.weight_version == 0
    # inside: loaded (and the server generates with it), then back to the first weights
    prompt = [8, 9, 10]
    r = call(
        server,
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(root / "v1")},
        auth_headers(),
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    body = {"input_ids": prompt, "sampling_params": GENERATE["sampling_params"]}
    out = call(server, "POST", "/generate", body, KEY).json()["output_ids"]
    assert out == reference_greedy(load(str(root / "v1")), prompt, 3)
    shutil.copytree(model_dir, root / "v2")
    r = call(
        server,
        "POST",
        "/update_weights_from_disk",
        {"model_path": str(root / "v2")},
        auth_headers(),
    )
    assert r.status_code == 200 and r.json()["success"], r.text


def test_allowed_weight_path_resolves_before_it_compares(tmp_path):
    root = tmp_path / "root"
    (root / "v1").mkdir(parents=True)
    (tmp_path / "rootless").mkdir()  # a sibling whose name starts with the root's
    assert allowed_weight_path(str(root / "v1"), str(root)) == os.path.realpath(root / "v1")
    assert allowed_weight_path(str(root / "v1" / ".." / "v1"), str(root)).endswith("v1")
    for bad in (str(tmp_path / "rootless"), str(root / ".."), "/"):
        with pytest.raises(WeightPathRefused, match="outside this server's publication"):
            allowed_weight_path(bad, str(root))
    # a symlinked root is resolved too: paths through the link or to its target both pass
    os.symlink(root, tmp_path / "alias")
    assert allowed_weight_path(str(root / "v1"), str(tmp_path / "alias"))
    assert allowed_weight_path(str(tmp_path / "alias" / "v1"), str(root))
    with pytest.raises(WeightPathRefused, match="NUL byte"):  # realpath raised ValueError
        allowed_weight_path(str(root / "v1\0"), str(root))
    with pytest.raises(WeightPathRefused, match="takes no weight updates"):
        allowed_weight_path(str(root / "v1"), None)


def test_generation_keys_are_on_beyond_loopback_by_default():
    token = auth.http_token()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
    assert not is_loopback("no-such-host.invalid")
    assert generation_api_keys(None, "127.0.0.1") is None
    assert generation_api_keys(None, "0.0.0.0") == (token,)
    assert generation_api_keys(None, "10.1.2.3") == (token,)
    assert generation_api_keys("", "10.1.2.3") is None
    assert generation_api_keys("k", "127.0.0.1") == (token, "k")
    assert bearer_refusal(None, None, "x") is None and bearer_refusal(None, (), "x") is None
    assert bearer_refusal(f"Bearer {token}", (token,), "x") is None
    assert bearer_refusal(f"bearer {token}", (token, "k"), "x") is None
    assert bearer_refusal("Bearer k", (token, "k"), "x") is None
    assert "no Authorization header" in bearer_refusal(None, (token,), "x")
    assert "wrong or malformed" in bearer_refusal(token, (token,), "x")  # no scheme
