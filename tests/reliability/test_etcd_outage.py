"""A run over the etcd backend survives etcd being down for 10 s mid-run (killed and
restarted): no worker exits, no relaunch, every step trained once."""

import threading
import time

import pytest
import quickstart_runs as qs

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def test_ppo_math_rides_out_a_10s_etcd_outage(no_leftover_processes, restartable_etcd, tmp_path):
    steps = 12
    args = [
        f"name_resolve=etcd3://{restartable_etcd.address}",
        "recover_mode=auto",  # a relaunch would show as "attempt 2/2"
        "train_batch_size=4",
        "ppo.group_size=2",
        "ppo.gen.max_new_tokens=4",
        f"exp_ctrl.benchmark_steps={steps}",
        "eval=false",
    ]
    run = qs.start("ppo-math", args, tmp_path)
    run_dir = tmp_path / "ppo-math" / "t"
    with qs.killed_on_error(run):
        qs.wait_for_steps(run, run_dir, 2, timeout=120)
        restartable_etcd.stop()
        down_at = time.monotonic()
        restarter = threading.Thread(
            target=lambda: (time.sleep(10), restartable_etcd.start()), daemon=True
        )
        restarter.start()
        out = qs.finish(run, timeout=300)
        restarter.join()
    assert "attempt 2/2" not in out, out[-6000:]
    assert qs.steps(run_dir) == list(range(1, steps + 1))
    assert time.monotonic() - down_at > 10  # the run outlived the outage
