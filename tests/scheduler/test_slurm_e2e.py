"""Quickstart experiments through ``mode=slurm`` on a real two-node SLURM cluster (one
machine): sync and async PPO finish with workers on both nodes; a worker job cancelled
mid-run is recovered from the last checkpoint and every step is trained once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "dataset.eval_max_new_tokens=4",
    "worker_timeout=120",
    "mode=slurm",
]


def _start(cluster, tmp_path, exp, *args):
    env = dict(os.environ, **cluster.env)
    cmd = [sys.executable, "-m", "realhf.apps.quickstart", exp, *PPO, *args]
    cmd += [f"fileroot={tmp_path}", "trial_name=t"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )


def _finish(proc, timeout=400):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _steps(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["step"] for line in f]


def _nodes(run_dir, prefix):
    with open(run_dir / "placement.json") as f:
        workers = json.load(f)["workers"]
    return {w: v["node"] for w, v in workers.items() if w.startswith(prefix)}


def test_ppo_math_spreads_over_both_nodes(slurm_cluster, tmp_path, no_leftover_processes):
    # 3 CPUs per model worker on 4-CPU nodes: the two replicas cannot share a node.
    proc = _start(
        slurm_cluster,
        tmp_path,
        "ppo-math",
        "allocation_mode=d2p1m1",
        "slurm.worker_cpus.model_worker=3",
        "exp_ctrl.benchmark_steps=2",
        "exp_ctrl.eval_freq_steps=2",
    )
    _finish(proc)
    run = tmp_path / "ppo-math" / "t"
    assert _steps(run) == [1, 2]
    assert sorted(_nodes(run, "model_worker").values()) == ["node1", "node2"]
    assert slurm_cluster.queue() == []


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
    _finish(proc)
    run = tmp_path / "async-ppo-math" / "t"
    assert _steps(run) == [1, 2, 3]
    nodes = _nodes(run, "")
    assert set(nodes.values()) == {"node1", "node2"}, nodes
    assert slurm_cluster.queue() == []


def test_cancelled_worker_job_is_recovered_and_every_step_trained_once(
    slurm_cluster, tmp_path, no_leftover_processes
):
    proc = _start(
        slurm_cluster,
        tmp_path,
        "ppo-math",
        "recover_mode=auto",
        "exp_ctrl.ckpt_freq_steps=1",
        "exp_ctrl.benchmark_steps=6",
        "eval=false",
    )
    run = tmp_path / "ppo-math" / "t"
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").exists() and len(_steps(run)) >= 2):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no second step within 180 s"
            time.sleep(0.5)
        with open(run / "placement.json") as f:
            job = json.load(f)["jobs"]["model_worker"]["job_id"]
        slurm_cluster.run("scancel", job)
        out = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "attempt 2/2" in out and "recovering from the last checkpoint" in out
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    assert slurm_cluster.queue() == []
