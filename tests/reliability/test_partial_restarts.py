"""Partial restarts: a lost generation server or rollout worker is replaced alone.

One ``async-ppo-math`` run (local launcher, one generation server, one rollout worker):

* SIGKILL the generation server at step 3 — the launcher starts it again, the controller
  configures it, the manager brings it to the trainer's version, and the rollouts that
  waited for a server continue;
* SIGSTOP the rollout worker at step 6 (a hang: alive, silent) — its status expires (LOST),
  the controller asks the launcher to kill it, the new process continues the data position
  and the manager reissues any index the old one took and never delivered.

The trainer (master and model worker) runs through both with the same processes — no
relaunch — and every step trains exactly its indices, each within the staleness bound, no
prompt twice.
"""

from __future__ import annotations

import json
import signal

import psutil
import pytest
import quickstart_runs as qs

pytestmark = pytest.mark.slow

B, ETA, STEPS = 4, 1, 10
ARGS = [
    f"train_batch_size={B}",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=6",
    "new_tokens_per_chunk=2",
    f"max_head_offpolicyness={ETA}",
    f"exp_ctrl.benchmark_steps={STEPS}",
    "eval=false",
    "worker_timeout=120",
]


def test_lost_server_and_hung_rollout_worker_are_replaced_while_the_trainer_runs(tmp_path):
    proc = qs.start("async-ppo-math", ARGS, tmp_path)
    run = tmp_path / "async-ppo-math" / "t"
    with qs.killed_on_error(proc):
        qs.wait_for_steps(proc, run, 3)
        trainer_types = ("master_worker", "model_worker")
        trainer = {p.pid for t in trainer_types for p in qs.worker_processes(proc, t)}
        (server,) = qs.worker_processes(proc, "generation_server")
        # every worker was forked from the fork server the launcher forked from itself
        # (realhf.scheduler.forkserver.start_early), not from a server of its own
        workers = [p for t in trainer_types for p in qs.worker_processes(proc, t)]
        (fork_server,) = {p.ppid() for p in workers + [server]}
        assert psutil.Process(fork_server).ppid() == proc.pid
        assert "(forked by the launcher)" in " ".join(psutil.Process(fork_server).cmdline())
        server.send_signal(signal.SIGKILL)
        qs.wait_for_steps(proc, run, 6)
        (rollout,) = qs.worker_processes(proc, "rollout_worker")
        rollout.send_signal(signal.SIGSTOP)
        qs.wait_for_steps(proc, run, STEPS - 1)
        still = {
            p.pid for t in ("master_worker", "model_worker") for p in qs.worker_processes(proc, t)
        }
        assert still == trainer, "the trainer was restarted"
        out = qs.finish(proc)
    assert "recovering from the last checkpoint" not in out and "attempt 2" not in out
    qs.check_trained(run, STEPS, B, ETA)
    metrics = qs.last_per_step(qs.rows(run / "metrics.jsonl"))
    assert all(m["rollout/staleness_max"] <= ETA for m in metrics)
    controller = (run / "logs" / "controller_0.log").read_text()
    assert "generation_server/0 restarted" in controller
    assert "rollout_worker/0 restarted" in controller
    assert "rollout_worker/0: LOST" in controller  # the hang was detected as such
    manager = (run / "logs" / "gserver_manager_0.log").read_text()
    assert manager.count("joined at version") >= 2  # the replacement server joined
    rollout_log = (run / "logs" / "rollout_worker_0.log").read_text()
    assert "restarted: continuing epoch" in rollout_log
    # The launcher's summary lists both restarts, so they stand out at the end of the run.
    incidents = json.loads((run / "summary.json").read_text())["incidents"]
    for w in ("generation_server/0", "rollout_worker/0"):
        assert any(w in i and "restarting it (1/" in i for i in incidents), incidents
    assert "warnings/errors while it ran:" in out
