"""The algorithms benchmark's table (the runs themselves are the benchmark's job)."""

from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "algorithms.py")
_spec = importlib.util.spec_from_file_location("benchmark_algorithms", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _run(algo, seed, start, final, wall=100.0, status="finished"):
    return dict(algo=algo, seed=seed, status=status, start=start, final=final, wall_s=wall)


def test_table_reports_mean_spread_gain_collapse_and_failures():
    runs = [
        _run("", 1, 0.30, 0.40, 90),
        _run("", 2, 0.32, 0.46, 110),
        _run("dapo", 1, 0.30, 0.28),  # fell below its start
        {"algo": "dapo", "seed": 2, "status": "failed", "exit": 1, "tail": "boom"},
        {"algo": "gspo", "seed": 1, "status": "failed", "exit": 1, "tail": "boom"},
    ]
    rows = bench.table(runs).splitlines()
    assert rows[2] == "| (default) | 2 | 31.0 ± 1.0 | 43.0 ± 3.0 | 12.0 ± 2.0 | 100 | 0 | 0 |"
    assert rows[3] == "| dapo | 1 | 30.0 | 28.0 | -2.0 | 100 | 1 | 1 |"
    assert rows[4] == "| gspo | 1 | | | | | | 1 |"
