"""The DAG executor as real processes (local scheduler: controller + master + model workers).

* the toy graph gen -> {plus1, times3} -> train over 2 model workers: every item flows
  through every MFC once per epoch, data moves between the workers, the outputs exist;
* 2 data-parallel ranks train like 1 (same weights after the same global batches);
* a SIGKILLed model worker is reported LOST and nothing keeps running; resuming with
  recover_mode=auto ends with the same steps, each item once per epoch, and weights
  identical to an uninterrupted run.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from dag_runs import EXP, launch, metrics
from tiny_models import make_tiny_hf_model

from realhf.base import name_resolve, names
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.scheduler.local import JobFailure

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("dag_e2e")
    make_tiny_hf_model("qwen2", path / "model")
    return path


def _trained_ids(root, trial):
    """{(rank, step): (epoch, ids)}, the last record of each (a resumed run redoes steps)."""
    out = {}
    for path in glob.glob(str(root / trial / "ids" / "train_ids_rank*.jsonl")):
        rank = int(path.rsplit("rank", 1)[1].split(".")[0])
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                out[(rank, r["step"])] = (r["epoch"], r["ids"])
    return out


def _assert_each_item_once_per_epoch(root, trial, n_items, epochs):
    per_epoch = {}
    for epoch, ids in _trained_ids(root, trial).values():
        per_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == sorted(f"item{i}" for i in range(n_items)), epoch


def _final_weights(run_dir):
    dirs = sorted(glob.glob(str(run_dir / "checkpoints" / "actor" / "*")), key=os.path.getmtime)
    assert dirs, f"no saved actor in {run_dir}"
    return ReaLModel.from_hf(dirs[-1]).flat_params


def _status(root, trial):
    repo = name_resolve.make_repository("file", root=str(root / "name_resolve"))
    try:
        return repo.get(names.experiment_status(EXP, trial))
    finally:
        repo.close()


def test_toy_dag_over_two_model_workers(root):
    trial, n_items, epochs = "dag", 16, 2
    codes, run_dir = launch(
        root,
        trial,
        n_model_workers=2,
        n_items=n_items,
        max_len=40,
        train_batch_size=8,
        total_train_epochs=epochs,
        eval=True,
        eval_freq_steps=2,
        plot_curves=True,
    )
    assert not isinstance(codes, Exception), codes
    assert set(codes.values()) == {0}
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["train/mismatches"] == 0 for r in records)  # b = 2x + 1 and c = 6x arrived intact
    assert all(r["train/n_items"] == 4 for r in records)  # 8 items split 4 + 4
    assert ["eval/logprob" in r for r in records] == [False, True, False, True]
    moved = sum(v for r in records for k, v in r.items() if k.startswith("data_transfer/"))
    assert moved > 0, "token-balanced splits should have moved data between the workers"
    _assert_each_item_once_per_epoch(root, trial, n_items, epochs)
    trace = json.load(open(run_dir / "trace.json"))
    calls = [(e["name"], e["pid"]) for e in trace if e["ph"] == "X" and e["pid"] > 0]
    for mfc in ("gen", "plus1", "times3", "train"):
        assert calls.count((mfc, 1)) == calls.count((mfc, 2)) == 4, mfc
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    assert (run_dir / "curves.png").stat().st_size > 0
    assert _status(root, trial) == "COMPLETE"  # written by the controller


def test_two_data_parallel_ranks_train_like_one(root):
    # One step per epoch holds every item, so both layouts see the same global batches.
    weights = {}
    for n in (1, 2):
        codes, run_dir = launch(
            root,
            f"dp{n}",
            graph="sft",
            n_model_workers=n,
            n_items=8,
            train_batch_size=8,
            total_train_epochs=3,
            save_freq_steps=100,
        )
        assert not isinstance(codes, Exception), codes
        weights[n] = _final_weights(run_dir)
        losses = [r["train/loss"] for r in metrics(run_dir)]
        weights[f"loss{n}"] = losses
    assert len(weights["loss1"]) == 3
    assert weights["loss1"] == pytest.approx(weights["loss2"], rel=1e-5)
    assert torch.allclose(weights[1], weights[2], rtol=1e-4, atol=1e-6)
    assert not torch.equal(weights[1], ReaLModel.from_hf(str(root / "model")).flat_params)


def test_killed_worker_is_lost_and_resume_matches_an_uninterrupted_run(root):
    common = dict(
        graph="sft",
        n_model_workers=2,
        n_items=8,
        train_batch_size=4,
        total_train_epochs=2,
        ckpt_freq_steps=2,
        save_freq_steps=100,
        recover_mode="auto",
    )
    codes, base_dir = launch(root, "base", **common)
    assert not isinstance(codes, Exception), codes

    # model_worker/1 SIGKILLs itself when the 4th step (global step 3) starts training.
    failure, run_dir = launch(root, "rec", crash_at_step=3, **common)
    assert isinstance(failure, JobFailure), failure
    summary = json.load(open(run_dir / "controller_summary.json"))
    assert summary["ok"] is False
    assert summary["failures"]["model_worker/1"].startswith("LOST")
    assert "model_worker/1 (killed by SIGKILL)" in str(failure)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    assert os.path.exists(run_dir / "checkpoints" / "recover" / "step2")

    codes, run_dir = launch(root, "rec", **common)
    assert not isinstance(codes, Exception), codes
    base, resumed = metrics(base_dir), metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in base]
    _assert_each_item_once_per_epoch(root, "rec", 8, 2)
    assert torch.equal(_final_weights(run_dir), _final_weights(base_dir))
    log = open(run_dir / "logs" / "master_worker_0.log").read()
    assert "running steps 3..4 (resumed from" in log
