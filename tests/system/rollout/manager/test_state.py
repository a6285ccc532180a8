"""gserver manager: scheduling, admission, leases, held hand-offs, weight updates, dead servers.

Unit tests drive :class:`GserverManager` directly with a fake clock and trainer; the others
run it behind HTTP against real generation servers (built-in engine, tiny random model),
in-process or — for killing a server — as separate processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import time

import pytest
import quickstart_runs
import requests
from engine_servers import engine_server, generate_greedy, greedy, two_model_versions

from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.rollout_api import (
    AllocateRequest,
    FinishRequest,
    FinishStatus,
    GenerateGroupRequest,
    HeartbeatRequest,
    ScheduleRequest,
)
from realhf.api.core.rollout_config import GserverManagerConfig, SchedulePolicy
from realhf.base.net import network
from realhf.base.net.http_server import auth_headers
from realhf.impl.model.comm.weight_broadcast import WeightSender
from realhf.impl.model.conversion.flat_file import write_model
from realhf.impl.model.gen.weight_update import WeightUpdateError
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.system.rollout.manager import server_pool
from realhf.system.rollout.manager.client import ManagerClient
from realhf.system.rollout.manager.routing import NoServerAvailable
from realhf.system.rollout.manager.server_pool import ServerState
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.state import GserverManager, RolloutOwner
from realhf.system.rollout.partial_rollout import GenerationFailed, PartialRolloutManager
from realhf.system.rollout.staleness import RolloutNotRunning


class Progress:
    def __init__(self, v=0, trained=0):
        self.v, self.trained = v, trained

    def version(self):
        return self.v

    def trained_samples(self):
        return self.trained


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _manager(urls=("http://a", "http://b", "http://c"), clock=None, **cfg):
    cfg = {"n_servers": 1, "train_batch_size": 4, "max_head_offpolicyness": 1, **cfg}
    m = GserverManager(
        GserverManagerConfig(**cfg),
        Progress(),
        lambda: list(urls),
        lambda v: f"/w/{v}",
        clock=clock or time.monotonic,
    )
    for u in urls:
        m.servers[u] = ServerState(u)
    return m


def _sched(m, rid, prev="", prev_v=-1, exclude=()):
    return asyncio.run(m.schedule(ScheduleRequest(rid, 10, 100, prev, prev_v, tuple(exclude))))


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("policy", list(SchedulePolicy) + ["least_requests"])
def test_schedule_spreads_and_continuations_stick_while_the_version_is_unchanged(policy):
    m = _manager(schedule_policy=policy)  # a policy's name (CLI, YAML) works as well
    assert m.config.schedule_policy is SchedulePolicy(policy)
    rid = m.allocate(AllocateRequest("w", "i")).rollout_id
    urls = [_sched(m, rid).url for _ in range(6)]
    assert sorted(set(urls)) == ["http://a", "http://b", "http://c"]  # load spreads in every policy
    first = _sched(m, rid)
    assert all(_sched(m, rid, first.url, first.version).url == first.url for _ in range(5))
    m.servers[first.url].version = 1  # updated since: the cached prefix is worthless
    other = [_sched(m, rid, first.url, 0).url for _ in range(3)]
    assert other != [first.url] * 3
    assert (
        _sched(m, rid, first.url, 0, exclude=[u for u in m.servers if u != "http://b"]).url
        == "http://b"
    )


def test_schedule_errors():
    m = _manager()
    with pytest.raises(RolloutNotRunning):
        _sched(m, "nope")
    rid = m.allocate(AllocateRequest("w", "i")).rollout_id
    for s in m.servers.values():
        m.pool.mark_dead(s, "killed in a test")
    with pytest.raises(NoServerAvailable, match="killed in a test"):
        _sched(m, rid)
    assert m.allocate(AllocateRequest("w", "i")).reason == "no_server"


# ---------------------------------------------------------------- admission, leases, hand-off


def test_allocation_is_refused_for_staleness_then_capacity():
    m = _manager(train_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=3)
    got = [m.allocate(AllocateRequest("w", "i")) for _ in range(3)]
    assert [g.success for g in got] == [True, True, False] and got[2].reason == "staleness"
    assert got[0].deadline == 0 and got[0].version == 0
    m.pool.version = 1  # the trainer stepped; (0 accepted + 2 running) // 2 = 1 <= 1
    assert m.allocate(AllocateRequest("w", "i")).success
    assert m.allocate(AllocateRequest("w", "i")).reason == "capacity"


def test_one_request_admits_slots_in_order_until_the_first_refusal():
    m = _manager(train_batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=3)
    # η = 1 admits 4 at version 0, the cap 3: three slots and the reason for the fourth
    got = m.allocate(AllocateRequest("w", "i", "q", count=5))
    slots = got.slots()
    assert got.success and len(slots) == 3 and got.reason == "capacity"
    assert slots[0].rollout_id == got.rollout_id and len({s.rollout_id for s in slots}) == 3
    assert all(s.version == 0 and s.deadline == 1 for s in slots)
    assert m.allocate(AllocateRequest("w", "i", count=2)).slots() == []
    assert len(m.staleness.owned_by(RolloutOwner("w", "i"))) == 3
    m2 = _manager(train_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=8)
    got = m2.allocate(AllocateRequest("w", "i", count=3))
    assert len(got.slots()) == 2 and got.reason == "staleness"  # all of step 0, no more
    full = m2.allocate(AllocateRequest("w", "i", count=1))
    assert not full.success and full.reason == "staleness"


def test_silent_worker_loses_its_leases_and_a_restarted_one_its_old_rollouts():
    clock = Clock()
    m = _manager(clock=clock, lease_ttl_s=10, train_batch_size=100)
    a = [m.allocate(AllocateRequest("rollout_worker/0", "inc-a")).rollout_id for _ in range(3)]
    assert m.staleness.get(a[0]).owner == RolloutOwner("rollout_worker/0", "inc-a")
    b = [m.allocate(AllocateRequest("rollout_worker/1", "inc-b")).rollout_id for _ in range(2)]
    clock.t += 6
    assert m.heartbeat(HeartbeatRequest("rollout_worker/1", "inc-b")).n_rollouts == 2
    clock.t += 6  # worker 0 silent for 12 s > 10 s
    assert sorted(m.expire_leases()) == sorted(a)
    assert m.staleness.running == 2 and m.status()["stats"]["expired"] == 3
    # worker 1 restarts: a new incarnation releases what the old process held
    m.allocate(AllocateRequest("rollout_worker/1", "inc-b2"))
    assert not any(m.staleness.is_running(r) for r in b) and m.staleness.running == 1
    assert m.status()["owners"] == {"rollout_worker/1": "inc-b2"}


def test_an_index_a_dead_worker_never_delivered_is_reissued_when_the_trainer_misses_it():
    async def go():
        m = _manager(train_batch_size=4, max_head_offpolicyness=0, max_concurrent_rollouts=8)
        dead = [m.allocate(AllocateRequest("rollout_worker/0", "old")).rollout_id for _ in range(2)]
        live = m.allocate(AllocateRequest("rollout_worker/1", "x")).rollout_id
        idx = [(await m.finish(FinishRequest(r, True))).index for r in dead + [live]]
        assert idx == [0, 1, 2] and m.delivering[0].incarnation == "old"
        # the trainer misses 0, 1 (and 3, never accepted); worker 0 is alive: nothing happens
        assert m.reissue_lost([0, 1, 3]) == []
        # worker 0 restarts: its new incarnation releases the old one, whose indices the
        # trainer still misses (it died after taking them), so they are handed out again
        new = AllocateRequest("rollout_worker/0", "new")
        fresh = [m.allocate(new).rollout_id]
        assert not m.allocate(new).success  # step 0 has one index left (3)
        assert m.reissue_lost([0, 3]) == [0] and m.status()["holes"] == [0]
        assert m.reissue_lost([0]) == []  # once
        fresh.append(m.allocate(new).rollout_id)  # the hole is a free index again
        got = [(await m.finish(FinishRequest(r, True))).index for r in fresh]
        assert got == [0, 3] and m.staleness.stats["filled_holes"] == 1
        # trained indices are forgotten
        m.trained_samples = 4
        assert m.reissue_lost([1]) == [] and m.delivering == {}

    asyncio.run(go())


def test_finish_holds_a_rollout_until_the_earlier_deadline_finishes():
    async def go():
        m = _manager(train_batch_size=2, max_head_offpolicyness=1, max_concurrent_rollouts=8)
        old = [m.allocate(AllocateRequest("w", "i")).rollout_id for _ in range(4)]
        for r in old[:2]:
            assert (await m.finish(FinishRequest(r, True))).status is FinishStatus.ACCEPTED
        m.pool.version = 1
        new = m.allocate(AllocateRequest("w", "i")).rollout_id
        assert (await m.finish(FinishRequest(new, True, wait_s=0.05))).status is FinishStatus.WAIT
        held = asyncio.create_task(m.finish(FinishRequest(new, True, wait_s=5)))
        await asyncio.sleep(0.05)
        assert not held.done()
        assert (await m.finish(FinishRequest(old[2], True))).index == 2
        filtered = await m.finish(FinishRequest(old[3], False))
        assert filtered.status is FinishStatus.REJECTED  # filtered: frees it
        reply = await asyncio.wait_for(held, 2)
        assert (reply.status, reply.index) == (FinishStatus.ACCEPTED, 3)
        with pytest.raises(RolloutNotRunning):
            await m.finish(FinishRequest(old[3], True))

    asyncio.run(go())


# ---------------------------------------------------------------- with real servers


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return two_model_versions(tmp_path_factory.mktemp("gsm"))


def _shut_down(service, servers, sender=None) -> None:
    service.stop()
    for s in servers:
        s.stop()
        s.engine.close()
    if sender is not None:
        sender.close()


@pytest.mark.parametrize("sync", ["disk", "shm", "broadcast"])
def test_weight_updates_reach_every_server_and_old_versions_are_pruned(dirs, tmp_path, sync):
    servers = [engine_server(dirs["v0"]) for _ in range(2)]
    sender = WeightSender(timeout=10.0) if sync == "broadcast" else None
    # where version v is published (tmp_path stands in for /dev/shm; broadcast: the sender)
    where = {
        "shm": lambda v: str(tmp_path / f"v{v}.flat"),
        "disk": lambda v: str(tmp_path / f"v{v}"),
        "broadcast": lambda v: sender.address,
    }[sync]
    weights = {}

    def publish(v):  # the trainer publishes v1 (model b) then v2 (model a again)
        src, weights[v] = dirs["v1" if v == 1 else "v0"], where(v)
        if sync == "shm":
            write_model(ReaLModel.from_hf(src), weights[v], v)
        elif sync == "broadcast":
            model = ReaLModel.from_hf(src)
            sender.stage(model.flat_params, model.param_spec, v)
        else:
            shutil.copytree(src, weights[v])
        progress.v = v

    progress = Progress()
    cfg = GserverManagerConfig(
        n_servers=2,
        weight_poll_interval_s=0.02,
        health_check_interval_s=0.2,
        server_wait_timeout_s=30,
        keep_weight_versions=1,
        weight_sync=sync,
    )
    m = GserverManager(cfg, progress, lambda: [s.url for s in servers], where)
    service = ManagerService(m).start(60)
    try:
        prompt = (7, 8, 9)
        ref_a, ref_b = greedy(dirs["v0"], prompt, 6), greedy(dirs["v1"], prompt, 6)
        assert ref_a != ref_b
        publish(1)
        deadline = time.monotonic() + 20
        while service.call(lambda: m.version) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(generate_greedy(s.url, prompt, 6) == ref_b for s in servers)
        status = requests.get(service.url + "/status", headers=auth_headers(), timeout=10).json()
        assert status["version"] == 1 and all(s["version"] == 1 for s in status["servers"].values())
        publish(2)
        while service.call(lambda: m.version) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(generate_greedy(s.url, prompt, 6) == ref_a for s in servers)
        if sync == "broadcast":  # each server pulled each version once, over its own pair
            assert sender.wait_transfers(10)
            assert sender.sent == 4 and len(sender._pairs) == 2 and sender.failed == 0
        else:
            assert not os.path.exists(weights[1]) and os.path.exists(weights[2])
        if sync == "shm":  # retired: the trainer's next write reuses its memory
            assert os.path.exists(tmp_path / "spare.flat")
        service.check()
    finally:
        _shut_down(service, servers, sender)


def test_a_pull_of_a_version_the_trainer_replaced_moves_the_servers_to_the_newer_one(dirs):
    """``broadcast`` keeps only the latest version: the manager read version 1, but the
    trainer staged 2 before the servers pulled.  They are told so (not a failure), and the
    update goes on to 2."""
    servers = [engine_server(dirs["v0"]) for _ in range(2)]
    sender = WeightSender(timeout=10.0)
    for v, src in ((1, "v0"), (2, "v1")):
        model = ReaLModel.from_hf(dirs[src])
        sender.stage(model.flat_params, model.param_spec, v)
    progress = Progress()
    progress.v = 1  # what the manager reads: the trainer has moved on since
    cfg = GserverManagerConfig(
        n_servers=2,
        weight_poll_interval_s=0.02,
        health_check_interval_s=0.2,
        server_wait_timeout_s=30,
        weight_sync="broadcast",
    )
    m = GserverManager(cfg, progress, lambda: [s.url for s in servers], lambda v: sender.address)
    service = ManagerService(m).start(60)
    try:
        prompt = (7, 8, 9)
        deadline = time.monotonic() + 20
        while service.call(lambda: m.version) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        status = requests.get(service.url + "/status", headers=auth_headers(), timeout=10).json()
        assert status["version"] == 2 and all(s["version"] == 2 for s in status["servers"].values())
        assert all(s["live"] for s in status["servers"].values())
        assert all(
            generate_greedy(s.url, prompt, 6) == greedy(dirs["v1"], prompt, 6) for s in servers
        )
        assert sender.wait_transfers(10)
        assert sender.sent == 2 and sender.failed == 0  # version 2 once per server
        assert all(s.engine.weight_version == 1 for s in servers)  # one load each
        service.check()
    finally:
        _shut_down(service, servers, sender)


def test_a_server_that_fails_a_weight_update_leaves_service_and_rejoins(dirs, monkeypatch):
    monkeypatch.setattr(server_pool, "REJOIN_RETRY_S", 0.3)
    failures = {"left": 2}

    def flaky_load(model, path):
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(f"cannot read {path} (a test fault)")
        model.load_hf_weights(path)

    good = engine_server(dirs["v0"])
    flaky = engine_server(dirs["v0"], load_weights=flaky_load)
    progress = Progress()
    cfg = GserverManagerConfig(
        n_servers=2,
        weight_poll_interval_s=0.02,
        health_check_interval_s=0.1,
        server_wait_timeout_s=30,
        keep_weight_versions=None,
    )
    m = GserverManager(cfg, progress, lambda: [good.url, flaky.url], lambda v: dirs["v1"])
    service = ManagerService(m).start(60)
    try:
        progress.v = 1
        deadline = time.monotonic() + 30
        seen_out = False
        while time.monotonic() < deadline:
            st = requests.get(service.url + "/status", headers=auth_headers(), timeout=10).json()
            srv = st["servers"][flaky.url]
            if not srv["live"]:
                seen_out = True
                assert "update_weights_from_disk" in srv["dead_reason"], srv
                assert st["version"] == 1 and st["servers"][good.url]["live"]
            elif seen_out and srv["version"] == 1:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"the flaky server did not leave and rejoin: {st}")
        assert failures["left"] == 0  # its second failure was a rejoin attempt
        prompt = (7, 8, 9)
        assert generate_greedy(flaky.url, prompt, 6) == greedy(dirs["v1"], prompt, 6)
        service.check()  # the manager kept running throughout
    finally:
        service.stop()
        for s in (good, flaky):
            s.stop()
            s.engine.close(timeout=10)


def test_a_weight_update_that_fails_on_every_server_stops_the_manager_naming_it(dirs):
    slow = engine_server(dirs["v0"], load_weights=lambda model, path: time.sleep(3))
    progress = Progress()
    cfg = GserverManagerConfig(
        n_servers=1,
        weight_poll_interval_s=0.02,
        server_wait_timeout_s=30,
        weight_update_timeout_s=0.5,
        keep_weight_versions=None,
    )
    m = GserverManager(cfg, progress, lambda: [slow.url], lambda v: dirs["v1"])
    service = ManagerService(m).start(60)
    try:
        progress.v = 1
        deadline = time.monotonic() + 20
        while service.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WeightUpdateError) as e:
            service.check()
        assert slow.url in str(e.value) and "update_weights_from_disk" in str(e.value)
        assert "within 0.5s" in str(e.value) and "version 1" in str(e.value)
    finally:
        service.stop()
        slow.stop()
        slow.engine.close(timeout=10)


def test_http_errors_are_typed(dirs):
    srv = engine_server(dirs["v0"])
    m = GserverManager(
        GserverManagerConfig(server_wait_timeout_s=30), Progress(), lambda: [srv.url], lambda v: ""
    )
    service = ManagerService(m).start(60)
    client = ManagerClient(service.url, timeout_s=10)

    async def go():
        try:
            with pytest.raises(RolloutNotRunning):
                await client.schedule(ScheduleRequest("ghost", 3, 4))
            r = requests.post(
                service.url + "/allocate_rollout",
                json={"worker": "w"},
                headers=auth_headers(),
                timeout=10,
            )
            assert r.status_code == 400 and "incarnation" in r.json()["error"]["message"]
            r = requests.post(
                service.url + "/schedule_request",
                json={"rollout_id": 3},
                headers=auth_headers(),
                timeout=10,
            )
            assert r.status_code == 400
            adm = await client.allocate("w", "i")
            assert adm.success and (await client.heartbeat("w", "i")).n_rollouts == 1
            assert (await client.schedule(ScheduleRequest(adm.rollout_id, 3, 4))).url == srv.url
        finally:
            await client.close()

    try:
        asyncio.run(go())
    finally:
        service.stop()
        srv.stop()
        srv.engine.close()


def test_http_bodies_are_validated_completely_and_errors_name_the_field(dirs):
    srv = engine_server(dirs["v0"])
    m = GserverManager(
        GserverManagerConfig(server_wait_timeout_s=30), Progress(), lambda: [srv.url], lambda v: ""
    )
    service = ManagerService(m).start(60)

    def post(path, body=None, headers=None, **kw):
        headers = {**auth_headers(), **(headers or {})}
        r = requests.post(service.url + path, json=body, headers=headers, timeout=10, **kw)
        return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else r.json()

    try:
        rid = post("/allocate_rollout", {"worker": "w", "incarnation": "i"})[1]["rollout_id"]
        sched = {"rollout_id": rid, "prompt_len": 3, "new_token_budget": 4}
        # a string is no tuple (the old check made it ('a', 'b', 'c'))
        status, msg = post("/schedule_request", {**sched, "exclude": "abc"})
        assert status == 400 and msg.startswith("ScheduleRequest.exclude: ") and "'abc'" in msg
        status, msg = post("/schedule_request", {**sched, "exclude": [srv.url, 5]})
        assert status == 400 and "ScheduleRequest.exclude[1]: " in msg
        status, msg = post(
            "/schedule_request", {**sched, "prompt_len": -1, "new_token_budget": "4"}
        )
        assert status == 400
        assert "ScheduleRequest.prompt_len: Input should be greater than or equal to 1" in msg
        assert "ScheduleRequest.new_token_budget: Input should be a valid integer" in msg
        status, msg = post("/finish_rollout", {"rollout_id": rid, "accepted": True, "wait_s": -3})
        assert status == 400 and "FinishRequest.wait_s" in msg
        status, msg = post("/heartbeat", {"worker": "w", "incarnation": "i", "extra": 1})
        assert status == 400 and "HeartbeatRequest.extra: unknown field" in msg
        status, msg = post(
            "/allocate_rollout", data="{not json", headers={"Content-Type": "application/json"}
        )
        assert status == 400 and "not valid JSON" in msg
        status, msg = post("/report_server_failure")
        assert status == 400 and "send a ServerFailureReport JSON object" in msg
        # semantic errors keep their statuses, now through exception handlers
        status, msg = post("/schedule_request", {**sched, "rollout_id": "ghost"})
        assert status == 409 and "ghost" in msg
        assert post("/schedule_request", sched) == (200, {"url": srv.url, "version": 0})
        service.call(lambda: m.pool.mark_dead(m.servers[srv.url], "killed by the test"))
        status, msg = post("/schedule_request", sched)
        assert status == 503 and "no live generation server" in msg
        service.check()
    finally:
        service.stop()
        srv.stop()
        srv.engine.close()


def test_a_manager_that_cannot_start_raises_its_own_error_and_frees_the_port():
    cfg = GserverManagerConfig(server_wait_timeout_s=0.3, health_check_interval_s=0.1)
    service = ManagerService(GserverManager(cfg, Progress(), lambda: [], lambda v: ""))
    with pytest.raises(TimeoutError, match="0 of 1 generation servers"):
        service.start(30)
    assert not service.alive
    with pytest.raises(TimeoutError, match="0 of 1 generation servers"):
        service.check()
    port = service.port
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def _spawn_server(model_dir, port):
    return quickstart_runs.popen_module(
        "realhf.apps.serve",
        [
            "--model-path",
            model_dir,
            "--port",
            str(port),
            "--max-running-requests",
            "16",
            "--context-length",
            "256",
            "--num-threads",
            "1",
        ],
    )


@pytest.mark.slow
def test_killing_a_server_mid_run_moves_requests_to_the_others_then_fails_clearly(dirs):
    ports = network.find_multiple_free_ports(2)
    procs = [_spawn_server(dirs["v0"], p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for p in procs:  # wait for the ready line
            for line in p.stdout:
                if "ready" in line:
                    break
        cfg = GserverManagerConfig(
            n_servers=2,
            train_batch_size=64,
            health_check_interval_s=0.2,
            server_wait_timeout_s=30,
            health_timeout_s=2,
        )
        m = GserverManager(cfg, Progress(), lambda: list(urls), lambda v: "")
        service = ManagerService(m).start(60)

        async def go():
            client = ManagerClient(service.url, timeout_s=30)
            prm = PartialRolloutManager(
                client,
                new_tokens_per_chunk=16,
                request_timeout_s=30,
                max_server_failures=2,
                no_server_wait_s=1.0,
            )
            g = GenerationHyperparameters(n=2, max_new_tokens=120, temperature=1.0)
            try:

                async def one(i):
                    adm = await client.allocate("w", "i")
                    return await prm.generate_group(
                        adm.rollout_id, GenerateGroupRequest(f"q{i}", (3 + i, 4, 5), g)
                    )

                tasks = [asyncio.create_task(one(i)) for i in range(12)]
                # kill server 0 as soon as it has work: a fixed sleep raced fast generation
                deadline = time.monotonic() + 30
                while (await client.status())["servers"][urls[0]]["n_scheduled"] < 2:
                    assert time.monotonic() < deadline, "no chunk reached server 0 in 30 s"
                    await asyncio.sleep(0.005)
                procs[0].send_signal(signal.SIGKILL)
                groups = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                assert all(len(ids) > 0 for grp in groups for ids in grp.output_ids)
                status = await client.status()
                assert (
                    status["servers"][urls[0]]["live"] is False
                    and status["servers"][urls[1]]["live"]
                )
                # after the kill, only the survivor is scheduled
                adm = await client.allocate("w", "i")
                assert {
                    (await client.schedule(ScheduleRequest(adm.rollout_id, 3, 8))).url
                    for _ in range(4)
                } == {urls[1]}
                procs[1].send_signal(signal.SIGKILL)
                # with no server left, a chunk waits no_server_wait_s for one, then fails
                with pytest.raises(GenerationFailed, match="no live generation server for 1s"):
                    await prm.generate_group(
                        adm.rollout_id, GenerateGroupRequest("last", (3, 4), g)
                    )
                return prm.stats
            finally:
                await prm.close()
                await client.close()

        try:
            stats = asyncio.run(go())
            assert stats["server_failures"] >= 1
        finally:
            service.stop()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


# ---------------------------------------------------------------- the worker


def test_manager_worker_publishes_updates_saves_and_resumes(
    memory_name_resolve, trial, dirs, tmp_path
):
    from realhf.api.core.system_api import WorkerInformation
    from realhf.base import constants, name_resolve, names
    from realhf.system.rollout.manager.worker import GserverManagerWorker
    from realhf.system.worker.base import WorkerStatus

    constants.set_fileroot(str(tmp_path / "root"))
    srv = engine_server(dirs["v0"])
    name_resolve.add_subentry(names.gen_servers("exp", trial), srv.url)
    state_path = str(tmp_path / "state.json")
    cfg = GserverManagerConfig(
        n_servers=1,
        train_batch_size=2,
        max_head_offpolicyness=0,
        host="127.0.0.1",
        weight_poll_interval_s=0.05,
        server_wait_timeout_s=30,
        state_path=state_path,
        state_save_interval_s=0.1,
    )

    def make():
        w = GserverManagerWorker("exp", trial, "gserver_manager", 0)
        w.handle_control(
            "configure",
            worker_info=WorkerInformation("exp", trial, "gserver_manager", 0, 1),
            config=cfg,
        )
        w.handle_control("start")
        w.step()  # reads names.trainer_start and starts admitting
        assert w.manager.trainer_ready
        return w

    def trainer_start(trained, ckpt=None):
        start = json.dumps({"trained_samples": trained, "version": 0, "checkpoint": ckpt})
        name_resolve.add(names.trainer_start("exp", trial), start, replace=True)

    try:
        trainer_start(0)
        w = make()
        addr = name_resolve.get(names.gen_server_manager("exp", trial))
        client = ManagerClient(f"http://{addr}", 10)

        async def run_two():
            try:
                ids = [(await client.allocate("rw/0", "i")).rollout_id for _ in range(2)]
                return [(await client.finish(r, True)).index for r in ids]
            finally:
                await client.close()

        assert asyncio.run(run_two()) == [0, 1]
        # the trainer trains them and publishes version 1
        shutil.copytree(dirs["v1"], constants.weight_publication_dir("actor", 1, "exp", trial))
        name_resolve.add(names.model_version("exp", trial, "actor"), "1")
        name_resolve.add(names.training_samples("exp", trial), "2")
        deadline = time.monotonic() + 20
        while (
            requests.get(f"http://{addr}/status", headers=auth_headers(), timeout=5).json()[
                "version"
            ]
            < 1
        ):
            w.step()
            assert time.monotonic() < deadline
        assert generate_greedy(srv.url, (7, 8, 9), 5) == greedy(dirs["v1"], (7, 8, 9), 5)
        time.sleep(0.15)
        w.step()  # saves the counters
        name_resolve.add(names.experiment_status("exp", trial), "COMPLETE")
        while w.status != WorkerStatus.COMPLETED:
            w.step()
            assert time.monotonic() < deadline
        w._exit_hook()
        with open(state_path) as f:
            assert json.load(f)["staleness"]["accepted_total"] == 2
        # a restarted manager resumes at the trainer's count and syncs the server to version 1
        name_resolve.add(names.training_samples("exp", trial), "2", replace=True)
        trainer_start(2, ckpt=str(tmp_path / "ckpt"))  # a resumed trainer: saved counters load

        def restarted_status():
            w2 = make()
            try:
                addr2 = name_resolve.get(names.gen_server_manager("exp", trial))
                return requests.get(
                    f"http://{addr2}/status", headers=auth_headers(), timeout=5
                ).json()
            finally:
                w2._exit_hook()

        st = restarted_status()
        assert st["accepted_total"] == 2 and st["version"] == 1 and st["capacity"] == 2
        os.remove(state_path)  # without saved counters the trainer's count still sets the start
        st = restarted_status()
        assert st["accepted_total"] == 2 and st["accepted_pending"] == 0
    finally:
        constants.set_fileroot(None)
        srv.stop()
        srv.engine.close()


def test_no_rollout_is_admitted_before_the_trainer_announces_its_start():
    m = _manager()
    m.trainer_ready = False
    from realhf.api.core.rollout_api import AllocateRequest

    reply = m.allocate(AllocateRequest("rw/0", "inc"))
    assert not reply.success and reply.reason == "trainer_not_ready"
    m.trainer_ready = True
    assert m.allocate(AllocateRequest("rw/0", "inc")).success


def test_manager_keeps_saved_counters_while_the_trainer_has_not_started(
    memory_name_resolve, trial, dirs, tmp_path
):
    # A resumed run: the saved counters must survive until the trainer says where it
    # starts, even when that takes several save intervals (the worker used to save the
    # fresh zeros every interval and so destroy what it was about to restore).
    from realhf.api.core.system_api import WorkerInformation
    from realhf.base import constants, name_resolve, names
    from realhf.system.rollout.manager.worker import GserverManagerWorker

    constants.set_fileroot(str(tmp_path / "root"))
    srv = engine_server(dirs["v0"])
    name_resolve.add_subentry(names.gen_servers("exp", trial), srv.url)
    state_path = tmp_path / "state.json"
    saved = '{"saved": "by the run being resumed"}'
    state_path.write_text(saved)
    cfg = GserverManagerConfig(
        n_servers=1,
        train_batch_size=2,
        host="127.0.0.1",
        server_wait_timeout_s=30,
        state_path=str(state_path),
        state_save_interval_s=0.01,
    )
    w = GserverManagerWorker("exp", trial, "gserver_manager", 0)
    try:
        w.handle_control(
            "configure",
            worker_info=WorkerInformation("exp", trial, "gserver_manager", 0, 1),
            config=cfg,
        )
        w.handle_control("start")
        for _ in range(5):
            time.sleep(0.02)
            w.step()
        assert not w.manager.trainer_ready
    finally:
        w._exit_hook()
        constants.set_fileroot(None)
        srv.stop()
        srv.engine.close()
    assert state_path.read_text() == saved
