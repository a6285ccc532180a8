"""The Ray launcher on a two-node Ray cluster (two raylets on 127.0.0.1): the smoke
experiment completes across both nodes, a killed worker actor is reported and
everything stops, and an unreachable cluster fails fast."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest
import ray_cluster

from realhf.api.core import system_api
from realhf.api.ray_args import RayConfig
from realhf.base import name_resolve, names
from realhf.base.net import network
from realhf.experiments import smoke as smoke_exp
from realhf.scheduler.local import JobFailure
from realhf.system.worker.base import WorkerStatus, read_status

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(not ray_cluster.ray_importable(), reason="ray is not installed"),
]


@pytest.fixture(scope="module")
def cluster():
    c = ray_cluster.start_ray_cluster(n_nodes=2, cpus_per_node=2)
    with c.client_env():
        yield c
    c.stop()


def _options(cluster, **kw):
    # 6 processes x 0.5 CPU = 3 CPUs: more than one 2-CPU node holds.
    return RayConfig(**{"address": cluster.address, "cpus_per_worker": 0.5, **kw})


def _remote_procs(trial):
    """Live realhf.apps.remote processes of ``trial``, on any node of this machine."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            if "realhf.apps.remote" in cmd and trial in cmd and p.status() != "zombie":
                out.append((p.pid, cmd))
        except psutil.NoSuchProcess:
            pass
    return out


def _assert_nothing_left(trial, timeout=15.0):
    deadline = time.monotonic() + timeout
    while _remote_procs(trial) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _remote_procs(trial) == []


def _launch(tmp_path, trial, options, spec, **exp_kwargs):
    """Start the smoke experiment through the Ray launcher from a thread."""
    from realhf.scheduler.ray import launch_experiment

    run_dir = tmp_path / "smoke" / trial
    kwargs = dict(result_dir=str(run_dir / "results"), **exp_kwargs)
    exp = system_api.make_experiment("smoke", **kwargs)
    outcome = {}

    def target():
        try:
            outcome["codes"] = launch_experiment(
                exp,
                "smoke",
                trial,
                run_dir=str(run_dir),
                name_resolve_spec=spec,
                imports=[smoke_exp.__name__],
                timeout=90,
                fileroot=str(tmp_path),
                options=options,
            )
        except BaseException as e:  # handed to the test thread
            outcome["error"] = e

    t = threading.Thread(target=target)
    t.start()
    return t, outcome, run_dir


def test_empty_address_runs_on_a_local_cluster_and_leaves_nothing(tmp_path, no_leftover_processes):
    import ray

    # Runs before the tests that join the two-node cluster (a token of its own) from this
    # same process: the local cluster's token must not leak into them.
    auth_env = {k: os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    home_ray = os.path.exists(os.path.expanduser("~/.ray"))
    temp_dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "realhf-ray-*")))
    t, outcome, run_dir = _launch(tmp_path, "local", RayConfig(), "ray")
    t.join(timeout=120)
    assert not t.is_alive()
    assert "error" not in outcome, outcome["error"]
    assert set(outcome["codes"].values()) == {0}
    placement = json.loads((run_dir / "placement.json").read_text())
    assert len(placement["nodes"]) == 1 and len(placement["workers"]) == 6
    assert not ray.is_initialized()
    assert {k: os.environ.get(k) for k in auth_env} == auth_env
    assert os.path.exists(os.path.expanduser("~/.ray")) == home_ray
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "ray"))
    # The run dir of pytest is too deep for Ray's socket paths: a temp dir was used
    # and removed.
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "realhf-ray-*"))) == temp_dirs
    _assert_nothing_left("local")
    no_leftover_processes()


_LIST_NODES = (
    "import sys; from ray._raylet import GcsClient; "
    "print(len(GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)))"
)


