"""benchmark/weight_sync.py end to end on the tiny model: every mode reaches a real server,
which then answers with the trainer's weights (the script checks), and the JSON line holds
the ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "weight_sync.py")


@pytest.mark.slow  # a real server process and nine updates
def test_the_script_updates_a_real_server_every_way_and_reports_the_ratios(tmp_path):
    before = set(os.listdir("/dev/shm"))
    out = subprocess.run(
        [sys.executable, SCRIPT, "--shapes=tiny", "--servers=1", "--repeats=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    tiny = result["shapes"]["tiny"]
    modes = ["disk", "shm", "broadcast"]
    assert set(tiny["seconds"]) == set(modes) and min(tiny["seconds"].values()) > 0
    assert tiny["shm_over_disk"] > 0 and tiny["shm_over_memcpy"] > 0
    assert tiny["broadcast_over_disk"] > 0
    assert result["host"]["cores"] >= 1 and [r["mode"] for r in result["rows"]] == modes
    # two warm-up updates per mode, reported apart from the three the median is over
    assert all(len(r["first_seconds"]) == 2 and len(r["all_seconds"]) == 3 for r in result["rows"])
    # its shared-memory versions are gone
    assert not [d for d in set(os.listdir("/dev/shm")) - before if d.startswith("realhf-bench-")]
