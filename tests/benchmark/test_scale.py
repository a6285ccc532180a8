"""benchmark/scale.py: the step split from a run's trace, the peak RSS of a run's workers,
and the written prompts of a chosen length."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from types import SimpleNamespace

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "scale.py")
_spec = importlib.util.spec_from_file_location("benchmark_scale", _PATH)
scale = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = scale
_spec.loader.exec_module(scale)


def test_step_split_sums_each_parts_calls_inside_the_step():
    trace = [
        {"name": "step 1", "ph": "X", "ts": 0, "dur": 10_000_000},
        {"name": "actor_gen", "ph": "X", "ts": 0, "dur": 1_000_000},
        {"name": "step 2", "ph": "X", "ts": 10_000_000, "dur": 10_000_000},
        {"name": "actor_gen", "ph": "X", "ts": 10_000_000, "dur": 4_000_000},
        {"name": "rew_inf", "ph": "X", "ts": 14_000_000, "dur": 500_000},
        {"name": "actor_train", "ph": "X", "ts": 15_000_000, "dur": 5_000_000},
    ]
    last = {"actor_train/weights/publish_s": 0.75, "timing/actor_train": 5.0}
    split = scale.step_split(trace, 2, last)
    assert split == {"generation": 4.0, "inference": 0.5, "training": 5.0, "publication": 0.75}


def test_the_watcher_records_the_peak_of_the_runs_workers_only(tmp_path):
    # Processes with a worker's arguments (forked workers show the same words as one
    # title string; the watcher splits both forms alike), holding ~200 MB.
    body = "import time; x = bytearray(200 * 2**20); time.sleep(30)"
    args = ["--type", "model_worker", "--index", "0", "--experiment", "e", "--trial"]
    mine = subprocess.Popen([sys.executable, "-c", body, *args, "T1"])
    other = subprocess.Popen([sys.executable, "-c", body, *args, "T2"])
    watcher = scale.PeakWatcher("T1", interval=0.05)
    watcher.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and watcher.peaks.get("model_worker/0", 0) < 200 * 2**20:
            time.sleep(0.1)
    finally:
        watcher.done.set()
        watcher.join()
        for p in (mine, other):
            p.kill()
            p.wait()
    assert list(watcher.peaks) == ["model_worker/0"]
    assert 200 * 2**20 <= watcher.peaks["model_worker/0"] < 400 * 2**20


def test_written_prompts_and_answers_have_the_asked_lengths(tmp_path):
    import json

    from realhf.experiments.building_blocks import TINY_MODEL, load_tokenizer

    tok = load_tokenizer(TINY_MODEL)
    paths = scale.write_data(SimpleNamespace(prompt_len=128, answer_len=64), str(tmp_path))
    with open(paths["math"]) as f:
        rows = [json.loads(line) for line in f]
    with open(paths["sft"]) as f:
        sft = [json.loads(line) for line in f]
    for row in rows[:5]:
        n = len(tok(row["prompt"], add_special_tokens=False)["input_ids"])
        assert 120 <= n <= 136, n
        assert row["prompt"].rstrip(".").split()[-1].count("+") == 1  # ends with the question
    n = len(tok(sft[0]["answer"], add_special_tokens=False)["input_ids"])
    assert 50 <= n <= 70, n


def test_rss_samples_are_attributed_to_the_calls_they_fall_in():
    trace = [
        {"name": "step 1", "ph": "X", "ts": 0, "dur": 10_000_000},
        {"name": "actor_gen", "ph": "X", "ts": 1_000_000, "dur": 2_000_000},
        {"name": "actor_train", "ph": "X", "ts": 5_000_000, "dur": 4_000_000},
    ]
    g = scale.GiB
    samples = {"model_worker/0": [(0.5, 1 * g), (2.0, 3 * g), (6.0, 5 * g), (8.0, 4 * g)]}
    assert scale.phase_peaks(trace, samples) == {
        "model_worker/0": {"other": 1.0, "actor_gen": 3.0, "actor_train": 5.0}
    }


def test_a_run_that_cannot_fit_is_not_started_and_its_largest_terms_are_named(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(scale.memory_plan, "available_memory", lambda: 1 << 20)
    monkeypatch.setattr(scale.subprocess, "run", None)  # nothing may be launched
    scale.quickstart._load_experiments()
    args = SimpleNamespace(
        batch=4,
        group_size=4,
        answer_len=8,
        steps=1,
        extra="",
        models_dir=str(tmp_path),
        prompt_len=0,
        timeout=60,
    )
    r = scale.one_run(args, "tiny", "sync", 1, str(tmp_path), {}, "float32")
    assert r["fits"] is False and r["need_gib"] > r["available_gib"] == 1 / 1024
    assert len(r["largest_terms"]) == 3 and r["largest_terms"][0].startswith("model_worker x1: ")
