"""async-ppo-math on vLLM generation servers (``allocation_mode=vllm.d1p1m1+d1p1m1``).

One run through real processes with vLLM's CPU build (the venv of the ``vllm_python``
fixture): the trainer's versions reach vLLM by ``weight_sync=broadcast`` (vLLM's worker
pulls each from the trainer's weight sender over a gloo pair; the disk reload and shm are
tested in test_vllm_backend), rollouts are interrupted and resubmitted as with our servers,
the staleness bound holds, and the greedy accuracy rises (32.4% -> 42.0% in 30 steps, 87 s,
on 2026-11-29; 45.2% with shm).  At step 4 the vLLM process is SIGKILLed: the generation
server worker reports it, the launcher restarts the worker (a new vLLM, ~30 s), the manager
brings it to the trainer's version (a new pair; the dead one's is dropped), and the run ends
with every step trained exactly once.
"""

from __future__ import annotations

import pytest
import quickstart_runs as qs

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

B, ETA, STEPS = 32, 1, 30
ARGS = [
    "allocation_mode=vllm.d1p1m1+d1p1m1",
    f"train_batch_size={B}",
    f"max_head_offpolicyness={ETA}",
    f"exp_ctrl.benchmark_steps={STEPS}",
    f"exp_ctrl.eval_freq_steps={STEPS}",
    "worker_timeout=240",
    # no vLLM worker process (the default's three processes are test_vllm_backend's)
    "gen_server.vllm_single_process=true",
    # new weights pulled by vLLM's worker over a gloo pair from the trainer's weight sender
    # (the disk reload and shm are test_vllm_backend's)
    "weight_sync=broadcast",
]


def _vllm_of(server):
    for p in server.children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in p.cmdline():
                return p
        except Exception:  # noqa: BLE001 — gone since listed
            continue
    raise AssertionError(f"no vLLM process under generation server pid {server.pid}")


@pytest.mark.timeout(900)
def test_async_ppo_math_on_vllm_learns_within_the_bound_and_survives_a_killed_server(
    tmp_path, vllm_python
):
    proc = qs.start("async-ppo-math", ARGS + [f"gen_server.vllm_python={vllm_python}"], tmp_path)
    run = tmp_path / "async-ppo-math" / "t"
    with qs.killed_on_error(proc):
        qs.wait_for_steps(proc, run, 5, timeout=300)  # the eval at step 0, then 4 steps
        (server,) = qs.worker_processes(proc, "generation_server")
        vllm = _vllm_of(server)
        names = [p.name() for p in vllm.children(recursive=True)]
        assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names
        vllm.kill()
        out = qs.finish(proc, timeout=700)
    qs.check_trained(run, STEPS, B, ETA)
    rows = qs.rows(run / "metrics.jsonl")
    metrics = qs.last_per_step(rows)
    assert all(m["rollout/staleness_max"] <= ETA for m in metrics if "rollout/staleness_max" in m)
    acc = [r["eval/greedy_acc"] for r in rows if "eval/greedy_acc" in r]
    assert len(acc) == 2 and acc[1] >= acc[0] + 0.03, acc
    server_log = (run / "logs" / "generation_server_0.log").read_text()
    assert "the vLLM process exited" in server_log
    controller = (run / "logs" / "controller_0.log").read_text()
    assert "generation_server/0 restarted" in controller
    manager = (run / "logs" / "gserver_manager_0.log").read_text()
    assert manager.count("joined at version") >= 2  # the new vLLM joined at the trainer's
    assert "restarting it (1/" in out
