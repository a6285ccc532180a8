"""The SLURM launcher on a real two-node cluster (munged + slurmctld + 2 slurmd, one machine).

The smoke experiment completes with workers on both nodes; a cancelled worker job fails
the run with a JobFailure naming it and leaves nothing queued or running; bad input
(partition, sizes, missing sbatch, a queue that never frees up) fails before anything runs
or within slurm.start_timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from slurm_cluster import slurm_cluster  # noqa: F401  (fixture)

from realhf.api.core import system_api
from realhf.api.slurm_args import SlurmConfig
from realhf.base import name_resolve
from realhf.experiments import smoke as smoke_exp
from realhf.scheduler import launcher
from realhf.scheduler.local import JobFailure
from realhf.scheduler.slurm import SlurmError, launch_experiment
from realhf.system.worker.base import WorkerStatus, read_status

# ---- SlurmConfig checks (no cluster needed) ----------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(partition="a b"), "slurm.partition"),
        (dict(worker_cpus={"model_worker": 0}), "slurm.worker_cpus.model_worker"),
        (dict(worker_gpus={"model_worker": -1}), "slurm.worker_gpus.model_worker"),
        (dict(sbatch_args=["--partition=x"]), "use partition instead"),
        (dict(sbatch_args=["--time=1:00:00", ""]), "slurm.sbatch_args"),
        (dict(slurm_conf="/nonexistent/slurm.conf"), "slurm.slurm_conf"),
        (dict(start_timeout=0), "slurm.start_timeout"),
    ],
)
def test_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SlurmConfig(**kwargs)


def test_launcher_mode_slurm_is_this_module():
    assert launcher("slurm") is launch_experiment


# ---- the task wrapper, without SLURM ---------------------------------------------------

# Double-forks a sleeper that stays in the process group (and would escape scancel under
# proctrack/linuxproc once orphaned), writes its pid to argv[1], then exits with argv[2].
_LEAVES_ORPHAN = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:
        if os.fork() == 0:
            open(sys.argv[1], "w").write(str(os.getpid()))
            time.sleep(120)
        os._exit(0)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    time.sleep(float(sys.argv[3]))
    sys.exit(int(sys.argv[2]))
    """
)


def _dead(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _wrapper(tmp_path, exit_code: int, linger: float):
    env = dict(os.environ, SLURM_PROCID="1", SLURMD_NODENAME="nodeX", SLURM_JOB_ID="77")
    pid_file = tmp_path / "orphan_{index}.pid"
    cmd = [
        sys.executable,
        "-m",
        "realhf.scheduler.slurm_task",
        "task",
        "--state-dir",
        str(tmp_path),
    ]
    cmd += ["--type", "w", "--", sys.executable, "-c", _LEAVES_ORPHAN, str(pid_file)]
    cmd += [str(exit_code), str(linger)]
    return subprocess.Popen(cmd, env=env), tmp_path / "orphan_1.pid"


def _read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow
def test_task_wrapper_records_start_and_exit_and_kills_leftovers(tmp_path):
    wrapper, pid_file = _wrapper(tmp_path, exit_code=3, linger=0)
    assert wrapper.wait(timeout=30) == 3
    assert _read(tmp_path / "w_1.start")["node"] == "nodeX"
    assert _read(tmp_path / "w_1.start")["job_id"] == "77"
    assert _read(tmp_path / "w_1.exit") == {"returncode": 3, "signal": None, "node": "nodeX"}
    assert _dead(int(pid_file.read_text())), "the orphaned grandchild outlived the task"


@pytest.mark.slow
def test_task_wrapper_forwards_a_signal_it_alone_received(tmp_path):
    # SLURM signals every process of a step; this one reached only the wrapper.
    wrapper, pid_file = _wrapper(tmp_path, exit_code=0, linger=120)
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not (tmp_path / "w_1.start").exists():
        assert time.monotonic() < deadline and wrapper.poll() is None
        time.sleep(0.05)
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=30) == 128 + signal.SIGTERM
    assert _read(tmp_path / "w_1.exit") == {
        "returncode": -signal.SIGTERM,
        "signal": "SIGTERM",
        "node": "nodeX",
    }
    assert _dead(int(pid_file.read_text()))


# ---- on the cluster --------------------------------------------------------------------


