"""Rollout worker end to end: a real generation server, a real manager, the worker, and a test
trainer that pulls trajectories, trains them in index order and bumps the weight version."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import requests
from tiny_models import make_tiny_hf_model

from realhf.api.core.registry import AgentAbstraction, DatasetAbstraction, EnvAbstraction
from realhf.api.core.rollout_api import TRAJECTORY_KEYS, Trajectory
from realhf.api.core.rollout_config import GserverManagerConfig, RolloutWorkerConfig
from realhf.api.core.system_api import WorkerInformation
from realhf.base import name_resolve, names
from realhf.base.net import auth
from realhf.base.net.http_server import ServerThread, auth_headers
from realhf.impl.model.conversion.hf import save_tokenizer
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.worker import GserverManager
from realhf.system.rollout.rollout_worker import RolloutWorker
from realhf.system.rollout.staleness import IndexOrderBatcher
from realhf.system.transport.errors import StreamTimeout
from realhf.system.transport.push_pull import PullerStream
from realhf.system.worker.base import WorkerStatus

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")
TINY = os.path.abspath(os.path.join(ROOT, "realhf", "assets", "tiny"))
DATA = os.path.join(TINY, "data", "train.jsonl")


class Progress:
    def __init__(self):
        self.v, self.trained = 0, 0

    def version(self):
        return self.v

    def trained_samples(self):
        return self.trained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rollout") / "m")
    make_tiny_hf_model(
        "qwen2",
        path,
        seed=0,
        perturb=0.3,
        vocab_size=268,
        eos_token_id=0,
        pad_token_id=1,
        max_position_embeddings=512,
    )
    save_tokenizer(TINY, path)  # tokenizer files only: the assets also hold a config.json
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    engine = load_engine(
        model_dir, EngineConfig(max_running_requests=16, context_length=512, num_threads=1)
    ).start()
    # weight updates reload model_dir itself (the manager's weight_dir below)
    srv = ServerThread(create_app(engine, weights_root=os.path.dirname(model_dir))).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.close()


def _manager(server, model_dir, trial, *, B, eta, concurrency, lease_ttl_s=30.0):
    # The server is shared by the module: an earlier test's manager may have stopped in the
    # middle of a weight update, leaving it paused (every generation would then wait).
    requests.post(
        f"{server.url}/continue_generation", headers=auth_headers(), timeout=10
    ).raise_for_status()
    progress = Progress()
    cfg = GserverManagerConfig(
        n_servers=1,
        train_batch_size=B,
        max_head_offpolicyness=eta,
        max_concurrent_rollouts=concurrency,
        weight_poll_interval_s=0.05,
        health_check_interval_s=0.5,
        server_wait_timeout_s=30,
        lease_ttl_s=lease_ttl_s,
        keep_weight_versions=None,
    )
    manager = GserverManager(cfg, progress, lambda: [server.url], lambda v: model_dir)
    service = ManagerService(manager).start(60)
    name_resolve.add(names.gen_server_manager("exp", trial), service.address, replace=True)
    start = {"trained_samples": 0, "version": 0, "checkpoint": None}
    name_resolve.add(names.trainer_start("exp", trial), json.dumps(start), replace=True)
    return progress, manager, service


def _config(agent_args=None, **kw):
    defaults = dict(
        new_tokens_per_chunk=8,
        heartbeat_interval_s=0.5,
        allocate_retry_interval_s=0.02,
        finish_wait_s=1.0,
    )
    return RolloutWorkerConfig(
        agent=AgentAbstraction(
            "math-single-step",
            {"gconfig": {"max_new_tokens": 24}, "group_size": 2, **(agent_args or {})},
        ),
        env=EnvAbstraction("math-code-single-step"),
        dataset=DatasetAbstraction("math_prompt", {"dataset_path": DATA, "max_items": 5}),
        tokenizer_path=TINY,
        **{**defaults, **kw},
    )


def _run_in_thread(worker):
    """Drive the AsyncWorker's poll loop in a thread until it completes or fails."""

    def main():
        async def drive():
            while worker.status == WorkerStatus.RUNNING:
                await worker.step_async()
                await asyncio.sleep(0)

        asyncio.run(drive())

    t = threading.Thread(target=main, daemon=True)
    t.start()
    return t


