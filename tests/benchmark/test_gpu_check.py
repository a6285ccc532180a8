"""benchmark/gpu_check.py: how a stage that fails, times out, waits on a failed one or finds
the budget spent is recorded while the rest still run, and the whole check on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
_spec = importlib.util.spec_from_file_location(
    "benchmark_gpu_check", os.path.join(ROOT, "benchmark", "gpu_check.py")
)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_check
_spec.loader.exec_module(gpu_check)


def _run(tmp_path, monkeypatch, stages, budget):
    monkeypatch.setattr(gpu_check, "plan", lambda args, host: stages)
    monkeypatch.setattr(gpu_check, "PROBE", 'print(\'{"python": "3.x"}\')')  # no torch import
    args = SimpleNamespace(
        cpu=True, out=str(tmp_path), budget=budget, workdir=str(tmp_path), site="", wheels=""
    )
    return gpu_check.run_all(args)


def test_failures_and_time_outs_are_recorded_and_the_other_stages_still_run(tmp_path, monkeypatch):
    py = sys.executable
    sleeper = "import time; print('started', flush=True); time.sleep(60)"
    figures = gpu_check.judge_json(lambda r: gpu_check.Outcome("ok", "", f"x is {r['x']}", r))
    stages = [
        gpu_check.Stage("slow", [py, "-c", sleeper], 1, gpu_check.judge_rc),
        gpu_check.Stage(
            "broken", [py, "-c", "raise SystemExit('boom: no such file')"], 30, gpu_check.judge_rc
        ),
        gpu_check.Stage(
            "after_broken", [py, "-c", "pass"], 30, gpu_check.judge_rc, needs=("broken",)
        ),
        gpu_check.Stage("figures", [py, "-c", "print('x'); print('{\"x\": 1}')"], 30, figures),
        gpu_check.Stage(
            "elsewhere", [py, "-c", "raise SystemExit(1)"], 30, gpu_check.judge_rc, skip="no GPU"
        ),
        gpu_check.Stage("odd_output", [py, "-c", "print('{}')"], 30, figures),
    ]
    t0 = time.monotonic()
    report = _run(tmp_path, monkeypatch, stages, budget=120)
    assert time.monotonic() - t0 < 30  # the sleeper was stopped, not waited for

    by = {s["name"]: s for s in report["stages"]}
    assert list(by) == ["slow", "broken", "after_broken", "figures", "elsewhere", "odd_output"]
    assert by["slow"]["status"] == "failed"
    assert by["slow"]["reason"] == "timed out after 1 s: started"
    assert by["broken"]["status"] == "failed"
    assert by["broken"]["reason"] == "exit code 1: boom: no such file"
    assert by["after_broken"]["status"] == "skipped"
    assert by["after_broken"]["reason"] == "needs broken, which failed"
    assert (by["figures"]["status"], by["figures"]["headline"]) == ("ok", "x is 1")
    assert by["figures"]["figures"] == {"x": 1}
    assert (by["elsewhere"]["status"], by["elsewhere"]["reason"]) == ("skipped", "no GPU")
    assert by["odd_output"]["status"] == "failed"
    assert by["odd_output"]["reason"] == "unreadable output: KeyError: 'x'"
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["stages"] == report["stages"] and on_disk["host"] == {"python": "3.x"}
    log = (tmp_path / "log.txt").read_text()
    assert "boom: no such file" in log and "===== figures" in log


def test_stages_past_the_budget_are_skipped_saying_so(tmp_path, monkeypatch):
    stages = [gpu_check.Stage("late", [sys.executable, "-c", "pass"], 30, gpu_check.judge_rc)]
    report = _run(tmp_path, monkeypatch, stages, budget=5)
    assert report["stages"][0]["status"] == "skipped"
    assert report["stages"][0]["reason"] == "the check's 5 s are spent"


def test_pytest_outcomes_on_the_gpu_allow_no_skipped_test():
    skip = "SKIPPED [1] tests/impl/test_kernels.py:9: realhf._C not built"
    out = f"..s\n{skip}\n2 passed, 1 skipped in 1.0s\n"
    assert gpu_check.judge_pytest(strict=False)(out, 0).status == "ok"
    strict = gpu_check.judge_pytest(strict=True)(out, 0)
    assert strict.status == "failed" and "realhf._C not built" in strict.reason
    none = gpu_check.judge_pytest(strict=False)(out.replace("2 passed, ", ""), 0)
    assert none.status == "skipped" and "realhf._C not built" in none.reason
    assert (
        gpu_check.judge_pytest(strict=False)("1 failed, 2 passed in 1.0s\n", 1).status == "failed"
    )


@pytest.mark.slow  # every CPU stage for real: the runs of ppo-math and async-ppo-math
@pytest.mark.timeout(420)
def test_the_cpu_check_passes_and_reports_every_stage(tmp_path, no_leftover_processes):
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "benchmark", "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "cpu" and report["host"]["torch"] and report["host"]["cuda"] is False
    assert 0 < report["elapsed_s"] <= report["budget_s"] == 280 and wall < 300

    by = {s["name"]: s for s in report["stages"]}
    ran = {"deps", "kernel_tests", "engine_tiny", "sync_tiny", "async_tiny", "long_tail"}
    cuda_or_big = {"cuda_kernels_build", "make_0.5b", "engine_0.5b", "sync_0.5b"}
    assert set(by) == ran | cuda_or_big | {"gpu_tests"}
    for name, s in by.items():
        assert s["status"] in ("ok", "skipped"), (name, s["reason"])
        assert s["command"] and s["seconds"] >= 0 and s["timeout_s"] > 0
        assert (s["status"] == "skipped") == bool(s["reason"]), name
    assert all(by[n]["status"] == "ok" for n in ran), {n: by[n]["reason"] for n in ran}
    assert all(by[n]["reason"].startswith("--cpu: ") for n in cuda_or_big)
    assert by["gpu_tests"]["status"] == "skipped" and "CUDA" in by["gpu_tests"]["reason"]

    deps = by["deps"]["figures"]
    assert deps["missing"] == [] and deps["import_errors"] == {} and deps["modules"] > 100
    engine = by["engine_tiny"]["figures"]
    assert engine["device"] == "cpu" and engine["greedy_equal_to_hf"] is True
    assert set(engine["tokens_per_s"]) == {"16", "64", "256"}
    assert all(100 < v < 1e7 for v in engine["tokens_per_s"].values())
    for name, part in (("sync_tiny", "generation"), ("async_tiny", "training")):
        run = by[name]["figures"]
        assert run["shape"] == "tiny" and run["dtype"] == "float32"
        assert 0 < run["step_s"] < run["wall_s"] < 120 and run["split_s"][part] > 0
    assert by["sync_tiny"]["figures"]["split_s"]["training"] > 0
    assert 0.01 < by["long_tail"]["figures"]["async_over_sync"] < 100
    log = (tmp_path / "log.txt").read_text()
    assert all(f"===== {name}" in log for name in ran) and "gpu_check --cpu" in log
    assert "torch==" in (tmp_path / "pip_freeze.txt").read_text()
