"""benchmark/simulate.py: the sync/async throughput model against hand-computed bounds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "simulate.py")
_spec = importlib.util.spec_from_file_location("benchmark_simulate", _PATH)
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim  # dataclasses look their module up while the file executes
_spec.loader.exec_module(sim)

B, G, P = 4, 8, 5  # prompts per step, answers per prompt, prompt tokens


def _fixed(length: int) -> sim.Workload:
    return sim.Workload(B, G, sim.Lengths(values=(length,)), P)


def _long_tail() -> sim.Workload:
    return sim.Workload(16, 8, sim.Lengths(median=20, sigma=1.0, cap=400), 8)


def test_sync_step_is_the_closed_form_on_equal_lengths():
    L, n = 10, B * G
    gen = sim.GenCost(step_s=1e-3, seq_s=1e-5, ctx_token_s=1e-7, prefill_call_s=2e-3,
                      prefill_token_s=1e-5, call_s=0.01)  # fmt: skip
    train = sim.TrainCost(0.1, 1e-5, 1e-8)
    res = sim.simulate_sync(gen, train, _fixed(L), sim.Setup(step_overhead_s=0.05, n_steps=3))
    # L steps over all n sequences (the first also prefills the B distinct prompts once);
    # step i reads n·(P + i) cached tokens.
    decode = sum(1e-3 + 1e-5 * n + 1e-7 * n * (P + i) for i in range(L))
    expected = 0.01 + decode + 2e-3 + 1e-5 * B * P + train.step([P + L] * n) + 0.05
    assert res.step_s == pytest.approx([expected] * 3, rel=1e-12)
    assert res.samples_per_s == pytest.approx(B / expected)
    assert res.trainer_idle_share == pytest.approx(1 - (train.step([P + L] * n) + 0.05) / expected)


def test_two_engines_split_the_batch_and_halve_the_prefill():
    L, n = 6, B * G
    gen = sim.GenCost(step_s=1e-3, seq_s=1e-4, prefill_token_s=1e-4)
    res = sim.simulate_sync(gen, sim.TrainCost(0, 0), _fixed(L), sim.Setup(n_gen=2, n_steps=1))
    assert res.step_s[0] == pytest.approx(L * (1e-3 + 1e-4 * n / 2) + 1e-4 * B * P / 2)


def test_async_with_free_training_reaches_the_generation_bound():
    L, step = 12, 1e-3
    gen, free = sim.GenCost(step_s=step), sim.TrainCost(0.0, 0.0)
    res = sim.simulate_async(gen, free, _fixed(L), sim.Setup(eta=4, n_steps=20))
    bound = B / (L * step)  # every L steps the B running groups finish and B new ones start
    assert 0.98 * bound <= res.steady_samples_per_s <= bound * (1 + 1e-9)
    assert res.trainer_idle_share > 0.99


def test_eta0_waits_for_each_version_and_eta1_overlaps():
    L, step, t_train = 10, 1e-3, 0.02
    gen, train = sim.GenCost(step_s=step), sim.TrainCost(t_train, 0.0)
    gen_s = L * step
    r0 = sim.simulate_async(gen, train, _fixed(L), sim.Setup(eta=0, load_s=1e-3, n_steps=12))
    r1 = sim.simulate_async(gen, train, _fixed(L), sim.Setup(eta=1, load_s=1e-3, n_steps=12))
    assert r0.samples_per_s <= B / (gen_s + t_train) * (1 + 1e-9)  # no overlap at η = 0
    assert r1.samples_per_s <= B / max(gen_s, t_train) * (1 + 1e-9)  # perfect pipelining
    assert r1.steady_samples_per_s > 1.2 * r0.steady_samples_per_s


def test_long_tail_async_beats_sync_when_gen_and_train_have_their_own_devices():
    # Two devices: sync uses both for each phase (two engines, training twice as fast);
    # async gives one to a generation server and one to the trainer.
    gen = sim.GenCost(step_s=1e-3, seq_s=2e-6, ctx_token_s=1e-9, prefill_token_s=1e-6)
    train_1dev, train_2dev = sim.TrainCost(0.01, 3e-5), sim.TrainCost(0.005, 1.5e-5)
    work = _long_tail()
    sync = sim.simulate_sync(gen, train_2dev, work, sim.Setup(n_gen=2, n_steps=16))
    asyn = sim.simulate_async(gen, train_1dev, work, sim.Setup(eta=2, load_s=2e-3, n_steps=16))
    assert asyn.steady_samples_per_s / sync.steady_samples_per_s > 1.3
    # the long tail: sync generation ends with a nearly empty batch
    assert min(b for _, b in sync.occupancy if b > 0) <= 2


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_staleness_never_exceeds_eta(eta):
    gen = sim.GenCost(step_s=1e-3, seq_s=1e-5)
    work = _long_tail()
    res = sim.simulate_async(gen, sim.TrainCost(0.02, 1e-5), work, sim.Setup(eta=eta, n_steps=10))
    assert len(res.staleness) == 10 * work.batch
    assert 0 <= min(res.staleness) and max(res.staleness) <= eta
    if eta:
        assert res.interrupted > 0  # weight updates cut answers that then resume


def test_occupancy_stays_within_the_slots():
    gen, train = sim.GenCost(step_s=1e-3), sim.TrainCost(0.01, 1e-6)
    setup = sim.Setup(n_gen=2, max_running=16, eta=2, max_concurrent_rollouts=16, n_steps=6)
    for run in (sim.simulate_sync, sim.simulate_async):
        res = run(gen, train, _long_tail(), setup)
        peak = max(b for _, b in res.occupancy)
        assert peak == 2 * 16, run.__name__  # reached, never exceeded


def test_setup_names_a_bad_field():
    with pytest.raises(ValueError, match="Setup.eta=-1"):
        sim.Setup(eta=-1)


def test_measured_table_interpolates_in_b_and_is_linear_in_context():
    gen = sim.GenCost(step_s=0.0, table=((1, 1e-3, 1e-6), (9, 5e-3, 2e-6)))
    assert gen.step(5, 0) == pytest.approx(3e-3)
    assert gen.step(5, 100) - gen.step(5, 0) == pytest.approx(100 * 1.5e-6)
    assert gen.step(17, 0) == pytest.approx(9e-3)  # extrapolated from the last two rows


def test_predict_run_reads_profiles_by_thread_count(tmp_path):
    prof = {
        "threads": 1,
        "gen": {"step_s": 2e-3, "seq_s": 1e-5, "table": [[1, 2e-3, 0.0], [256, 5e-3, 1e-8]]},
        "train": {"step_s": 0.1, "token_s": 2e-4},
        "publish_s": 0.01,
        "load_s": 0.01,
    }
    path = tmp_path / "p1.json"
    path.write_text(json.dumps(prof))
    runs = tmp_path / "runs.json"
    row = {"task": "toy", "batch": 8, "group_size": 4, "steps": 5, "samples_per_s": 10.0}
    lengths = [3, 5, 40]
    runs.write_text(json.dumps({"runs": [
        {**row, "mode": "sync", "threads": 1, "lengths": lengths},
        {**row, "mode": "async", "eta": 1, "gen_threads": 1, "train_threads": 1,
         "lengths": lengths},
    ]}))  # fmt: skip
    out = sim.validate(str(runs), [str(path)])
    assert [r["mode"] for r in out["rows"]] == ["sync", "async"]
    assert all(math.isfinite(r["rel_err"]) for r in out["rows"])
    with pytest.raises(KeyError, match="--threads 2"):
        sim.predict_run({**row, "mode": "sync", "threads": 2}, {}, lengths)


def test_in_run_costs_come_from_the_other_runs_of_the_same_layout(tmp_path):
    base = {"task": "toy", "batch": 4, "group_size": 2, "steps": 4, "lengths": [5, 9]}
    a1 = {
        **base,
        "mode": "async",
        "eta": 1,
        "gen_threads": 1,
        "train_threads": 1,
        "decode_table": [[2, 0.01], [8, 0.02]],
        "train_s_per_token": 1e-3,
    }
    a4 = {**a1, "eta": 4, "decode_table": [[2, 0.03], [8, 0.04]], "train_s_per_token": 3e-3}
    sync = {**base, "mode": "sync", "threads": 2, "decode_table": [[4, 0.05]],
            "train_s_per_token": 2e-3}  # fmt: skip
    rows = [a1, a4, sync]
    costs, source = sim._in_run_costs(rows, 0)  # η=1 is predicted from η=4's costs
    assert source == "others/others"
    assert costs == {"decode_table": [[2, 0.03], [8, 0.04]], "train_s_per_token": 3e-3}
    # siblings with different bins: the mean of their interpolated costs at every b
    a0 = {**a1, "eta": 0, "decode_table": [[2, 0.01], [4, 0.03], [8, 0.05]]}
    costs, _ = sim._in_run_costs([a0, a1, a4], 0)
    assert costs["decode_table"] == [
        [2.0, pytest.approx(0.02)], [8.0, pytest.approx(0.03)]
    ]  # fmt: skip
    at4 = (0.03 + (0.03 + 0.01 / 3)) / 2  # a0's own row, a4 interpolated between 2 and 8
    assert sim._in_run_costs([a0, a1, a4], 1)[0]["decode_table"] == [
        [2.0, pytest.approx(0.02)], [4.0, pytest.approx(at4)], [8.0, pytest.approx(0.045)]
    ]  # fmt: skip
    assert sim._in_run_costs(rows, 0, others=False)[1] == "own/own"
    assert sim._in_run_costs(rows, 2) == (
        {"decode_table": [[4, 0.05]], "train_s_per_token": 2e-3},
        "own/own",
    )
    # the costs replace the profile's: an async run of fixed lengths trains at the cost given
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"threads": 1, "gen": {"step_s": 9.0}, "train": {"step_s": 9.0,
                    "token_s": 9.0}, "publish_s": 0.0, "load_s": 0.0}))  # fmt: skip
    res = sim.predict_run(
        {**a1, "eta": 0}, {1: sim.Profile.from_json(json.loads(prof.read_text()))}, [10],
        {"decode_table": [[1, 0.0], [8, 0.0]], "train_s_per_token": 1e-3},
    )  # fmt: skip
    # free generation: each step is the train step over 4 prompts x 2 answers x (8 + 10)
    assert res.samples_per_s == pytest.approx(4 / (8 * 18 * 1e-3), rel=1e-6)
    with pytest.raises(KeyError, match="--rows-out"):
        sim._in_run_costs([{**base, "mode": "sync", "threads": 2}], 0)
