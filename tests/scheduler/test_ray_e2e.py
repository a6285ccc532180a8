"""Quickstart experiments through ``mode=ray`` on a real two-raylet Ray cluster (one
machine): sync and async PPO finish with workers on both nodes, names resolved through
Ray's own key-value store; a worker's actor killed with ``ray.kill`` mid-run is recovered
from the last checkpoint and every step is trained once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import quickstart_runs as qs
import ray_cluster

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(not ray_cluster.ray_importable(), reason="ray is not installed"),
]

PPO = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "dataset.eval_max_new_tokens=4",
    "worker_timeout=120",
    "mode=ray",  # names go to the cluster's own key-value store by default
]


@pytest.fixture(scope="module")
def cluster():
    c = ray_cluster.start_ray_cluster(n_nodes=2, cpus_per_node=2)
    with c.client_env():  # the launcher subprocesses inherit the token
        yield c
    c.stop()


def _start(cluster, tmp_path, exp, *args):
    return qs.start(exp, [*PPO, *args, f"ray.address={cluster.address}"], tmp_path)


def _node_tags(run_dir):
    """worker -> the test node (node1/node2) it ran on."""
    placement = json.loads((run_dir / "placement.json").read_text())
    tag = {
        n: next(r for r in info["resources"] if r in ("node1", "node2"))
        for n, info in placement["nodes"].items()
    }
    return {w: tag[v["node_id"]] for w, v in placement["workers"].items()}


def test_async_ppo_math_on_two_nodes(cluster, tmp_path, no_leftover_processes):
    proc = _start(
        cluster,
        tmp_path,
        "async-ppo-math",
        "allocation_mode=gen.d1p1m1+d1p1m1",
        "ray.cpus_per_worker=0.5",  # 6 processes in 3 CPUs: more than one node holds
        "max_head_offpolicyness=1",
        "exp_ctrl.benchmark_steps=3",
        "exp_ctrl.eval_freq_steps=3",
    )
    out = qs.finish(proc)
    run = tmp_path / "async-ppo-math" / "t"
    assert qs.steps(run) == [0, 1, 2, 3]
    assert "async-ppo-math: step 3/3 |" in out and "staleness        mean" in out
    assert set(_node_tags(run).values()) == {"node1", "node2"}


def test_ppo_math_on_two_nodes_recovers_a_killed_worker_and_trains_every_step_once(
    cluster, tmp_path, no_leftover_processes
):
    # Custom node resources place the model workers on node2 and the master on node1;
    # the placement holds again for the second attempt.
    proc = _start(
        cluster,
        tmp_path,
        "ppo-math",
        "allocation_mode=d2p1m1",
        "ray.cpus_per_worker=0.5",
        "ray.worker_resources.model_worker=node2:0.5",
        "ray.worker_resources.master_worker=node1:0.5",
        "recover_mode=auto",
        "exp_ctrl.ckpt_freq_steps=1",
        "exp_ctrl.benchmark_steps=6",
        "exp_ctrl.eval_freq_steps=6",
    )
    run = tmp_path / "ppo-math" / "t"
    with qs.killed_on_error(proc):
        qs.wait_for_steps(proc, run, 3)  # the evaluation at step 0, then steps 1 and 2
        kill = (
            "import ray; ray.init(address=%r, log_to_driver=False); "
            "ray.kill(ray.get_actor('ppo-math/t/model_worker/0', namespace='realhf'))"
            % cluster.address
        )
        subprocess.run([sys.executable, "-c", kill], check=True, timeout=120, capture_output=True)
    out = qs.finish(proc)
    assert "attempt 2/2" in out and "recovering from the last checkpoint" in out
    assert qs.steps(run) == [0, 1, 2, 3, 4, 5, 6]  # step 0: the evaluation before training
    # The launcher's console follows the run whatever the launcher.
    assert "ppo-math: step 6/6 |" in out and "ppo-math: run summary" in out
    tags = _node_tags(run)
    assert tags["model_worker/0"] == tags["model_worker/1"] == "node2"
    assert tags["master_worker/0"] == "node1"
