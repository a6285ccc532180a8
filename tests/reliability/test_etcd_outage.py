"""A run over the etcd backend survives etcd being down for 10 s mid-run (killed and
restarted): no worker exits, no relaunch, every step trained once."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ppo_math_rides_out_a_10s_etcd_outage(no_leftover_processes, restartable_etcd, tmp_path):
    steps = 12
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "realhf.apps.quickstart",
            "ppo-math",
            f"name_resolve=etcd3://{restartable_etcd.address}",
            "recover_mode=auto",  # a relaunch would show as "attempt 2/2"
            "train_batch_size=4",
            "ppo.group_size=2",
            "ppo.gen.max_new_tokens=4",
            f"exp_ctrl.benchmark_steps={steps}",
            "eval=false",
            f"fileroot={tmp_path}",
            "trial_name=t",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    metrics = tmp_path / "ppo-math" / "t" / "metrics.jsonl"
    out = ""
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert run.poll() is None, run.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no second step within 120 s"
            time.sleep(0.2)
        restartable_etcd.stop()
        down_at = time.monotonic()
        restarter = threading.Thread(
            target=lambda: (time.sleep(10), restartable_etcd.start()), daemon=True
        )
        restarter.start()
        out, _ = run.communicate(timeout=300)
        restarter.join()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out[-4000:]
    assert "attempt 2/2" not in out, out[-6000:]
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert time.monotonic() - down_at > 10  # the run outlived the outage
