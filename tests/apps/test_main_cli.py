"""``python -m realhf.apps.main status|stop``: see and stop a run from another shell."""

import json
import os

import pytest
import quickstart_runs as qs

pytestmark = pytest.mark.slow


def _main(*args, fileroot):
    return qs.run_module("realhf.apps.main", [*args, "--fileroot", str(fileroot)], 120)


def test_status_then_stop_ends_the_run_without_recovery(tmp_path, no_leftover_processes):
    args = [
        "train_batch_size=4",
        "ppo.group_size=2",
        "ppo.gen.max_new_tokens=4",
        "exp_ctrl.benchmark_steps=100000",
        "eval=false",
        "recover_mode=auto",  # a stop is not a failure: no relaunch
    ]
    run = qs.start("ppo-math", args, tmp_path)
    with qs.killed_on_error(run):
        qs.wait_for_steps(run, tmp_path / "ppo-math" / "t", 2, timeout=120)
        st = _main("status", "ppo-math", "t", fileroot=tmp_path)
        assert st.returncode == 0, st.stderr
        assert "experiment 'ppo-math' trial 't': RUNNING" in st.stdout
        for w in ("controller/0", "master_worker/0", "model_worker/0"):
            assert w in st.stdout and "RUNNING" in st.stdout.split(w)[1].splitlines()[0]
        assert "last step" in st.stdout

        sp = _main("stop", "ppo-math", "t", fileroot=tmp_path)
        assert sp.returncode == 0, sp.stdout + sp.stderr
        assert "'t': STOPPED" in sp.stdout
    out = qs.finish(run, timeout=120, code=3)
    assert "stopped on request" in out and "attempt 2/2" not in out
    st = _main("status", "ppo-math", "t", fileroot=tmp_path)
    assert "trial 't': STOPPED" in st.stdout
    with open(tmp_path / "ppo-math" / "t" / "controller_summary.json") as f:
        assert json.load(f)["stopped"] is True
    # A run that is not running cannot be stopped; an unknown one has no status.
    assert _main("stop", "ppo-math", "t", fileroot=tmp_path).returncode == 1
    unknown = _main("status", "ppo-math", "nope", fileroot=tmp_path)
    assert unknown.returncode == 1 and "no run 'ppo-math' trial 'nope'" in unknown.stderr
    assert os.path.isdir(tmp_path / "ppo-math" / "t" / "logs")
