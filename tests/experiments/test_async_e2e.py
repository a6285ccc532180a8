"""async-ppo-math end to end through real processes: servers, manager, rollout worker, trainer.

* a short run trains every step on exactly the trajectories the index contract names, within
  the staleness bound, with chunked rollouts, and publishes every version;
* a SIGKILLed trainer mid-run is recovered by ``recover_mode=auto``: the resumed run continues
  at the checkpoint's trajectory index, trains no trajectory twice, keeps the bound, and the
  resumed rollout worker skips the prompts the checkpoint says were trained.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest
import quickstart_runs
from run_attacker import RunProbe

from realhf.base import constants

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, ETA = 4, 1
SMALL = [
    f"train_batch_size={B}",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=6",
    "new_tokens_per_chunk=2",
    f"max_head_offpolicyness={ETA}",
    "dataset.eval_max_new_tokens=4",
    "worker_timeout=120",
]


def _cmd(tmp_path, *args):
    return ["async-ppo-math", f"fileroot={tmp_path}", *SMALL, *args]


def _run_to_the_end(tmp_path, *args):
    """A run of ``args`` that must succeed; its run directory."""
    r = quickstart_runs.run(_cmd(tmp_path, *args), 400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp_path / "async-ppo-math" / "run0"


def _check_trained(run, n_steps):
    return quickstart_runs.check_trained(run, n_steps, B, ETA)


def test_async_ppo_math_trains_within_the_staleness_bound(tmp_path):
    """Also the run's security, as a same-host attacker without its secret sees it, and
    weights through shared memory (one run serves all three: another would add minutes):
    every socket of every process listens on loopback, and forged ZMQ messages and
    unauthenticated control calls sent while it trains change nothing."""
    evil = tmp_path / "pwned"
    shm = constants.weight_shm_root("async-ppo-math", "run0", fileroot=str(tmp_path))
    proc = quickstart_runs.popen(
        _cmd(
            tmp_path, "exp_ctrl.benchmark_steps=4", "exp_ctrl.eval_freq_steps=4", "weight_sync=shm"
        )
    )
    spec = f"file://{tmp_path / 'name_resolve'}"
    probe = RunProbe(proc, spec, "async-ppo-math", "run0", str(evil)).start()
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
        probe.join()
    assert proc.returncode == 0, out[-6000:]
    run = tmp_path / "async-ppo-math" / "run0"
    _check_attacks_changed_nothing(run, probe, evil)
    start, *rows = quickstart_runs.rows(run / "metrics.jsonl")
    # Step 0: the evaluation before training (exp_ctrl.eval_at_start, on by default here).
    assert start["step"] == 0 and "eval/greedy_acc" in start
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert all(x["rollout/staleness_max"] <= ETA for x in rows)
    assert "eval/greedy_acc" in rows[-1] and "actor_train/ppo_actor/behave_imp_weight" in rows[0]
    assert (
        "timing/actor_inf" not in rows[0]
    )  # one optimizer step: proximal log-probs from the train pass
    batches = _check_trained(run, 4)
    # (whether a rollout spans a weight update here depends on timing; interrupted rollouts
    # are checked deterministically in tests/system/rollout/test_partial_rollout.py)
    assert all(
        ve >= vs
        for b in batches
        for s, e in zip(b["version_start"], b["version_end"])
        for vs, ve in zip(s, e)
    )
    # The manager pushes the newest version it sees (two quick versions coalesce into one
    # push), in increasing order. With eta=1 the step-4 batch was generated at version >= 2,
    # so a mid-run push of version 2 or 3 must have happened.  weight_sync=shm: no version
    # went through the disk, and none is left in /dev/shm.
    log = (run / "logs" / "gserver_manager_0.log").read_text()
    pushed = re.findall(r"weights of version (\d+) on 1 servers in \S+ \(weight_sync=(\w+)\)", log)
    assert {mode for _, mode in pushed} == {"shm"}, pushed
    pushed = [int(v) for v, _ in pushed]
    assert pushed == sorted(set(pushed)) and {2, 3} & set(pushed), pushed
    assert not (tmp_path / ".cache" / "async-ppo-math" / "run0" / "weights").exists()
    assert not os.path.exists(os.path.dirname(os.path.dirname(shm))), "left in /dev/shm"


def test_a_lora_run_sends_the_servers_its_adapters_only(tmp_path):
    """actor.lora: the trainer publishes the adapters alone (a fraction of the model's
    bytes), the server applies them, and the run trains within the bound."""
    run = _run_to_the_end(
        tmp_path,
        "actor.lora.rank=8",
        "ppo.kl_ctl=0.05",  # the reference: the actor's base, adapters off
        "exp_ctrl.benchmark_steps=3",
        "eval=false",
        "weight_sync=broadcast",
    )
    rows = quickstart_runs.rows(run / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert "actor_train/ppo/ref_kl" in rows[0]
    _check_trained(run, 3)
    trainer = (run / "logs" / "model_worker_0.log").read_text()
    sizes = [
        int(b) for b in re.findall(r"published actor version \d+: (\d+) bytes \(its LoRA", trainer)
    ]
    # rank 8 x (in + out) of q, k, v, o, gate, up, down (hidden 256, kv 128, MLP 512) x 4
    # blocks x 4 bytes: 0.5 MiB, where the model is 16 MiB
    per_rank = (256 + 256) + 2 * (256 + 128) + (256 + 256) + 3 * (256 + 512)
    assert sizes and set(sizes) == {8 * per_rank * 4 * 4} == {524288}
    manager = (run / "logs" / "gserver_manager_0.log").read_text()
    assert re.findall(
        r"weights of version \d+ on 1 servers in \S+ \(weight_sync=broadcast\)", manager
    )


def _check_attacks_changed_nothing(run, probe, evil):
    ports = {(ip, port) for _, ip, port in probe.listening}
    assert len(ports) >= 8, f"the probe saw too few sockets to prove anything: {probe.listening}"
    assert {ip for ip, _ in ports} == {"127.0.0.1"}, sorted(probe.listening)
    # Every kind of ZMQ socket got forgeries: worker control, request/reply, push/pull.
    kinds = {k.split("/run0/")[1].split("/")[0] for k in probe.zmq_attacked}
    assert len(kinds) == 3 and len(probe.zmq_attacked) >= 5, probe.zmq_attacked
    assert not evil.exists(), "a forged message was unpickled"
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "without this run's MAC" in logs, "the drops were logged"
    # Control routes without the token: refused, the run went on (it finished, above).
    assert probe.http_answers and {c for _, c in probe.http_answers} <= {401, 403}, (
        probe.http_answers
    )


def test_multi_turn_agent_trains_on_whole_conversations(tmp_path):
    # 16-token answers: the embedded SFT model gets some right at once, and the others get
    # the feedback and another turn.
    run = _run_to_the_end(
        tmp_path,
        "max_turns=3",
        "ppo.gen.max_new_tokens=16",
        "exp_ctrl.benchmark_steps=3",
        "eval=false",
    )
    rows = quickstart_runs.rows(run / "metrics.jsonl")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["rollout/staleness_max"] <= ETA for x in rows)
    assert all(1.0 <= x["rollout/turns_mean"] <= 3.0 for x in rows)
    assert max(x["rollout/turns_mean"] for x in rows) > 1.0  # some members tried again
    batches = _check_trained(run, 3)
    turns = [n for b in batches for group in b["n_turns"] for n in group]
    assert len(turns) == 3 * B * 2 and set(turns) <= {1, 2, 3}


def _wait_for_step(run, step, proc, timeout=300):
    deadline = time.monotonic() + timeout
    path = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.exists() and any(r["step"] >= step for r in quickstart_runs.rows(path)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached in {timeout}s")


def test_killed_trainer_resumes_exactly(tmp_path):
    proc = quickstart_runs.popen(
        _cmd(
            tmp_path,
            "exp_ctrl.benchmark_steps=7",
            "exp_ctrl.ckpt_freq_steps=2",
            "eval=false",
            "recover_mode=auto",
            "recover_retries=1",
            # Servers pull each version from the trainer's weight sender; the restarted
            # trainer's new sender (a new address) is where they pull from after recovery.
            "weight_sync=broadcast",
        )
    )
    run = tmp_path / "async-ppo-math" / "run0"
    try:
        _wait_for_step(run, 3, proc)  # a recover checkpoint of step 2 exists
        victims = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "model_worker" in " ".join(p.info["cmdline"] or []) and _child_of(p, proc.pid)
        ]
        assert victims, "no model worker process found"
        for p in victims:
            p.kill()
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "recovering from the last checkpoint" in out
    rows = quickstart_runs.last_per_step(quickstart_runs.rows(run / "metrics.jsonl"))
    assert [x["step"] for x in rows] == list(range(1, 8))
    assert all(x["rollout/staleness_max"] <= ETA for x in rows)
    _check_trained(run, 7)
    master = (run / "logs" / "master_worker_0.log").read_text()
    assert "(resumed from" in master
    manager = (run / "logs" / "gserver_manager_0.log").read_text()
    resumed_at = [
        int(x.split("the trainer starts at ")[1].split()[0])
        for x in manager.splitlines()
        if "the trainer starts at" in x
    ]
    assert resumed_at[0] == 0 and resumed_at[-1] in (2 * B, 4 * B, 6 * B)
    after = manager[manager.rindex("the trainer starts at") :]
    pushed = re.findall(r"weights of version \d+ on 1 servers in \S+ \(weight_sync=(\w+)\)", after)
    assert pushed and set(pushed) == {"broadcast"}, after[-3000:]
    assert set(re.findall(r"\(weight_sync=(\w+)\)", manager)) == {"broadcast"}
    rollout = (run / "logs" / "rollout_worker_0.log").read_text()
    assert "already trained are skipped" in rollout


def _child_of(p, ancestor: int) -> bool:
    try:
        return any(a.pid == ancestor for a in p.parents())
    except psutil.Error:
        return False