@pytest.mark.parametrize(
    "auth", ["no token", "a wrong token", "auth disabled", "the cluster's token"]
)
def test_the_test_cluster_serves_only_a_client_with_its_token(cluster, auth):
    # Ray resolves --node-ip-address 127.0.0.1 to the machine's address, so the GCS
    # listens on every interface: a client without the token must get nothing.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(
        {
            "no token": {},
            "a wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
            "auth disabled": {"RAY_AUTH_MODE": "disabled"},
            "the cluster's token": cluster.auth_env(),
        }[auth]
    )
    r = subprocess.run(
        [sys.executable, "-c", _LIST_NODES, cluster.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if auth == "the cluster's token":
        assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr[-2000:]
    else:
        assert r.returncode != 0 and r.stdout == ""
        assert "AuthenticationError" in r.stderr and "token is missing or incorrect" in r.stderr


def test_smoke_runs_on_both_nodes_with_ray_name_resolve(tmp_path, cluster, no_leftover_processes):
    import ray

    t0 = time.monotonic()
    # name_resolve "ray": the workers find each other through the cluster's GCS.
    t, outcome, run_dir = _launch(tmp_path, "ok", _options(cluster), "ray")
    t.join(timeout=120)
    assert not t.is_alive()
    assert "error" not in outcome, outcome["error"]
    elapsed = time.monotonic() - t0
    codes = outcome["codes"]
    assert set(codes) == {"controller/0"} | {
        f"{w}/{i}" for w, n in [("smoke_model", 2), ("smoke_master", 1)] for i in range(n)
    } | {"smoke_producer/0", "smoke_consumer/0"}
    assert set(codes.values()) == {0}
    summary = json.loads((run_dir / "controller_summary.json").read_text())
    assert summary["ok"] is True
    placement = json.loads((run_dir / "placement.json").read_text())
    assert set(placement["workers"]) == set(codes)
    nodes = {placement["workers"][w]["node_id"] for w in codes}
    tags = {r for n in nodes for r in placement["nodes"][n]["resources"] if r in ("node1", "node2")}
    assert tags == {"node1", "node2"}, placement
    assert (run_dir / "logs" / "smoke_model_1.log").exists()
    # The launcher disconnected; every actor it made is dead, every process gone.
    assert not ray.is_initialized()
    _assert_nothing_left("ok")
    repo = name_resolve.from_spec(f"ray://{cluster.address}")
    try:
        assert repo.get(names.experiment_status("smoke", "ok")) == "COMPLETE"
        repo.clear_subtree(names.trial_root("smoke", "ok"))
    finally:
        repo.close()
    print(f"smoke on Ray finished in {elapsed:.1f}s")
    no_leftover_processes()


@pytest.mark.parametrize("victim_kind", ["actor", "process"])
def test_killed_worker_fails_the_run_and_everything_stops(
    tmp_path, cluster, no_leftover_processes, victim_kind
):
    """``ray.kill`` of a worker's actor, or SIGKILL of its process."""
    import ray

    trial = f"kill_{victim_kind}"
    name_resolve.reconfigure("file", root=str(tmp_path / "name_resolve"))
    # Connected by the test (the launcher then uses this connection), to kill an actor.
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        t, outcome, run_dir = _launch(
            tmp_path,
            trial,
            _options(cluster),
            f"file://{tmp_path / 'name_resolve'}",
            n_rounds=100000,
            round_interval_s=0.02,
        )
        deadline = time.monotonic() + 60
        while read_status("smoke", trial, "smoke_model/1") != WorkerStatus.RUNNING:
            assert time.monotonic() < deadline, "smoke_model/1 never reached RUNNING"
            assert t.is_alive(), outcome
            time.sleep(0.1)
        victim = json.loads((run_dir / "placement.json").read_text())["workers"]["smoke_model/1"]
        if victim_kind == "actor":
            ray.kill(ray.get_actor(f"smoke/{trial}/smoke_model/1", namespace="realhf"))
        else:
            os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        t.join(timeout=90)
        assert not t.is_alive()
        stopped_after = time.monotonic() - killed_at
        leftover_actors = [n for n in ray.util.list_named_actors(all_namespaces=True)]
    finally:
        ray.shutdown()
        name_resolve.reconfigure("memory")
    err = outcome["error"]
    assert isinstance(err, JobFailure), err
    assert {j.name for j in err.failed} >= {"controller/0", "smoke_model/1"}
    if victim_kind == "actor":
        assert "smoke_model/1 (Ray actor lost" in str(err) and "ray.kill" in str(err)
    else:
        assert "smoke_model/1 (killed by SIGKILL)" in str(err)
    summary = json.loads((run_dir / "controller_summary.json").read_text())
    assert summary["ok"] is False and "smoke_model/1" in summary["failures"]
    assert leftover_actors == []
    assert not psutil.pid_exists(victim["pid"]) or (
        psutil.Process(victim["pid"]).status() == psutil.STATUS_ZOMBIE
    )
    _assert_nothing_left(trial)
    print(f"run stopped {stopped_after:.1f}s after the kill ({victim_kind})")
    no_leftover_processes()


def test_unreachable_address_fails_fast_naming_it(tmp_path, no_leftover_processes):
    import ray

    from realhf.scheduler.ray import RayClusterError, launch_experiment

    (port,) = network.find_multiple_free_ports(1)  # nothing listens there
    exp = system_api.make_experiment("smoke", result_dir=str(tmp_path / "r"))
    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=f"127.0.0.1:{port}"):
        launch_experiment(
            exp,
            "smoke",
            "unreachable",
            run_dir=str(tmp_path / "run"),
            name_resolve_spec=f"file://{tmp_path / 'nr'}",
            imports=[smoke_exp.__name__],
            options=RayConfig(address=f"127.0.0.1:{port}", connect_timeout_s=2),
        )
    assert time.monotonic() - t0 < 5
    assert not ray.is_initialized()
    assert not (tmp_path / "run" / "logs").exists()
    no_leftover_processes()


def _launch_expecting(tmp_path, cluster, exp, options, needle, within):
    import ray

    from realhf.scheduler.ray import RayClusterError, launch_experiment

    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=needle):
        launch_experiment(
            exp,
            "smoke",
            "unplaceable",
            run_dir=str(tmp_path / "run"),
            name_resolve_spec=f"file://{tmp_path / 'nr'}",
            imports=[smoke_exp.__name__],
            options=options,
        )
    assert time.monotonic() - t0 < within
    assert not ray.is_initialized()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        assert ray.util.list_named_actors(all_namespaces=True) == []
        groups = list(ray.util.placement_group_table().values())
        assert all(pg["state"] == "REMOVED" for pg in groups), groups
    finally:
        ray.shutdown()