def _worker(trial, config):
    w = RolloutWorker("exp", trial, "rollout_worker", 0)
    w.handle_control(
        "configure",
        worker_info=WorkerInformation("exp", trial, "rollout_worker", 0, 1),
        config=config,
    )
    w.handle_control("start")
    return w


def test_trajectories_reach_the_trainer_in_index_order_within_the_staleness_bound(
    memory_name_resolve, trial, server, model_dir
):
    B, eta, n = 2, 1, 10
    progress, manager, service = _manager(server, model_dir, trial, B=B, eta=eta, concurrency=4)
    puller = PullerStream("exp", trial, "rollout", 0, message_types=[Trajectory])
    batcher: IndexOrderBatcher = IndexOrderBatcher(B)
    trained = []
    state_key = names.rollout_worker_state("exp", trial, "rollout_worker/0")
    checked = 0
    try:
        worker = _worker(trial, _config(max_rollouts=n, max_concurrent_rollouts=4))
        thread = _run_in_thread(worker)
        deadline = time.monotonic() + 120
        while len(trained) < n and time.monotonic() < deadline:
            try:
                msg = puller.pull(timeout=0.5)
            except StreamTimeout:
                assert worker.status != WorkerStatus.ERROR, worker.status
                continue
            if not isinstance(msg, Trajectory):
                continue  # EndOfStream
            # A restarted worker must not run this prompt again: the position saying it
            # ended is written before the trajectory is pushed.
            pos = json.loads(name_resolve.get(state_key))
            if pos["epoch"] == msg.data_epoch:
                assert msg.qid in pos["used_ids"], (msg.qid, pos)
                checked += 1
            batcher.add(msg.index, msg)
            while (batch := batcher.pop_batch()) is not None:
                step = progress.v  # this step trains at the current version...
                trained += [(step, t) for t in batch]
                progress.trained += len(batch)
                progress.v += 1  # ...and publishes the next one
        thread.join(30)
        assert worker.status == WorkerStatus.COMPLETED, worker.status
    finally:
        puller.close()
        service.stop()
    assert len(trained) == n and sorted(t.index for _, t in trained) == list(range(n))
    assert checked >= 5  # the first epoch's 5 prompts at least
    for step, t in trained:
        s = t.sample
        assert s.keys == set(TRAJECTORY_KEYS) and s.seqlens["rewards"] == [[1, 1]]
        assert set(s.data["rewards"].tolist()) <= {5.0, -5.0}
        assert step - t.version_start <= eta
        assert t.version_start <= t.version_end
        assert s.metadata["query_id"] == [s.ids[0]] and t.worker == "rollout_worker/0"
    assert max(t.version_end for _, t in trained) >= 1  # weights changed while it ran
    assert worker.counts == {"started": n, "pushed": n, "filtered": 0, "dropped": 0}
    st = manager.status()
    assert st["running"] == 0 and st["accepted_total"] == n


def test_filtered_groups_release_their_slots(memory_name_resolve, trial, server, model_dir):
    progress, manager, service = _manager(server, model_dir, trial, B=2, eta=0, concurrency=2)
    puller = PullerStream("exp", trial, "rollout", 0, message_types=[Trajectory])
    try:
        # a random model never answers correctly: lb=1 drops every group
        worker = _worker(
            trial,
            _config(max_rollouts=5, max_concurrent_rollouts=2, agent_args={"success_rate_lb": 1.0}),
        )
        thread = _run_in_thread(worker)
        thread.join(120)
        assert worker.status == WorkerStatus.COMPLETED
        # with eta=0 and B=2 only 2 slots exist at version 0: 5 rollouts ran only because
        # every filtered rollout gave its slot back
        st = manager.status()
        assert st["running"] == 0 and st["accepted_total"] == 0 and st["stats"]["filtered"] == 5
        assert worker.counts["filtered"] == 5 and worker.counts["pushed"] == 0
    finally:
        puller.close()
        service.stop()


