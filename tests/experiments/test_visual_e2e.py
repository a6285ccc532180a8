"""The embedded visual task end to end: sft, sync and async PPO with images (few steps).

A run whose batches lost their images fails (image placeholders without images are refused
by the engines), so a run that ends here trained on the images."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quickstart(args, tmp_path, timeout=400):
    return subprocess.run(
        [sys.executable, "-m", "realhf.apps.quickstart", *args, f"fileroot={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sft_learns_from_images(tmp_path):
    r = _quickstart(
        ["sft", "task=tiny_visual", "train_batch_size=16", "exp_ctrl.benchmark_steps=4",
         "exp_ctrl.save_freq_steps=4"],
        tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(tmp_path / "sft" / "run0")
    assert len(rows) == 4
    ckpt = tmp_path / "sft" / "run0" / "checkpoints" / "default" / "epoch1epochstep4globalstep4"
    # A saved VLM is complete: HF loads it, and it keeps its image processor.
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt)
    AutoImageProcessor.from_pretrained(ckpt)


@pytest.mark.parametrize("exp", ["ppo-math", "async-ppo-math"])
def test_ppo_with_images_runs_and_evaluates(exp, tmp_path):
    args = [exp, "task=tiny_visual", "train_batch_size=4", "ppo.group_size=2",
            "ppo.gen.max_new_tokens=8", "exp_ctrl.benchmark_steps=2",
            "exp_ctrl.eval_freq_steps=2", "dataset.eval_max_new_tokens=8"]  # fmt: skip
    if exp == "async-ppo-math":
        args += ["new_tokens_per_chunk=4", "max_head_offpolicyness=1", "worker_timeout=120"]
    r = _quickstart(args, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    start, *rows = _metrics(tmp_path / exp / "run0")
    assert start["step"] == 0 and "eval/greedy_acc" in start
    assert [x["step"] for x in rows] == [1, 2] and "eval/greedy_acc" in rows[-1]
