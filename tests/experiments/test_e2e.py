"""sft and ppo-math end to end through real worker processes (tiny model, few steps)."""

import json
import os

import pytest
import quickstart_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def init_model(tmp_path_factory):
    return quickstart_runs.make_tiny_model(tmp_path_factory.mktemp("init") / "m")


def _quickstart(args, tmp_path, timeout=400):
    return quickstart_runs.run([*args, f"fileroot={tmp_path}"], timeout)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f]


def test_sft_two_data_parallel_workers(init_model, tmp_path):
    r = _quickstart(
        [
            "sft",
            f"model.path={init_model}",
            "allocation_mode=d2p1m1",
            "train_batch_size=16",
            "exp_ctrl.benchmark_steps=4",
            "exp_ctrl.save_freq_steps=4",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "sft" / "run0"
    rows = _metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert rows[-1]["trainDefault/sft/loss"] < rows[0]["trainDefault/sft/loss"]
    for f in ("config.yaml", "trace.json", "curves.png", "logs/model_worker_1.log"):
        assert (run / f).exists(), f
    ckpt = run / "checkpoints" / "default" / "epoch1epochstep4globalstep4"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(ckpt)  # a HuggingFace directory
    AutoTokenizer.from_pretrained(ckpt)


def test_ppo_math_grpo_runs_and_evaluates(init_model, tmp_path):
    r = _quickstart(
        [
            "ppo-math",
            f"actor.path={init_model}",
            "train_batch_size=4",
            "ppo.group_size=2",
            "ppo.gen.max_new_tokens=4",
            "exp_ctrl.benchmark_steps=2",
            "exp_ctrl.eval_freq_steps=2",
            "dataset.eval_max_new_tokens=4",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "ppo-math" / "run0"
    start, *rows = _metrics(run)
    # Step 0: the evaluation before training (exp_ctrl.eval_at_start, on by default here).
    assert start["step"] == 0 and "eval/greedy_acc" in start and "n_items" not in start
    assert [x["step"] for x in rows] == [1, 2]
    assert "eval/greedy_acc" in rows[-1]
    assert "rew_inf/math_reward/reward" in rows[0] and "timing/actor_gen" in rows[0]
    assert any((run / "checkpoints" / "actor").iterdir())


def test_null_experiment_moves_data_between_two_workers(tmp_path):
    r = _quickstart(
        ["null", "allocation_mode=d2p1m1", "exp_ctrl.benchmark_steps=3"], tmp_path, timeout=200
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _metrics(tmp_path / "null" / "run0")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["n_items"] == 64 for x in rows)
    assert any("null_train/null/n_tokens" in k or "null/n_tokens" in k for k in rows[0])


def test_bad_input_exits_nonzero_without_workers(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    r = _quickstart(["ppo-math", f"dataset.path={bad}"], tmp_path, timeout=120)
    assert r.returncode == 2 and "bad.jsonl:1: invalid JSON" in r.stderr
    assert not (tmp_path / "ppo-math" / "run0" / "logs").exists()  # nothing was launched
    r = _quickstart(["ppo-math", "ppo.kl_ctrl=0.1"], tmp_path, timeout=120)
    assert r.returncode == 2 and "did you mean 'ppo.kl_ctl'" in r.stderr


def test_ppo_math_dapo_drops_agreeing_groups_and_refills_the_batch(tmp_path):
    # The embedded SFT model solves about a third of the problems: many groups of 4 answers
    # agree (all wrong, sometimes all right) and are replaced by new prompts.
    r = _quickstart(
        [
            "ppo-math",
            "algo=dapo",
            "train_batch_size=8",
            "ppo.group_size=4",
            "exp_ctrl.benchmark_steps=3",
            "eval=false",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _metrics(tmp_path / "ppo-math" / "run0")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert sum(x["rew_inf/math_reward/dropped_groups"] for x in rows) > 0
    assert max(x["dynamic_sampling/rounds"] for x in rows) >= 2
    for x in rows:
        assert x["n_items"] == x["dynamic_sampling/kept"]
        assert x["n_items"] == 8 or x["dynamic_sampling/rounds"] == 4
        # every trained group has answers that disagree: none is filtered again in the loss
        assert x["actor_train/ppo/n_filtered_groups"] == 0
