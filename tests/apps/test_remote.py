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
