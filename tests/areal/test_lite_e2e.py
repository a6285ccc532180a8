"""examples/lite/grpo_tiny.py under torchrun: one process single-turn, two processes
multi-turn; every step trains within the staleness bound and the weights reach the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, nproc, *args):
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "examples/lite/grpo_tiny.py",
            f"out_dir={out}",
            "rollout.train_batch_size=4",
            "group_size=4",
            "steps=3",
            "eval_every=3",
            "n_eval=20",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return out, rows, r.stdout + r.stderr


@pytest.mark.parametrize("nproc,turns,sync", [(1, 1, "disk"), (2, 3, "shm"), (2, 1, "broadcast")])
def test_lite_grpo_trains_within_the_bound_and_publishes_weights(tmp_path, nproc, turns, sync):
    shm_before = set(os.listdir("/dev/shm"))
    out, rows, log = _run(tmp_path, nproc, f"max_turns={turns}", f"rollout.weight_sync={sync}")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/greedy_acc" in rows[0] and "eval/greedy_acc" in rows[-1]
    assert all(r["staleness_max"] <= 1 for r in rows[1:])
    assert all(r["loss"] is not None for r in rows[1:])
    assert "weights of version 3 on 1 servers" in log and f"(weight_sync={sync})" in log
    if sync == "disk":
        assert (out / "weights" / "v3" / "config.json").exists()
    elif sync == "broadcast":  # pulled from rank 0's copy: nothing written
        assert not (out / "weights").exists()
    else:  # flat files in /dev/shm, removed at the end
        assert not (out / "weights").exists()
        assert not [d for d in set(os.listdir("/dev/shm")) - shm_before if "realhf-lite" in d]


@pytest.mark.parametrize("nproc,sync", [(1, "disk"), (2, "broadcast")])
def test_lite_grpo_with_lora_sends_the_server_its_adapters(tmp_path, nproc, sync):
    """actor.lora: the server starts from the fresh adapters' directory on the base, and
    each upload is the adapters alone (a PEFT directory, or a pull of the adapter buffer)."""
    out, rows, log = _run(
        tmp_path,
        nproc,
        "actor.lora.rank=8",
        "actor.optimizer.lr=2e-3",
        f"rollout.weight_sync={sync}",
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["staleness_max"] <= 1 for r in rows[1:])
    assert "weights of version 3 on 1 servers" in log and f"(weight_sync={sync})" in log
    assert (out / "adapters-v0" / "adapter_config.json").exists()
    if sync == "disk":
        v3 = sorted(os.listdir(out / "weights" / "v3"))
        assert "adapter_model.safetensors" in v3 and "model.safetensors" not in v3
        assert os.path.getsize(out / "weights" / "v3" / "adapter_model.safetensors") < 1 << 20
