"""Quickstart experiments through ``mode=slurm`` on a real two-node SLURM cluster (one
machine): sync and async PPO finish with workers on both nodes; a worker job cancelled
mid-run is recovered from the last checkpoint and every step is trained once.
"""

from __future__ import annotations

import json

import pytest
import quickstart_runs as qs

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

PPO = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "dataset.eval_max_new_tokens=4",
    "worker_timeout=120",
    "mode=slurm",
]


def _start(cluster, tmp_path, exp, *args):
    return qs.start(exp, [*PPO, *args], tmp_path, env=cluster.env)


def _nodes(run_dir, prefix):
    with open(run_dir / "placement.json") as f:
        workers = json.load(f)["workers"]
    return {w: v["node"] for w, v in workers.items() if w.startswith(prefix)}


def test_async_ppo_math_over_slurm(slurm_cluster, tmp_path, no_leftover_processes):
    proc = _start(
        slurm_cluster,
        tmp_path,
        "async-ppo-math",
        "allocation_mode=gen.d1p1m1+d1p1m1",
        "slurm.worker_cpus.generation_server=3",
        "max_head_offpolicyness=1",
        "exp_ctrl.benchmark_steps=3",
        "exp_ctrl.eval_freq_steps=3",
    )
    out = qs.finish(proc)
    run = tmp_path / "async-ppo-math" / "t"
    assert qs.steps(run) == [0, 1, 2, 3]
    assert "async-ppo-math: step 3/3 |" in out and "staleness        mean" in out
    nodes = _nodes(run, "")
    assert set(nodes.values()) == {"node1", "node2"}, nodes
    assert slurm_cluster.queue() == []


def test_ppo_math_spreads_over_both_nodes_and_recovers_a_cancelled_worker_job(
    slurm_cluster, tmp_path, no_leftover_processes
):
    # 3 CPUs per model worker on 4-CPU nodes: the two replicas cannot share a node.
    proc = _start(
        slurm_cluster,
        tmp_path,
        "ppo-math",
        "allocation_mode=d2p1m1",
        "slurm.worker_cpus.model_worker=3",
        "recover_mode=auto",
        "exp_ctrl.ckpt_freq_steps=1",
        "exp_ctrl.benchmark_steps=6",
        "exp_ctrl.eval_freq_steps=6",
    )
    run = tmp_path / "ppo-math" / "t"
    with qs.killed_on_error(proc):
        qs.wait_for_steps(proc, run, 3)  # the evaluation at step 0, then steps 1 and 2
        assert sorted(_nodes(run, "model_worker").values()) == ["node1", "node2"]
        with open(run / "placement.json") as f:
            job = json.load(f)["jobs"]["model_worker"]["job_id"]
        slurm_cluster.run("scancel", job)
    out = qs.finish(proc)
    assert "attempt 2/2" in out and "recovering from the last checkpoint" in out
    assert qs.steps(run) == [0, 1, 2, 3, 4, 5, 6]  # step 0: the evaluation before training
    # The launcher's console follows the run whatever the launcher.
    assert "ppo-math: step 6/6 |" in out and "ppo-math: run summary" in out
    assert sorted(_nodes(run, "model_worker").values()) == ["node1", "node2"]
    assert slurm_cluster.queue() == []
