"""Partial rollouts against a real in-process generation server (built-in engine, tiny random model)
behind a real gserver manager: chunking, interruption by a weight update, resubmission."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import pytest
from tiny_models import make_tiny_hf_model

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.rollout_api import GenerateGroupRequest
from realhf.api.core.rollout_config import GserverManagerConfig
from realhf.base.net.http_server import ServerThread
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.system.rollout.manager.client import ManagerClient
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.worker import GserverManager
from realhf.system.rollout.partial_rollout import GenerationFailed, PartialRolloutManager

EOS, PAD = 0, 1
BUDGET = 200


class Progress:
    """The trainer's side, set by the test."""

    def __init__(self):
        self.v = 0
        self.trained = 0

    def version(self) -> int:
        return self.v

    def trained_samples(self) -> int:
        return self.trained


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Version 0 and a version 1 with the same weights (so greedy outputs must not change)."""
    root = tmp_path_factory.mktemp("partial")
    v0 = str(root / "v0")
    make_tiny_hf_model(
        "qwen2",
        v0,
        seed=0,
        perturb=0.3,
        vocab_size=268,
        eos_token_id=EOS,
        pad_token_id=PAD,
        max_position_embeddings=512,
    )
    v1 = str(root / "v1")
    shutil.copytree(v0, v1)
    return {0: v0, 1: v1}


@pytest.fixture(scope="module")
def server(model_dirs):
    engine = load_engine(
        model_dirs[0], EngineConfig(max_running_requests=8, context_length=512, num_threads=1)
    ).start()
    # weight updates load the versions of model_dirs, which share one directory
    srv = ServerThread(create_app(engine, weights_root=os.path.dirname(model_dirs[0]))).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close()


@pytest.fixture
def stack(server, model_dirs):
    """A manager service over the server, its client and a partial-rollout manager."""
    progress = Progress()
    cfg = GserverManagerConfig(
        n_servers=1,
        train_batch_size=4,
        max_head_offpolicyness=4,
        weight_poll_interval_s=0.01,
        health_check_interval_s=0.2,
        server_wait_timeout_s=30,
        keep_weight_versions=None,
    )
    manager = GserverManager(
        cfg, progress, discover=lambda: [server.url], weight_dir=model_dirs.get
    )
    service = ManagerService(manager).start(60)
    yield progress, manager, service
    service.stop()


def gconfig(**kw):
    return GenerationHyperparameters(max_new_tokens=BUDGET, greedy=True, **kw)


async def _generate(
    service, prompt, chunk, n=1, stop=(EOS, PAD), budget=BUDGET, seed=None, greedy=True
):
    client = ManagerClient(service.url, timeout_s=30)
    prm = PartialRolloutManager(
        client, new_tokens_per_chunk=chunk, request_timeout_s=60, stop_token_ids=stop, seed=seed
    )
    try:
        adm = await client.allocate("rollout_worker/0", "inc0", "q")
        assert adm.success
        req = GenerateGroupRequest(
            "q", prompt, gconfig(n=n).new(max_new_tokens=budget, greedy=greedy)
        )
        members = await asyncio.gather(
            *(prm.generate_member(adm.rollout_id, req, j) for j in range(n))
        )
        group = await prm.generate_group(adm.rollout_id, req)
        return members, group, prm.stats
    finally:
        await prm.close()
        await client.close()


def _long_prompt(service):
    """A prompt whose greedy answer runs the whole budget (the random model may stop early)."""
    for i in range(2, 80, 3):
        (m,), _, _ = asyncio.run(_generate(service, (i, i + 1, i + 2), chunk=1 << 30))
        if len(m.output_ids) == BUDGET:
            return (i, i + 1, i + 2), m
    pytest.skip("no prompt among the candidates makes this random model generate the whole budget")


def test_chunks_concatenate_to_the_one_shot_answer(stack):
    _, _, service = stack
    prompt, ref = _long_prompt(service)
    (m,), group, stats = asyncio.run(_generate(service, prompt, chunk=17))
    assert m.output_ids == ref.output_ids and m.n_chunks == -(-BUDGET // 17)
    assert max(abs(a - b) for a, b in zip(m.output_logprobs, ref.output_logprobs)) < 1e-4
    assert m.no_eos and (m.version_start, m.version_end) == (0, 0)
    assert group.output_ids[0] == tuple(ref.output_ids) and group.no_eos == (True,)


def test_weight_update_aborts_and_the_rollout_resumes_with_its_prefix(stack, server):
    progress, manager, service = stack
    prompt, ref = _long_prompt(service)
    start = server.engine.stats()["generation_tokens_total"]

    def bump_when_generating():
        deadline = time.monotonic() + 30
        while (
            server.engine.stats()["generation_tokens_total"] < start + 3
            and time.monotonic() < deadline
        ):
            time.sleep(0.001)
        progress.v = 1  # the trainer published version 1: the manager pauses the server

    t = threading.Thread(target=bump_when_generating)
    t.start()
    (m,), _, stats = asyncio.run(_generate(service, prompt, chunk=1 << 30))
    t.join()
    assert m.n_interrupted >= 1 and stats["interrupted"] >= 1, (
        "the pause did not land mid-generation"
    )
    assert m.n_chunks >= 2
    assert m.output_ids == ref.output_ids, (
        "the resubmitted prefix must continue the same greedy answer"
    )
    assert len(m.output_logprobs) == BUDGET
    assert max(abs(a - b) for a, b in zip(m.output_logprobs, ref.output_logprobs)) < 1e-4
    assert m.version_start == 0 and m.version_end == 1
    assert service.call(lambda: manager.version) == 1


def test_group_members_and_stop_tokens(stack):
    _, _, service = stack
    # sampled members; each stops at EOS/pad (kept as its last token) or at the budget
    members, group, _ = asyncio.run(
        _generate(service, (5, 6, 7), chunk=8, n=3, budget=40, greedy=False)
    )
    assert group.group_size == 3
    for ids, lps, no_eos in zip(group.output_ids, group.output_logprobs, group.no_eos):
        assert len(ids) == len(lps) and 0 < len(ids) <= 40
        assert no_eos == (ids[-1] not in (EOS, PAD))


def test_a_request_the_server_rejects_fails_with_its_message(stack):
    _, _, service = stack
    with pytest.raises(GenerationFailed, match="context length 512"):
        asyncio.run(_generate(service, (3, 4, 5), chunk=1 << 30, budget=600))


def test_seeded_sampling_replays_the_same_tokens(stack):
    _, _, service = stack
    runs = [
        asyncio.run(_generate(service, (9, 10), chunk=5, n=2, budget=30, seed=7, greedy=False))[1]
        for _ in range(2)
    ]
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].output_ids[0] != runs[0].output_ids[1]  # members draw different seeds
    other = asyncio.run(_generate(service, (9, 10), chunk=5, n=2, budget=30, seed=8, greedy=False))[
        1
    ]
    assert other.output_ids != runs[0].output_ids


def test_a_group_goes_in_one_call_per_round_and_each_member_gets_its_tokens_alone(stack):
    _, manager, service = stack

    async def go():
        client = ManagerClient(service.url, timeout_s=30)
        prms = [
            PartialRolloutManager(
                client, new_tokens_per_chunk=6, request_timeout_s=60, stop_token_ids=(EOS,), seed=3
            )
            for _ in range(2)
        ]
        try:
            adm = await client.allocate("rollout_worker/0", "inc0", "q")
            req = GenerateGroupRequest(
                "q", (11, 12, 13), gconfig(n=4).new(max_new_tokens=30, greedy=False)
            )
            alone = [await prms[0].generate_member(adm.rollout_id, req, j) for j in range(4)]
            group = await prms[1].generate(adm.rollout_id, req, range(4))
            return alone, group, prms[0].stats, prms[1].stats
        finally:
            for p in prms:
                await p.close()
            await client.close()

    scheduled = service.call(lambda: sum(s.n_scheduled for s in manager.pool.servers.values()))
    alone, group, alone_stats, group_stats = asyncio.run(go())
    assert [m.output_ids for m in group] == [m.output_ids for m in alone]
    assert [m.n_chunks for m in group] == [m.n_chunks for m in alone]
    assert len({tuple(m.output_ids) for m in group}) > 1  # members draw their own seeds
    # one call per round: as many as the member with the most chunks needed, not their sum
    assert group_stats["calls"] == max(m.n_chunks for m in group)
    assert alone_stats["calls"] == sum(m.n_chunks for m in alone) > group_stats["calls"]
    after = service.call(lambda: sum(s.n_scheduled for s in manager.pool.servers.values()))
    assert after - scheduled == alone_stats["calls"] + group_stats["calls"]


def test_a_server_at_its_request_limit_is_asked_again_without_counting_a_failure(
    server, model_dirs
):
    refused = {"left": 3}

    async def app(scope, receive, send):  # the real server, refusing its first 3 generations
        if scope["type"] == "http" and scope["path"] == "/generate" and refused["left"]:
            refused["left"] -= 1
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"retry-after", b"0.1"), (b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
            return
        await inner(scope, receive, send)

    inner = create_app(server.engine)
    busy = ServerThread(app).start()
    cfg = GserverManagerConfig(n_servers=1, train_batch_size=4, server_wait_timeout_s=30)
    manager = GserverManager(cfg, Progress(), lambda: [busy.url], model_dirs.get)
    service = ManagerService(manager).start(60)

    async def go():
        client = ManagerClient(service.url, timeout_s=30)
        # max_server_failures=0: a counted failure would fail the rollout at once
        prm = PartialRolloutManager(client, request_timeout_s=60, max_server_failures=0)
        try:
            adm = await client.allocate("rollout_worker/0", "inc0", "q")
            req = GenerateGroupRequest("q", (3, 4, 5), gconfig(n=1).new(max_new_tokens=4))
            m = await prm.generate_member(adm.rollout_id, req, 0)
            return m, prm.stats
        finally:
            await prm.close()
            await client.close()

    try:
        m, stats = asyncio.run(go())
    finally:
        service.stop()
        busy.stop()
    assert len(m.output_ids) > 0 and stats["overloaded"] == 3 and not stats["server_failures"]
