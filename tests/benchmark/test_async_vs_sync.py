"""benchmark/async_vs_sync.py: the occupancy and trainer-idle figures from a run's files."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "async_vs_sync.py")
_spec = importlib.util.spec_from_file_location("benchmark_async_vs_sync", _PATH)
avs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = avs
_spec.loader.exec_module(avs)


def test_occupancy_is_time_weighted_and_counts_idle_gaps_as_empty(tmp_path):
    # One engine of 4 slots, steps of 0.1 s: three at 4 running, two at 2, an idle gap of
    # 3 s (the next row counts as one median step), two at 1.
    t = [100.0, 100.1, 100.2, 100.3, 100.4, 100.5, 103.5, 103.6]
    r = [4, 4, 4, 4, 2, 2, 1, 1]
    (tmp_path / "occupancy-1.tsv").write_text("".join(f"{a}\t{b}\t4\n" for a, b in zip(t, r)))
    occ = avs.occupancy(str(tmp_path), 100.0, 104.0, buckets=2)
    # busy: 100.1-100.5 (0.3 s full, 0.2 s half) and two steps at a quarter
    assert occ["mean"] == pytest.approx((0.3 + 0.1 + 0.05) / 0.7)
    assert occ["busy_share"] == pytest.approx(0.7 / 4.0)
    assert occ["series"] == [pytest.approx(0.4 / 0.5), pytest.approx(0.25)]


def test_trainer_idle_share_from_the_trace(tmp_path):
    ev = [
        {"name": "step 1", "ph": "X", "ts": 0, "dur": 4_000_000},
        {"name": "actor_train", "ph": "X", "ts": 1_000_000, "dur": 3_000_000},
        {"name": "step 2", "ph": "X", "ts": 4_000_000, "dur": 6_000_000},
        {"name": "actor_train", "ph": "X", "ts": 5_000_000, "dur": 2_000_000},
    ]
    # the master appends events and leaves the array open while a run goes
    (tmp_path / "trace.json").write_text("[" + ",\n".join(map(json.dumps, ev)) + ",\n")
    assert avs.trainer_idle_share(str(tmp_path)) == pytest.approx(1 - 5 / 10)


def test_decode_table_is_the_median_step_per_running_bin_without_idle_gaps(tmp_path):
    # 10 steps of 0.01 s at 2 running, an idle gap of 5 s, 10 steps of 0.04 s at 200
    # running (one of them slow: the median ignores it); fewer than 5 steps make no row.
    t, r, now = [], [], 50.0
    for dt, run in (
        [(0.01, 2)] * 10 + [(5.0, 2)] + [(0.04, 200)] * 9 + [(0.4, 200)] + [(0.02, 30)] * 3
    ):
        now += dt
        t.append(now)
        r.append(run)
    (tmp_path / "occupancy-7.tsv").write_text("".join(f"{a:.4f}\t{b}\t256\n" for a, b in zip(t, r)))
    table = avs.decode_table(str(tmp_path), 0.0, 1e9)
    assert [b for b, _ in table] == [2, 200]
    assert table[0][1] == pytest.approx(0.01, abs=2e-4)
    assert table[1][1] == pytest.approx(0.04, abs=2e-4)


def test_train_s_per_token_leaves_out_the_warm_up_step():
    rows = [
        {"tokens": 100, "timing/actor_train": 9.0},  # warm-up
        {"tokens": 1000, "timing/actor_train": 0.5},
        {"tokens": 3000, "timing/actor_train": 1.5},
    ]
    assert avs.train_s_per_token(rows) == pytest.approx(2.0 / 4000)
