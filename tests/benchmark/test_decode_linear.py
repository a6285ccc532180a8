"""benchmark/decode_linear.py: GB/s of each product per row count, and its argument checks."""

import json
import subprocess
import sys
from pathlib import Path

from realhf.impl.kernels import simd_cpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmark" / "decode_linear.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_times_every_product_at_every_row_count():
    r = _run("--mb", "4", "--rows", "1,16", "--rounds", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["rows"]) == {"1", "16"} and out["read_gbs"] > 0
    assert out["host"]["cores"] >= 1 and "torch" in out["host"]
    for rec in out["rows"].values():
        assert rec["F.linear"] > 0
        assert ("kernel" in rec) == (simd_cpu() is not None)
        if "kernel" in rec and "onednn" in rec:
            assert rec["kernel_over_onednn"] == rec["kernel"] / rec["onednn"]


def test_bad_arguments_are_refused_with_the_reason():
    r = _run("--rows", "16,many")
    assert r.returncode == 2 and "--rows takes whole numbers" in r.stderr
    r = _run("--rows", "0")
    assert r.returncode == 2 and "--rows must be >= 1" in r.stderr
