"""rw and dpo end to end through real worker processes on the embedded pairs (few steps)."""

import json
import os

import pytest
import quickstart_runs

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quickstart(args, tmp_path, timeout=300):
    return quickstart_runs.run([*args, f"fileroot={tmp_path}"], timeout)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _few_pairs(tmp_path, split, n):
    src = os.path.join(ROOT, "realhf", "assets", "tiny", "data", f"pairs_{split}.jsonl")
    with open(src) as f:
        rows = f.readlines()[:n]
    out = tmp_path / f"pairs_{split}.jsonl"
    out.write_text("".join(rows))
    return str(out)


def test_rw_trains_evaluates_pair_accuracy_and_saves_a_critic(tmp_path):
    r = _quickstart(
        [
            "rw",
            f"dataset.eval_path={_few_pairs(tmp_path, 'eval', 40)}",
            "train_batch_size=8",
            "exp_ctrl.benchmark_steps=3",
            "exp_ctrl.eval_freq_steps=3",
            "exp_ctrl.save_freq_steps=3",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "rw" / "run0"
    start, *rows = _metrics(run)
    assert start["step"] == 0 and 0.0 <= start["eval/rw_eval/pair_acc"] <= 1.0
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert "eval/rw_eval/pair_acc" in rows[-1] and "rw_train/rw/loss" in rows[0]
    # the default trains with the LM regulariser (lm_coef=3) on the model's own logits
    assert all(x["rw_train/rw/lm_loss"] > 0 for x in rows)
    assert rows[0]["rw_train/rw/loss"] == pytest.approx(
        rows[0]["rw_train/rw/bt_loss"] + 3 * rows[0]["rw_train/rw/lm_loss"], rel=1e-4
    )
    (ckpt,) = (run / "checkpoints" / "reward").iterdir()
    from realhf.impl.model import ReaLModel

    net = ReaLModel.from_hf(str(ckpt), is_critic=True)  # loads back as a scalar-head model
    assert net.config.is_critic
    # The trained reward model then scores the answers inside ppo-math (MFC rm_inf), beside
    # the verifier: each answer's reward is the verdict plus the model's score.
    r = _quickstart(
        [
            "ppo-math",
            f"reward_model.path={ckpt}",
            "train_batch_size=4",
            "ppo.group_size=2",
            "exp_ctrl.benchmark_steps=2",
            "eval=false",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _metrics(tmp_path / "ppo-math" / "run0")
    assert [x["step"] for x in rows] == [1, 2]
    for x in rows:
        assert "rm_inf/rw/score" in x and x["rm_inf/rw/n_scored"] == 8
        assert "rew_inf/math_reward/accuracy" in x and "timing/rm_inf" in x


def test_dpo_trains_against_the_reference_and_reports_greedy_accuracy(tmp_path):
    eval_src = os.path.join(ROOT, "realhf", "assets", "tiny", "data", "eval.jsonl")
    with open(eval_src) as f:
        (tmp_path / "eval.jsonl").write_text("".join(f.readlines()[:16]))
    r = _quickstart(
        [
            "dpo",
            "dpo.loss=ipo",
            f"dataset.eval_path={tmp_path / 'eval.jsonl'}",
            "train_batch_size=8",
            "exp_ctrl.benchmark_steps=2",
            "exp_ctrl.eval_freq_steps=2",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    start, *rows = _metrics(tmp_path / "dpo" / "run0")
    assert start["step"] == 0 and "eval/greedy_acc" in start
    assert [x["step"] for x in rows] == [1, 2]
    assert "eval/greedy_acc" in rows[-1]
    assert "timing/ref_inf" in rows[0] and "actor_train/dpo/loss" in rows[0]


def test_malformed_pairs_exit_nonzero_before_launching(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "p", "chosen": "x"}\n')
    r = _quickstart(["dpo", f"dataset.path={bad}"], tmp_path, timeout=120)
    assert r.returncode == 2 and "bad.jsonl:1: missing field 'rejected'" in r.stderr
    assert not (tmp_path / "dpo" / "run0" / "logs").exists()
