"""Weights & Biases tracking: the ``wandb.*`` options, :class:`WandbLog` offline, and a
quickstart run with ``wandb.mode=offline`` (no network is needed or used)."""

from __future__ import annotations

import glob
import json
import os
import struct
import sys

import pytest
import quickstart_runs

from realhf.api.cli_args import BaseExperimentConfig
from realhf.api.cli_parser import parse_config
from realhf.api.wandb_args import WandbConfig
from realhf.system.dag.outputs import WandbLog, wandb_run_id

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks
_FULL, _LAST = 1, 4


def _records(path):
    """The protobuf records of a ``run-*.wandb`` file, in order.

    Layout: a 7-byte header (``:W&B``, magic, version), then chunks of
    ``crc32 (4) | length (2, LE) | type (1) | payload``; a record is one FULL chunk or
    FIRST, MIDDLE..., LAST; a block's tail shorter than a chunk header is padding.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:
            pos += _BLOCK - pos % _BLOCK
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _history(path):
    """Each logged row of ``path`` as {key: value}, W&B's own ``_*`` keys left out."""
    rows = []
    for rec in _records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def _run_file(run_dir):
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def test_config_checks_mode_project_and_tags():
    with pytest.raises(ValueError, match=r"wandb.mode='foo'; use one of \('disabled'"):
        WandbConfig(mode="foo")
    with pytest.raises(ValueError, match="wandb.project='a/b'"):
        WandbConfig(project="a/b")
    with pytest.raises(ValueError, match="wandb.tags"):
        WandbConfig(tags=["ok", " "])
    cfg = parse_config(BaseExperimentConfig, ["wandb.mode=offline", "wandb.tags=[x,y]"])
    assert cfg.wandb == WandbConfig(mode="offline", tags=["x", "y"])
    assert BaseExperimentConfig().wandb.mode == "disabled"


def test_run_id_is_stable_and_valid():
    assert wandb_run_id("ppo-math", "run0") == "ppo-math_run0"
    assert wandb_run_id("my exp", "t:1") == "my-exp_t-1"
    long = wandb_run_id("e" * 80, "a")
    assert len(long) == 64 and long != wandb_run_id("e" * 80, "b")


@pytest.mark.slow  # wandb's offline mode starts its service process (~9 s)
def test_offline_log_writes_every_finite_number_at_its_step(tmp_path):
    cfg = WandbConfig(mode="offline", tags=["unit"], notes="n")
    log = WandbLog(cfg, str(tmp_path), "exp", "trial", {"seed": 3, "ppo": {"eps": 0.2}})
    assert log.run.id == "exp_trial"
    for step in (1, 2):
        log.write(step, {"step": step, "loss": 1.0 / step, "nan": float("nan"), "s": "x"})
    log.close(exit_code=0)
    log.close()  # the exit hook closes again: a no-op
    rows = _history(_run_file(tmp_path))
    assert rows == [{"loss": 1.0, "step": 1}, {"loss": 0.5, "step": 2}]
    run = next(r.run for r in _records(_run_file(tmp_path)) if r.HasField("run"))
    assert run.run_id == "exp_trial" and run.project == "exp" and run.display_name == "exp/trial"
    assert list(run.tags) == ["unit"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["seed"] == 3 and config["ppo"] == {"eps": 0.2}


def test_disabled_log_is_a_no_op_and_missing_wandb_is_named(tmp_path, monkeypatch):
    log = WandbLog(WandbConfig(), str(tmp_path), "exp", "trial")
    log.write(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "wandb").exists()
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'realhf\[wandb\]'"):
        WandbLog(WandbConfig(mode="offline"), str(tmp_path), "exp", "trial")


def _quickstart(args, tmp_path, timeout):
    return quickstart_runs.run([*args, f"fileroot={tmp_path}"], timeout)


@pytest.mark.slow
def test_bad_mode_exits_2_before_launching(tmp_path):
    r = _quickstart(["null", "wandb.mode=foo"], tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "wandb.mode='foo'; use one of ('disabled', 'offline', 'online')" in r.stderr
    assert not (tmp_path / "null").exists()


@pytest.mark.slow
def test_quickstart_offline_run_logs_each_step(tmp_path):
    r = _quickstart(
        ["null", "exp_ctrl.benchmark_steps=2", "wandb.mode=offline", "wandb.group=g"],
        tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = tmp_path / "null" / "run0"
    path = _run_file(run_dir)
    rows = _history(path)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["n_items"] > 0 and row["tokens_per_s"] > 0 for row in rows)
    records = _records(path)
    run = next(r.run for r in records if r.HasField("run"))
    assert run.run_id == "null_run0" and run.run_group == "g"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["exp_ctrl"]["benchmark_steps"] == 2 and config["wandb"]["group"] == "g"
    exit_rec = next(r.exit for r in records if r.HasField("exit"))
    assert exit_rec.exit_code == 0
