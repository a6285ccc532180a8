"""The quickstart experiments on tensor-parallel trainer layouts, through real processes.

* ppo-math with every MFC of its graph (generate, reward, ref, critic inference, proximal
  log-probs, actor and critic training) on ``d1p1m2`` computes what ``d1p1m1`` computes;
* sft on ``d2p1m2`` (two replicas of two tensor ranks) trains and saves a HuggingFace model;
* the trainer of async-ppo-math on ``d1p1m2`` trains within the staleness bound.
"""

import json
import os

import pytest
import quickstart_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    """A freshly initialised tiny model (the embedded one is trained already)."""
    return quickstart_runs.make_tiny_model(tmp_path_factory.mktemp("init") / "m")


def _quickstart(name, args, tmp_path, trial, timeout=400):
    r = quickstart_runs.run([name, *args, f"fileroot={tmp_path}", f"trial_name={trial}"], timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(os.path.join(tmp_path, name, trial, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f]


def test_ppo_math_every_mfc_on_tensor_parallel_matches_one_rank(tmp_path):
    args = [
        "train_batch_size=4",
        "ppo.group_size=2",
        "ppo.gen.max_new_tokens=4",
        "ppo.kl_ctl=0.1",  # ref_inf
        "ppo.disable_value=false",  # critic_inf, critic_train
        "ppo.use_decoupled_loss=true",
        "ppo.ppo_n_minibatches=2",  # actor_inf (proximal log-probs)
        "exp_ctrl.benchmark_steps=2",
        "exp_ctrl.eval_freq_steps=2",
        "exp_ctrl.eval_at_start=false",
        "dataset.eval_max_new_tokens=4",
    ]
    runs = {
        layout: _quickstart("ppo-math", [*args, f"allocation_mode={layout}"], tmp_path, layout)
        for layout in ("d1p1m1", "d1p1m2")
    }
    base, tp = runs["d1p1m1"], runs["d1p1m2"]
    assert [r["step"] for r in tp] == [1, 2]
    for mfc in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_inf"):
        assert f"timing/{mfc}" in tp[0], mfc
    for key in (
        "rew_inf/math_reward/reward",
        "actor_train/ppo_actor/loss",
        "actor_train/ppo_actor/importance_weight",
        "actor_train/ppo/ref_kl",
        "critic_train/ppo_critic/loss",
        # sums: counted once per replica, not once per tensor rank
        "actor_train/ppo/n_seqs",
        "actor_train/ppo/n_valid_tokens",
    ):
        matches = [k for k in base[0] if k == key or k.startswith(key)]
        assert matches, (key, sorted(base[0]))
        for k in matches:
            assert [r[k] for r in tp] == pytest.approx([r[k] for r in base], rel=1e-3, abs=1e-5), k
    assert tp[-1]["eval/greedy_acc"] == base[-1]["eval/greedy_acc"]


def test_sft_on_two_tensor_parallel_replicas(init_model, tmp_path):
    rows = _quickstart(
        "sft",
        [
            f"model.path={init_model}",
            "allocation_mode=d2p1m2",
            "train_batch_size=16",
            "exp_ctrl.benchmark_steps=4",
            "exp_ctrl.save_freq_steps=4",
        ],
        tmp_path,
        "run0",
    )
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert rows[-1]["trainDefault/sft/loss"] < rows[0]["trainDefault/sft/loss"]
    run = tmp_path / "sft" / "run0"
    assert (run / "logs" / "model_worker_3.log").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(
        run / "checkpoints" / "default" / "epoch1epochstep4globalstep4"
    )


def test_async_ppo_math_trainer_on_tensor_parallel(tmp_path):
    rows = _quickstart(
        "async-ppo-math",
        [
            "allocation_mode=gen.d1p1m1+d1p1m2",
            "train_batch_size=4",
            "ppo.group_size=2",
            "ppo.gen.max_new_tokens=6",
            "max_head_offpolicyness=1",
            "exp_ctrl.benchmark_steps=3",
            "exp_ctrl.eval_freq_steps=3",
            "exp_ctrl.eval_at_start=false",
            "dataset.eval_max_new_tokens=4",
            "worker_timeout=120",
        ],
        tmp_path,
        "run0",
    )
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["rollout/staleness_max"] <= 1 for x in rows)
    assert "eval/greedy_acc" in rows[-1] and "actor_train/ppo_actor/loss" in rows[0]
    # Replica 0 (both tensor ranks) publishes every version for the generation server.
    weights = tmp_path / ".cache" / "async-ppo-math" / "run0" / "weights" / "actor"
    assert (weights / "v3" / "config.json").exists()
