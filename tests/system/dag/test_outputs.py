"""The master's outputs: metrics.jsonl, trace.json, progress text, tensorboard, curves."""

from __future__ import annotations

import glob
import json

from realhf.system.dag.outputs import (
    MetricsLog,
    ProgressDisplay,
    TensorBoardLog,
    TraceLog,
    plot_curves,
    select_keys,
)


def test_metrics_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = str(tmp_path / "m" / "metrics.jsonl")
    log = MetricsLog(path)
    for s in range(1, 6):
        log.write({"step": s, "x/loss": 1.0 / s})
    with open(path, "a") as f:
        f.write('{"step": 6, "x/lo')  # cut by the crash
    MetricsLog(path, resume_step=3).write({"step": 4, "x/loss": 9.0})
    steps = [json.loads(l)["step"] for l in open(path)]
    assert steps == [1, 2, 3, 4]
    MetricsLog(path)  # a fresh run starts empty
    assert open(path).read() == ""


def test_trace_is_valid_json_and_continues_after_a_crash(tmp_path):
    path = str(tmp_path / "trace.json")
    t = TraceLog(path, ["master_worker/0", "model_worker/0"])
    t.complete("gen", "model_worker/0", 10.0, 10.5, tid="actor", n_items=3)
    t.close()
    events = json.load(open(path))
    x = [e for e in events if e["ph"] == "X"]
    assert x == [
        {
            "name": "gen",
            "ph": "X",
            "pid": 1,
            "tid": "actor",
            "ts": 10_000_000,
            "dur": 500_000,
            "args": {"n_items": 3},
        }
    ]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {
        "master_worker/0",
        "model_worker/0",
    }
    # A resumed run appends; a run killed before close() leaves a trailing comma.
    t2 = TraceLog(path, ["master_worker/0", "model_worker/0"], resume=True)
    t2.complete("train", "model_worker/0", 11.0, 12.0)
    t2.flush()  # killed here, in the middle of writing an event
    with open(path, "a") as f:
        f.write('{"name": "cut", "ph": "X", "pid"')
    t3 = TraceLog(path, ["master_worker/0", "model_worker/0"], resume=True)
    t3.complete("train", "model_worker/0", 11.0, 12.0)
    t3.close()
    names = [e["name"] for e in json.load(open(path)) if e["ph"] == "X"]
    assert names == ["gen", "train", "train"]


def test_progress_lines_show_selected_stats_and_accuracy(capsys):
    p = ProgressDisplay(total_steps=4, start_step=0, patterns=("reward",))
    p.update({"step": 1, "epoch": 1, "rew/reward": 0.5, "train/loss": 2.0, "tokens_per_s": 99.4})
    p.update({"step": 2, "epoch": 1, "rew/reward": 0.75, "eval/eval/greedy_acc": 0.25})
    p.update({"step": 3, "epoch": 1, "rew/reward": 1.0})
    lines = [
        l.split(" INFO: ", 1)[1] for l in capsys.readouterr().err.splitlines() if " INFO: " in l
    ]
    assert lines[0].startswith("step 1/4 | epoch 1 | rew/reward=0.5 | 99 tok/s | ETA ")
    assert "train/loss" not in lines[0]
    assert "accuracy=0.250" in lines[1] and "accuracy=0.250" in lines[2]  # kept until the next eval
    assert select_keys(["a/loss", "b/reward", "c"], ()) == ["a/loss", "b/reward"]


def test_tensorboard_and_curves(tmp_path):
    tb = TensorBoardLog(str(tmp_path / "tb"))
    tb.write(1, {"step": 1, "t/loss": 0.5, "note": "text", "nan": float("nan")})
    tb.close()
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    path = str(tmp_path / "metrics.jsonl")
    log = MetricsLog(path)
    for s in range(1, 4):
        log.write({"step": s, "t/loss": 1.0 / s, "eval/acc": 0.1 * s})
    out = plot_curves(path, str(tmp_path / "curves.png"), ())
    assert out and (tmp_path / "curves.png").stat().st_size > 1000
    assert (
        plot_curves(path, str(tmp_path / "none.png"), ("nothing-matches",)) is not None
    )  # eval keys
    MetricsLog(path).write({"step": 1, "x": 1})
    assert plot_curves(path, str(tmp_path / "none.png"), ("nothing-matches",)) is None
