"""realhf.apps.remote: bad command lines fail fast with a message naming the problem."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _remote(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "realhf.apps.remote", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "REALHF_FILEROOT": str(tmp_path), "HOME": str(tmp_path)},
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["worker", "--type", "nope", "--index", "0", "-e", "x", "-f", "y"],
            "Unknown worker type 'nope'",
        ),
        (
            ["worker", "--type", "smoke_model", "--index", "-1", "-e", "x", "-f", "y"],
            "--index must be >= 0",
        ),
        (["controller", "-e", "x", "-f", "y"], "--experiment-config PATH is required"),
        (
            ["controller", "-e", "x", "-f", "y", "--experiment-config", "/no/such.pkl"],
            "cannot load --experiment-config /no/such.pkl",
        ),
        (
            ["controller", "-e", "bad/name", "-f", "y"],
            "experiment name 'bad/name' may not contain '/'",
        ),
        (
            ["controller", "-e", "x", "-f", "y", "--name-resolve", "zookeeper://h"],
            "name resolution is unusable",
        ),
        (
            [
                "worker",
                "--type",
                "t",
                "--index",
                "0",
                "-e",
                "x",
                "-f",
                "y",
                "--import",
                "no.such.mod",
            ],
            "--import no.such.mod: No module named 'no'",
        ),
    ],
)
def test_bad_command_lines(tmp_path, args, message):
    out = _remote(tmp_path, *args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_missing_required_arguments_print_usage(tmp_path):
    out = _remote(tmp_path, "worker", "--type", "t")
    assert out.returncode == 2
    assert (
        "the following arguments are required: --experiment/-e, --trial/-f, --index/-i"
        in out.stderr
    )


def test_an_experiment_config_that_is_not_one_is_refused(tmp_path):
    path = tmp_path / "experiment.pkl"
    path.write_bytes(pickle.dumps({"cfg": "the old keyword arguments"}))
    out = _remote(tmp_path, "controller", "-e", "x", "-f", "y", "--experiment-config", str(path))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert f"--experiment-config {path} holds a dict, not an ExperimentConfig" in out.stderr


_KEEP = r"""
import sys
from realhf.apps.remote import keep_worker_memory
from realhf.impl import tensor_pool
print(keep_worker_memory(sys.argv[1]), bool(tensor_pool.stats()))
"""


@pytest.mark.parametrize(
    "worker_type,env,out",
    [
        ("model_worker", {}, "True True"),
        ("generation_server", {}, "True True"),
        ("master_worker", {}, "False False"),  # holds no tensors: torch's allocator
        ("model_worker", {"REALHF_TENSOR_POOL": "0"}, "False False"),
    ],
)
def test_tensor_workers_keep_their_memory_in_the_tensor_pool(worker_type, env, out):
    """Model workers and generation servers serve large tensors from realhf's pool (in a
    process of its own: the pool lasts for the process), unless REALHF_TENSOR_POOL=0."""
    from realhf.impl import tensor_pool

    if tensor_pool._C is None or not hasattr(tensor_pool._C, "tensor_pool_install"):
        pytest.skip("realhf._C is not built (pip install --no-build-isolation -e .)")
    import os

    r = subprocess.run(
        [sys.executable, "-c", _KEEP, worker_type],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-2] == out


def test_a_bad_tensor_pool_setting_stops_the_worker_with_the_reason():
    import os

    r = subprocess.run(
        [sys.executable, "-c", _KEEP, "model_worker"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REALHF_TENSOR_POOL": "sometimes"},
    )
    assert r.returncode != 0
    assert "REALHF_TENSOR_POOL='sometimes'" in r.stderr and "use 1" in r.stderr, r.stderr
