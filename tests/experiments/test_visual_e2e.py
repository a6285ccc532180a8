"""The embedded visual task end to end: sft, sync and async PPO with images (few steps).

A run whose batches lost their images fails (image placeholders without images are refused
by the engines), so a run that ends here trained on the images."""

from __future__ import annotations

import pytest
import quickstart_runs as runs

pytestmark = pytest.mark.slow


def _run(exp, args, tmp_path):
    """Run ``exp`` to its end; its metrics rows."""
    runs.finish(runs.start(exp, args, tmp_path, trial="run0"))
    return runs.rows(tmp_path / exp / "run0" / "metrics.jsonl")


def test_sft_learns_from_images(tmp_path):
    rows = _run(
        "sft",
        ["task=tiny_visual", "train_batch_size=16", "exp_ctrl.benchmark_steps=4",
         "exp_ctrl.save_freq_steps=4"],
        tmp_path,
    )  # fmt: skip
    assert len(rows) == 4
    ckpt = tmp_path / "sft" / "run0" / "checkpoints" / "default" / "epoch1epochstep4globalstep4"
    # A saved VLM is complete: HF loads it, and it keeps its image processor.
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt)
    AutoImageProcessor.from_pretrained(ckpt)


@pytest.mark.parametrize("exp", ["ppo-math", "async-ppo-math"])
def test_ppo_with_images_runs_and_evaluates(exp, tmp_path):
    args = ["task=tiny_visual", "train_batch_size=4", "ppo.group_size=2",
            "ppo.gen.max_new_tokens=8", "exp_ctrl.benchmark_steps=2",
            "exp_ctrl.eval_freq_steps=2", "dataset.eval_max_new_tokens=8"]  # fmt: skip
    if exp == "async-ppo-math":
        args += ["new_tokens_per_chunk=4", "max_head_offpolicyness=1", "worker_timeout=120"]
    start, *rows = _run(exp, args, tmp_path)
    assert start["step"] == 0 and "eval/greedy_acc" in start
    assert [x["step"] for x in rows] == [1, 2] and "eval/greedy_acc" in rows[-1]
