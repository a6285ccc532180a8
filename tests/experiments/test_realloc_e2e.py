"""Parameter reallocation end to end: ppo-math with each MFC on its own layout computes what
the one-rank run computes, through real processes.

The per-MFC run puts generation on two data-parallel replicas, training on two pipeline
stages, the proximal log-probs on two tensor ranks and the reference model (offloaded between
calls) on two replicas; reallocation brings the actor's replicas up to date before each of
their calls.  Generation seeds every answer from its prompt (not from the replica that
samples it), so both runs sample the same answers and must end with the same weights.
"""

import json
import os

import pytest
import quickstart_runs
import torch

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARGS = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=8",
    "ppo.kl_ctl=0.1",  # ref_inf
    "ppo.use_decoupled_loss=true",
    "ppo.ppo_n_minibatches=2",  # actor_inf (proximal log-probs)
    "ref.offload=true",
    "exp_ctrl.benchmark_steps=3",
    "exp_ctrl.eval_freq_steps=3",
    "exp_ctrl.eval_at_start=false",
    "exp_ctrl.save_freq_steps=3",
    "dataset.eval_max_new_tokens=4",
    # Every step's batch must mix right and wrong answers.  With all rewards equal (seed 1
    # draws such a first batch) the advantages are rounding noise in the KL term, scaled up
    # by the normalisation, and Adam's first step follows its sign: one rank and the split
    # layouts then train apart on CPUs whose kernels round differently by shape (an Intel
    # Xeon VM did; the AMD EPYC ones happened not to).
    "seed=2",
]
PER_MFC = "actor_gen:d2p1m1,actor_train:d1p2m1,actor_inf:d1p1m2,ref_inf:d2p1m1"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("d1"), "d1", "d1p1m1")


def _run(tmp_path, trial, allocation, *extra):
    r = quickstart_runs.run(
        [
            "ppo-math",
            *ARGS,
            f"allocation_mode={allocation}",
            *extra,
            f"fileroot={tmp_path}",
            f"trial_name={trial}",
        ],
        400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "ppo-math" / trial
    with open(run / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return run, rows


def _weights(run):
    from safetensors.torch import load_file

    d = run / "checkpoints" / "actor" / "epoch1epochstep3globalstep3"
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            out.update(load_file(str(d / name)))
    return out


@pytest.mark.parametrize("keep", [True, False], ids=["keep_replicas", "free_replicas"])
def test_ppo_math_per_mfc_layouts_train_like_one_rank(base, tmp_path, keep):
    base_run, base = base
    run, rows = _run(tmp_path, "per_mfc", PER_MFC, f"keep_replicas={str(keep).lower()}")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Same answers, rewards and losses at every step.
    for key in (
        "rew_inf/math_reward/reward",
        "actor_train/ppo_actor/loss",
        "actor_train/ppo_actor/importance_weight",
        "actor_train/ppo/ref_kl",
        "actor_train/ppo/n_valid_tokens",
    ):
        matches = [k for k in base[0] if k.startswith(key)]
        assert matches, (key, sorted(base[0]))
        for k in matches:
            got, want = [r[k] for r in rows], [r[k] for r in base]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), k
    assert rows[-1]["eval/greedy_acc"] == base[-1]["eval/greedy_acc"]
    # The same weights after 3 steps (fp32; pipeline stages and tensor shards sum in
    # another order than one rank does).
    w, wb = _weights(run), _weights(base_run)
    assert sorted(w) == sorted(wb)
    for name in wb:
        torch.testing.assert_close(w[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.equal(wb[n], w0) for n, w0 in _initial(run).items()), "nothing trained"

    # Reallocation: the actor's replicas follow every step (gen and proximal log-probs), the
    # reference model is not trained and lives on its own layout (nothing to reallocate).
    # Kept or freed after each call, a replica is refilled once per step here: the actor
    # trains every step.
    for r in rows:
        for mfc in ("actor_gen", "actor_inf"):
            assert r[f"realloc/{mfc}_bytes"] > 0, (mfc, r)
        assert not any(k.startswith("realloc/ref_inf") for k in r)
    with open(run / "trace.json") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e["name"] for e in events if e.get("name", "").startswith("realloc")]
    # 3 steps x (gen on 2 ranks + proximal log-probs on 2 ranks)
    assert names.count("realloc actor d1p2m1->d2p1m1") == 3 * 2
    assert names.count("realloc actor d1p2m1->d1p1m2") == 3 * 2


def _initial(run):
    from safetensors.torch import load_file

    from realhf.experiments.building_blocks import TINY_MODEL

    out = {}
    for name in os.listdir(TINY_MODEL):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(TINY_MODEL, name)))
    return out


def test_async_ppo_math_trainer_on_per_mfc_layouts(tmp_path):
    """Decoupled generation servers + a per-MFC trainer: training on two pipeline stages,
    the proximal log-probs on two replicas refilled every step; weights still reach the
    generation server from the home layout, within the staleness bound."""
    r = quickstart_runs.run(
        [
            "async-ppo-math",
            "allocation_mode=gen.d1p1m1+actor_train:d1p2m1,actor_inf:d2p1m1",
            "ppo.recompute_logprob=true",
            "train_batch_size=4",
            "ppo.group_size=2",
            "ppo.gen.max_new_tokens=6",
            "max_head_offpolicyness=1",
            "exp_ctrl.benchmark_steps=3",
            "exp_ctrl.eval_freq_steps=3",
            "exp_ctrl.eval_at_start=false",
            "dataset.eval_max_new_tokens=4",
            "worker_timeout=120",
            f"fileroot={tmp_path}",
            "trial_name=run0",
        ],
        400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "async-ppo-math" / "run0" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["rollout/staleness_max"] <= 1 for x in rows)
    assert all(
        x["realloc/actor_inf_bytes"] > 0 and x["realloc/actor_inf_seconds"] >= 0 for x in rows
    )
    assert "eval/greedy_acc" in rows[-1]
    weights = tmp_path / ".cache" / "async-ppo-math" / "run0" / "weights" / "actor"
    assert (weights / "v3" / "config.json").exists()