def test_unplaceable_workers_fail_within_the_startup_timeout(
    tmp_path, cluster, no_leftover_processes
):
    # Enough CPUs in all, but no two nodes for three model workers that must spread.
    exp = system_api.make_experiment("smoke", result_dir=str(tmp_path / "r"), n_model_workers=3)
    options = _options(cluster, startup_timeout_s=2, placement_strategy="STRICT_SPREAD")
    _launch_expecting(tmp_path, cluster, exp, options, "could not place 3 x {'CPU': 0.5}", 10)
    no_leftover_processes()


@pytest.mark.parametrize("what", ["cpu", "gpu"])
def test_more_than_the_cluster_has_fails_at_once(tmp_path, cluster, no_leftover_processes, what):
    from realhf.api.core.system_api import Scheduling

    exp = system_api.make_experiment("smoke", result_dir=str(tmp_path / "r"))
    if what == "gpu":
        exp.scheduling = {"smoke_model": Scheduling(gpu=1)}
        options, needle = _options(cluster), r"asks Ray for .*2 GPU \(the cluster has 0\)"
    else:
        options, needle = _options(cluster, cpus_per_worker=3), r"18 CPU \(the cluster has 4\)"
    _launch_expecting(tmp_path, cluster, exp, options, needle, 5)
    no_leftover_processes()
