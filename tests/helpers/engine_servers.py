"""Built-in generation servers in the test process: two tiny model versions, a server over
HTTP (``ServerThread``), greedy references to compare what a server generates with, and a
client on the same host without the run's secret (:func:`as_another_run`).

The servers load weight updates from anywhere (``weights_root="/"``) unless told otherwise:
the tests using them are about the protocol, not about where weights may come from
(tests/impl/model/gen/test_http_auth.py is)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import requests
import torch
from tiny_models import make_tiny_hf_model

from realhf.base.net import auth
from realhf.base.net.http_server import ServerThread
from realhf.impl.model import ReaLModel
from realhf.impl.model.gen import EngineConfig, GenerationEngine
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine

EOS, PAD = 0, 1


def two_model_versions(root) -> dict:
    """``{"v0": dir, "v1": dir}``: two tiny qwen2 models of one shape, different weights."""
    out = {}
    for name, seed in (("v0", 0), ("v1", 1)):
        out[name] = str(root / name)
        make_tiny_hf_model(
            "qwen2",
            out[name],
            seed=seed,
            perturb=0.3,
            vocab_size=268,
            eos_token_id=EOS,
            pad_token_id=PAD,
            max_position_embeddings=256,
        )
    return out


def engine_server(model_dir, load_weights=None, weights_root="/") -> ServerThread:
    """A started server of the built-in engine (``.engine`` is the engine); ``load_weights``
    replaces how a weight update loads a directory (to inject faults)."""
    cfg = EngineConfig(max_running_requests=4, context_length=256, num_threads=1)
    if load_weights is None:
        engine = load_engine(model_dir, cfg)
    else:
        model = ReaLModel.from_hf(model_dir).eval()
        engine = GenerationEngine(
            model, cfg, eos_token_ids=[EOS], pad_token_id=PAD, load_weights=load_weights
        )
    engine.start()
    srv = ServerThread(create_app(engine, weights_root=weights_root, shm_root=weights_root)).start()
    srv.engine = engine
    return srv


def stop_servers(*servers) -> None:
    for s in servers:
        s.stop()
        s.engine.close(timeout=10)


@torch.no_grad()
def greedy(model_dir, prompt, n):
    """The ``n`` greedy tokens the model in ``model_dir`` continues ``prompt`` with."""
    model = ReaLModel.from_hf(model_dir).eval()
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32))
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt) :]


def generate_greedy(url, prompt, n):
    """What the server at ``url`` generates greedily (``n`` tokens, EOS ignored)."""
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        },
        timeout=60,
    )
    return r.json()["output_ids"]


_ANOTHER_RUN = """
import json, sys
import requests
from realhf.base.net.http_server import auth_headers
url, calls = sys.argv[1], json.loads(sys.argv[2])
out = []
for method, path, body in calls:
    for headers in ({}, auth_headers()):
        r = requests.request(method, url + path, json=body, headers=headers, timeout=30)
        out.append(r.status_code)
print(json.dumps(out))
"""


def as_another_run(url, calls):
    """What the server at ``url`` answers ``calls`` (``[(method, path, body)]``) sent from a
    process of the same host without this run's secret: each call once with no token, once
    with the token of the secret that process makes itself (another run's).  Returns the
    statuses, two per call, in order."""
    env = {k: v for k, v in os.environ.items() if k not in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)}
    p = subprocess.run(
        [sys.executable, "-c", _ANOTHER_RUN, url, json.dumps(calls)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)
