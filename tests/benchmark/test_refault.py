"""benchmark/refault.py: times to take memory back after a wait, and its argument checks."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "refault.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )


def test_times_each_page_kind_after_each_wait():
    r = _run("--gib", "0.01", "--waits", "0,0.05")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["seconds_to_touch"]) == {"4k", "huge"}
    for times in out["seconds_to_touch"].values():
        assert set(times) == {"0.0", "0.05"} and all(t > 0 for t in times.values())


def test_bad_arguments_are_refused_with_the_reason():
    r = _run("--waits", "1,soon")
    assert r.returncode == 2 and "--waits takes seconds" in r.stderr
    r = _run("--gib", "0")
    assert r.returncode == 2 and "--gib must be > 0" in r.stderr