def test_the_worker_stops_when_the_experiment_ends(memory_name_resolve, trial, server, model_dir):
    progress, manager, service = _manager(server, model_dir, trial, B=4, eta=0, concurrency=4)
    puller = PullerStream("exp", trial, "rollout", 0, message_types=[Trajectory])
    try:
        worker = _worker(trial, _config(max_concurrent_rollouts=4))
        name_resolve.add(names.experiment_status("exp", trial), "RUNNING")
        thread = _run_in_thread(worker)
        deadline = time.monotonic() + 60
        while manager.status()["stats"].get("admitted", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        name_resolve.add(names.experiment_status("exp", trial), "COMPLETE", replace=True)
        thread.join(30)
        assert worker.status == WorkerStatus.COMPLETED
        time.sleep(0.2)
        assert (
            service.call(lambda: manager.staleness.running) == 0
        )  # cancelled rollouts were released
    finally:
        puller.close()
        service.stop()


_CHILD = textwrap.dedent("""
    import asyncio, pickle, sys
    from realhf.base import name_resolve
    name_resolve.reconfigure("file", root=sys.argv[1])
    from realhf.api.core.system_api import WorkerInformation
    from realhf.system.rollout.rollout_worker import RolloutWorker
    from realhf.system.worker.base import ControlCommand
    trial, config = sys.argv[2], pickle.load(open(sys.argv[3], "rb"))
    w = RolloutWorker("exp", trial, "rollout_worker", 0)
    info = WorkerInformation("exp", trial, "rollout_worker", 0, 1)
    w.handle_control(ControlCommand.CONFIGURE, worker_info=info, config=config)
    w.handle_control(ControlCommand.START)

    async def main():
        while True:
            await w.step_async()
            await asyncio.sleep(0)

    asyncio.run(main())
""")


@pytest.mark.slow
def test_killing_a_rollout_worker_releases_its_rollouts(tmp_path, trial, server, model_dir):
    import pickle

    nr_root = str(tmp_path / "nr")
    name_resolve.reconfigure("file", root=nr_root)
    try:
        progress, manager, service = _manager(
            server, model_dir, trial, B=8, eta=0, concurrency=8, lease_ttl_s=2.0
        )
        puller = PullerStream("exp", trial, "rollout", 0, message_types=[Trajectory])
        cfg_path = str(tmp_path / "cfg.pkl")
        with open(
            cfg_path, "wb"
        ) as f:  # long answers in small chunks: rollouts are running when killed
            pickle.dump(
                _config(
                    max_concurrent_rollouts=4,
                    new_tokens_per_chunk=2,
                    agent_args={"gconfig": {"max_new_tokens": 300, "greedy": True}},
                ),
                f,
            )
        auth.run_secret()  # the child inherits this process's secret: it is of this run
        child = subprocess.Popen([sys.executable, "-c", _CHILD, nr_root, trial, cfg_path])
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                st = requests.get(
                    service.url + "/status", headers=auth_headers(), timeout=10
                ).json()
                if st["running"] >= 3:
                    break
                assert child.poll() is None, "the rollout worker process exited early"
                time.sleep(0.1)
            assert st["running"] >= 3 and "rollout_worker/0" in st["owners"]
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < 10:
                st = requests.get(
                    service.url + "/status", headers=auth_headers(), timeout=10
                ).json()
                if st["running"] == 0:
                    break
                time.sleep(0.1)
            assert st["running"] == 0 and st["stats"]["expired"] >= 3 and st["owners"] == {}
            assert (
                time.monotonic() - killed_at >= 1.0
            )  # released by the lease, not by anything else
            assert st["capacity"] == 8 - st["accepted_total"]
        finally:
            child.kill()
            puller.close()
            service.stop()
    finally:
        name_resolve.reconfigure("memory")