def _realhf_processes(trial: str):
    """Processes of this trial on the machine (any parent: slurmstepd daemonizes)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "realhf." in cmd and f"--trial {trial}" in cmd:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append((p.pid, cmd))
            except psutil.NoSuchProcess:
                pass
    return out


def _assert_nothing_left(cluster, trial: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while (cluster.queue() or _realhf_processes(trial)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.queue() == []
    assert _realhf_processes(trial) == []


def _launch(cluster, tmp_path, trial, *, options=None, **exp_kwargs):
    run_dir = tmp_path / "smoke" / trial
    kwargs = dict(result_dir=str(run_dir / "results"), **exp_kwargs)
    exp = system_api.make_experiment("smoke", **kwargs)
    return run_dir, lambda: launch_experiment(
        exp,
        "smoke",
        trial,
        run_dir=str(run_dir),
        name_resolve_spec=f"file://{tmp_path / 'name_resolve'}",
        imports=[smoke_exp.__name__],
        timeout=90,
        fileroot=str(tmp_path),
        options=options or SlurmConfig(slurm_conf=cluster.conf),
    )


@pytest.mark.slurm
@pytest.mark.slow
def test_smoke_completes_on_both_nodes(slurm_cluster, tmp_path):  # noqa: F811
    run_dir, run = _launch(slurm_cluster, tmp_path, "ok")
    t0 = time.monotonic()
    codes = run()
    print(f"smoke over SLURM took {time.monotonic() - t0:.1f}s")
    assert codes == {
        "smoke_consumer/0": 0,
        "smoke_model/0": 0,
        "smoke_model/1": 0,
        "smoke_master/0": 0,
        "smoke_producer/0": 0,
        "controller/0": 0,
    }
    with open(run_dir / "placement.json") as f:
        placement = json.load(f)
    nodes = {w["node"] for w in placement["workers"].values()}
    assert nodes == {"node1", "node2"}, placement
    assert set(placement["jobs"]) == {
        "controller",
        "smoke_consumer",
        "smoke_model",
        "smoke_master",
        "smoke_producer",
    }
    assert all(j["job_id"].isdigit() for j in placement["jobs"].values())
    assert sorted(os.listdir(run_dir / "logs")) == sorted(
        f"{n.replace('/', '_')}.log" for n in codes
    )
    assert "completed" in (run_dir / "logs" / "controller_0.log").read_text()
    with open(run_dir / "controller_summary.json") as f:
        assert json.load(f)["ok"] is True
    _assert_nothing_left(slurm_cluster, "ok")


@pytest.mark.slurm
@pytest.mark.slow
def test_cancelled_worker_job_fails_the_run_and_nothing_is_left(slurm_cluster, tmp_path):  # noqa: F811
    trial = "cancel"
    run_dir, run = _launch(slurm_cluster, tmp_path, trial, n_rounds=100000, round_interval_s=0.02)
    outcome = {}

    def target():
        try:
            outcome["codes"] = run()
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    t = threading.Thread(target=target)
    t.start()
    name_resolve.reconfigure("file", root=str(tmp_path / "name_resolve"))
    try:
        deadline = time.monotonic() + 60
        while read_status("smoke", trial, "smoke_model/1") != WorkerStatus.RUNNING:
            assert time.monotonic() < deadline, "smoke_model/1 never reached RUNNING"
            assert t.is_alive(), outcome
            time.sleep(0.1)
    finally:
        name_resolve.reconfigure("memory")
    job = slurm_cluster.run("squeue", "-h", "-n", f"realhf:smoke:{trial}:smoke_model", "-o", "%i")
    slurm_cluster.run("scancel", job.strip())
    cancelled_at = time.monotonic()
    t.join(timeout=60)
    assert not t.is_alive()
    print(f"JobFailure raised {time.monotonic() - cancelled_at:.1f}s after scancel")
    err = outcome.get("error")
    assert isinstance(err, JobFailure), outcome
    names = {j.name for j in err.failed}
    assert {"controller/0", "smoke_model/0", "smoke_model/1"} <= names, str(err)
    assert "smoke_model/1 (exit code 143 on node" in str(err) and "after SIGTERM" in str(err)
    _assert_nothing_left(slurm_cluster, trial)
    with open(run_dir / "placement.json") as f:
        assert json.load(f)["jobs"]["smoke_model"]["state"] == "CANCELLED"


@pytest.mark.slurm
@pytest.mark.parametrize(
    "options, needle",
    [
        (
            dict(partition="nope"),
            r"slurm.partition='nope' does not exist; the cluster has \['debug'\]",
        ),
        (dict(nodelist="node9"), r"\['node9'\] are not nodes of partition 'debug'"),
        (dict(worker_cpus={"smoke_model": 5}), "no node can run one smoke_model process"),
        (dict(worker_gpus={"smoke_master": 1}), "no node can run one smoke_master process"),
        (dict(worker_cpus={"smoke_model": 4}), r"the experiment needs 12 CPUs"),
        (dict(worker_cpus={"trainer": 2}), r"slurm.worker_cpus names \['trainer'\]"),
        (
            dict(sbatch_args=["--time=never"]),
            r"failed \(exit code \d+\): sbatch: error: Invalid --time",
        ),
    ],
)
def test_bad_input_is_refused_and_nothing_is_queued(slurm_cluster, tmp_path, options, needle):  # noqa: F811
    _, run = _launch(
        slurm_cluster,
        tmp_path,
        "bad",
        options=SlurmConfig(slurm_conf=slurm_cluster.conf, **options),
    )
    with pytest.raises(SlurmError, match=needle):
        run()
    assert slurm_cluster.queue() == []


@pytest.mark.slurm
def test_missing_sbatch_is_named(slurm_cluster, tmp_path, monkeypatch):  # noqa: F811
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("squeue", "scancel", "scontrol"):  # everything but sbatch
        os.symlink(subprocess.check_output(["which", tool], text=True).strip(), bin_dir / tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    _, run = _launch(slurm_cluster, tmp_path, "nosbatch")
    with pytest.raises(SlurmError, match=r"\['sbatch'\] are not on PATH"):
        run()
    monkeypatch.undo()
    assert slurm_cluster.queue() == []


@pytest.mark.slurm
@pytest.mark.slow
def test_jobs_pending_past_start_timeout_are_cancelled(slurm_cluster, tmp_path):  # noqa: F811
    # Another user's job holds every CPU: the launch fits the cluster but cannot start.
    blocker = slurm_cluster.run(
        "sbatch", "--parsable", "-n", "8", "-o", "/dev/null", "--wrap", "sleep 120"
    ).strip()
    try:
        deadline = time.monotonic() + 10
        while slurm_cluster.run("squeue", "-h", "-j", blocker, "-o", "%T").strip() != "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        _, run = _launch(
            slurm_cluster,
            tmp_path,
            "pending",
            options=SlurmConfig(slurm_conf=slurm_cluster.conf, start_timeout=2, poll_interval=0.2),
        )
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"jobs still pending after 2s.*smoke_model"):
            run()
        assert time.monotonic() - t0 < 15
        assert [ln.split()[0] for ln in slurm_cluster.queue()] == [blocker]
    finally:
        slurm_cluster.run("scancel", blocker)
    _assert_nothing_left(slurm_cluster, "pending")


_LAUNCH_AND_WAIT = textwrap.dedent(
    """
    import sys
    from realhf.api.core import system_api
    from realhf.api.slurm_args import SlurmConfig
    from realhf.experiments import smoke
    from realhf.scheduler.slurm import launch_experiment

    run_dir, root, conf = sys.argv[1:4]
    kw = dict(result_dir=run_dir + "/results", n_rounds=100000, round_interval_s=0.02)
    try:
        launch_experiment(
            system_api.make_experiment("smoke", **kw), "smoke", "sigterm", run_dir=run_dir,
            name_resolve_spec="file://" + root + "/name_resolve",
            imports=[smoke.__name__], timeout=90, fileroot=root,
            options=SlurmConfig(slurm_conf=conf),
        )
    except KeyboardInterrupt as e:
        print("interrupted:", e)
        sys.exit(130)
    """
)


@pytest.mark.slurm
@pytest.mark.slow
def test_sigterm_to_the_launcher_cancels_everything(slurm_cluster, tmp_path):  # noqa: F811
    run_dir = tmp_path / "smoke" / "sigterm"
    launcher_proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH_AND_WAIT, str(run_dir), str(tmp_path), slurm_cluster.conf],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "placement.json").exists():
            assert time.monotonic() < deadline and launcher_proc.poll() is None
            time.sleep(0.1)
        launcher_proc.send_signal(signal.SIGTERM)
        out, _ = launcher_proc.communicate(timeout=60)
    finally:
        launcher_proc.kill()
    assert launcher_proc.returncode == 130, out
    assert "interrupted: received SIGTERM" in out
    _assert_nothing_left(slurm_cluster, "sigterm")
