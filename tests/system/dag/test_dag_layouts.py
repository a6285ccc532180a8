"""The DAG over trainer layouts ``dXpYmZ`` as real processes (local scheduler).

* tensor parallelism inside data-parallel replicas trains like one rank: ``d1p1m2`` and
  ``d2p1m2`` give the loss curve and final weights of ``d1p1m1`` on the same global
  batches, and eval metrics count each replica once (``d2p1m2`` evaluates like ``d2p1m1``);
* the master splits every MFC call over the replicas: the ranks of a replica train on the
  same items, the replicas on disjoint parts, every item once per epoch, and the toy
  graph's outputs reach every rank of the consuming replica intact;
* pipeline stages (``d1p2m2``, when ReaLModel supports them) train like one rank too;
* a recover checkpoint of a ``d1p1m2`` run resumes to the weights of an uninterrupted run;
* a model worker refuses a layout that does not span the launched workers.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch
from dag_runs import EXP, launch, metrics
from tiny_models import make_tiny_hf_model

from realhf.api.core.allocation import ParallelismConfig, parse_parallelism
from realhf.api.core.system_api import WorkerInformation, make_experiment
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.scheduler.local import JobFailure
from realhf.system.dag.model_worker import ModelWorker


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("dag_layouts")
    # qwen2 tiny: 4 query / 2 kv heads, MLP 128, vocabulary 128: splits 2 ways.
    make_tiny_hf_model("qwen2", path / "model")
    return path


def _final_weights(run_dir):
    dirs = sorted(glob.glob(str(run_dir / "checkpoints" / "actor" / "*")), key=os.path.getmtime)
    assert dirs, f"no saved actor in {run_dir}"
    return ReaLModel.from_hf(dirs[-1]).flat_params


def _trained_ids(root, trial):
    """{rank: {step: (epoch, ids)}} from the train interface's logs."""
    out = {}
    for path in glob.glob(str(root / trial / "ids" / "train_ids_rank*.jsonl")):
        rank = int(path.rsplit("rank", 1)[1].split(".")[0])
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                out.setdefault(rank, {})[r["step"]] = (r["epoch"], r["ids"])
    return out


@pytest.fixture(scope="module")
def runs():
    """Finished runs by layout (see _train), shared by the tests of this module."""
    return {}


def _train(root, runs, layout, graph="sft"):
    """(metrics, final weights, run dir) of 3 epochs of one step holding every item, so
    that every layout sees the same global batches."""
    if layout not in runs:
        codes, run_dir = launch(
            root,
            layout,
            layout=layout,
            graph=graph,
            n_items=8,
            train_batch_size=8,
            total_train_epochs=3,
            save_freq_steps=100,
            eval=True,
            eval_freq_steps=1,
        )
        assert not isinstance(codes, Exception), codes
        n_workers = parse_parallelism(layout).world_size
        assert sum(k.startswith("model_worker/") for k in codes) == n_workers
        runs[layout] = (metrics(run_dir), _final_weights(run_dir), run_dir)
    return runs[layout]


def _assert_trains_like_one_rank(root, runs, layout):
    base, w_base, _ = _train(root, runs, "d1p1m1")
    assert [r["step"] for r in base] == [1, 2, 3]
    records, w, _ = _train(root, runs, layout)
    assert [r["train/loss"] for r in records] == pytest.approx(
        [r["train/loss"] for r in base], rel=1e-5
    ), layout
    assert torch.allclose(w, w_base, rtol=1e-4, atol=1e-6), layout
    assert not torch.equal(w_base, ReaLModel.from_hf(str(root / "model")).flat_params)


