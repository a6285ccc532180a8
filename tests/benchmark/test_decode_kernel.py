"""benchmark/decode_kernel.py runs, checks each kernel against SDPA before timing it, and
reports every case of every kernel (the timings themselves are a benchmark, not a test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from realhf.impl.kernels import simd_isas
from realhf.impl.model.gen import cache_attention as ca

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "decode_kernel.py")

pytestmark = [
    pytest.mark.slow,  # compiles a numba loop in a fresh process
    pytest.mark.skipif(not ca.numba_available(), reason="the read loop and a kernel need numba"),
]


@pytest.mark.parametrize("dtype,page", [("float32", 16), ("bfloat16", 32)])
def test_the_script_reports_every_case_of_a_kernel_that_matches_sdpa(dtype, page):
    args = ["--seqs", "8", "--positions", "40", "--rounds", "2", "--dtype", dtype]
    args += ["--page", str(page)]
    args += ["--q-heads", "14", "--kv-heads", "2"]  # the 0.5B shape's groups of 7
    r = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["dtype"] == dtype and out["heads"] == [14, 2, 64] and out["seqs"] == 8
    assert out["page"] == page
    impls = sorted([f"cpp/{isa}" for isa in simd_isas()] + ["numba"])
    assert sorted(out["impls"]) == impls
    for impl in impls:
        got = out["impls"][impl]
        assert got["max_abs_err_vs_sdpa"] < (2e-2 if dtype == "bfloat16" else 1e-4)
        for case in ("scattered", "contiguous", "resident"):
            f = got["ns_per_position_layer"][case]
            assert 0 < f["min"] <= f["median"]
        assert got["scattered_over_sum"] > 0
    assert (
        0 < out["read_ns_per_position_layer"]["min"] <= out["read_ns_per_position_layer"]["median"]
    )
    assert out["read_gb_per_s"] > 0
    assert ("numba_over_cpp" in out) == (len(impls) > 1)


def test_an_impl_that_cannot_run_is_refused_by_name():
    r = subprocess.run(
        [sys.executable, SCRIPT, "--impls", "flash"], capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 2 and "'flash' cannot run here" in r.stderr