@pytest.mark.slow
def test_layouts_train_like_one_rank_and_split_the_data_over_replicas(root, runs):
    # The toy graph on d2p1m2 also moves MFC outputs between replicas; its train_step
    # loss is the sft graph's (both train on packed_input_ids).
    _train(root, runs, "d2p1m2", graph="dag")
    for layout in ("d1p1m2", "d2p1m1", "d2p1m2"):
        _assert_trains_like_one_rank(root, runs, layout)
    # Eval metrics are item-weighted over the replicas, each replica counted once (the
    # toy metric is a token mean per replica, so d1 and d2 differ slightly).
    for tp, dp in (("d1p1m2", "d1p1m1"), ("d2p1m2", "d2p1m1")):
        assert [r["eval/logprob"] for r in runs[tp][0]] == pytest.approx(
            [r["eval/logprob"] for r in runs[dp][0]], rel=1e-5
        ), tp

    # d2p1m2: replica 0 = ranks 0, 1; replica 1 = ranks 2, 3.
    records, _, run_dir = runs["d2p1m2"]
    assert all(r["train/mismatches"] == 0 for r in records)  # b = 2x+1, c = 6x on all ranks
    assert all(r["train/n_items"] == 4 for r in records)  # per replica, not per rank
    ids = _trained_ids(root, "d2p1m2")
    assert sorted(ids) == [0, 1, 2, 3]
    for step in range(3):
        assert ids[0][step] == ids[1][step] and ids[2][step] == ids[3][step], step
        r0, r1 = set(ids[0][step][1]), set(ids[2][step][1])
        assert not r0 & r1
        assert r0 | r1 == {f"item{i}" for i in range(8)}
    trace = json.load(open(run_dir / "trace.json"))
    calls = [(e["name"], e["pid"]) for e in trace if e["ph"] == "X" and e["pid"] > 0]
    for mfc in ("gen", "plus1", "times3", "train"):
        assert [calls.count((mfc, pid)) for pid in (1, 2, 3, 4)] == [3] * 4, mfc


@pytest.mark.slow
def test_pipeline_layout_trains_like_one_rank(root, runs):
    _assert_trains_like_one_rank(root, runs, "d1p2m2")


@pytest.mark.slow
def test_tensor_parallel_run_resumes_like_an_uninterrupted_one(root):
    common = dict(
        layout="d1p1m2",
        graph="sft",
        n_items=8,
        train_batch_size=4,
        total_train_epochs=2,
        ckpt_freq_steps=2,
        save_freq_steps=100,
        recover_mode="auto",
    )
    codes, base_dir = launch(root, "tp_base", **common)
    assert not isinstance(codes, Exception), codes
    # model_worker/1 (tensor rank 1) SIGKILLs itself when global step 3 starts training.
    failure, run_dir = launch(root, "tp_rec", crash_at_step=3, crash_rank=1, **common)
    assert isinstance(failure, JobFailure), failure
    assert os.path.exists(run_dir / "checkpoints" / "recover" / "step2")
    codes, run_dir = launch(root, "tp_rec", **common)
    assert not isinstance(codes, Exception), codes
    base, resumed = metrics(base_dir), metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in resumed] == [r["train/loss"] for r in base]
    assert torch.equal(_final_weights(run_dir), _final_weights(base_dir))
    assert (
        "running steps 3..4 (resumed from" in open(run_dir / "logs" / "master_worker_0.log").read()
    )


def test_model_worker_refuses_a_layout_that_does_not_span_the_workers(
    tmp_path, memory_name_resolve, trial
):
    exp = make_experiment(EXP, model_path=str(tmp_path), n_model_workers=1)
    cfg = dataclasses.replace(exp.workers["model_worker"][0], layout=ParallelismConfig(1, 1, 2))
    worker = ModelWorker(EXP, trial, "model_worker", 0)
    info = WorkerInformation(EXP, trial, "model_worker", 0, 1)
    try:
        with pytest.raises(
            ValueError,
            match=r"layout=d1p1m2 spans d·p·m = 2 model workers but the experiment launched 1",
        ):
            worker.handle_control("configure", worker_info=info, config=cfg)
    finally:
        worker._exit_hook()
