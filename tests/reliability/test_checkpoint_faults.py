"""Damaged recover checkpoints and a full disk while writing one: defined outcomes, no hang.

* damaged (cut short, overwritten, missing file, ``latest`` naming nothing): resume falls
  back to the newest usable checkpoint with a warning naming the damage; with none usable,
  a RecoverError names it and how to start afresh; checkpoints without a manifest (written
  before manifests) still load, and damage to them fails the load naming the file;
* full disk: CheckpointWriteError "no space left ..." naming the checkpoint directory, the
  partial ``.tmp`` directory removed, the previous checkpoint usable; the run fails.

Faults are injected by tests/helpers/file_faults.py on real checkpoints of a real (tiny) model,
and end to end on a quickstart run.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import quickstart_runs as qs
from file_faults import FaultUnavailable, inject
from tiny_models import TinyItems

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.model_api import FinetuneSpec
from realhf.base.storage import recover
from realhf.impl.dataset.shard_loader import ShardLoader

# ---- real checkpoints of a tiny model, damaged one way at a time -----------------------


def _worker(model_dir):
    from realhf.impl.model.backend import TrainEngine
    from realhf.impl.model.nn.real_model import ReaLModel

    model = ReaLModel.from_hf(model_dir)
    engine = TrainEngine(model, OptimizerConfig(lr=1e-2), FinetuneSpec(1, 8, 2))
    return {"actor": (model, engine)}, ShardLoader(TinyItems(6), seed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("qwen2", tmp_path_factory.mktemp("model") / "m")


@pytest.fixture(scope="module")
def two_checkpoints(model_dir, tmp_path_factory):
    """A recover root with complete checkpoints step1 and step2 (what a run keeps with
    max_recover_checkpoints=2)."""
    root = str(tmp_path_factory.mktemp("ckpts") / "recover")
    os.makedirs(root)
    trainable, loader = _worker(model_dir)
    for step in (1, 2):
        loader.take(0, 2)
        tmp = recover.prepare_tmp_dir(root, step)
        recover.save_worker_state(tmp, 0, trainable, loader.state_dict())
        recover.commit(root, tmp, step, {"step": step}, keep=2)
    return root


def _copy(root, tmp_path):
    dst = str(tmp_path / "recover")
    shutil.copytree(root, dst)
    return dst


DAMAGE = {
    "truncated_weights": "models/actor/model.safetensors has",
    "truncated_optimizer": "optimizer/actor/rank0.pt has",
    "garbage_master": "master.json is not readable JSON",
    "garbage_weights": "models/actor/model.safetensors does not match its checksum",
    "missing_file": "data/rank0.json is missing",
}


@pytest.mark.slow  # builds a model and an optimizer (imports transformers)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_falls_back_past_a_damaged_checkpoint(
    kind, two_checkpoints, model_dir, tmp_path, caplog
):
    root = _copy(two_checkpoints, tmp_path)
    fault = inject(kind, root)
    with caplog.at_level(logging.WARNING):
        found = recover.find_latest(root)
    assert found == os.path.join(root, "step1"), fault
    assert DAMAGE[kind] in caplog.text and "resuming from the older" in caplog.text
    assert os.path.isdir(os.path.join(root, "step2.invalid"))
    trainable, loader = _worker(model_dir)
    recover.load_worker_state(found, 0, trainable, loader)  # the fallback is usable
    assert loader.n_used == 2


@pytest.mark.slow
def test_latest_naming_nothing_falls_back_to_the_newest(two_checkpoints, tmp_path, caplog):
    root = _copy(two_checkpoints, tmp_path)
    inject("dangling_latest", root)
    with caplog.at_level(logging.WARNING):
        assert recover.find_latest(root) == os.path.join(root, "step2")
    assert "step999999 is not a complete recover checkpoint: the directory is missing" in (
        caplog.text
    )


@pytest.mark.slow
def test_with_no_usable_checkpoint_the_error_names_the_damage_and_the_fix(
    two_checkpoints, tmp_path
):
    root = _copy(two_checkpoints, tmp_path)
    shutil.rmtree(os.path.join(root, "step1"))  # max_recover_checkpoints=1: nothing older
    inject("truncated_weights", root)
    with pytest.raises(recover.RecoverError) as e:
        recover.find_latest(root)
    msg = str(e.value)
    assert "step2 is not a complete recover checkpoint: models/actor/model.safetensors" in msg
    assert f"delete {root}" in msg and "recover_mode=disabled" in msg


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated_weights", "truncated_optimizer"])
def test_an_old_checkpoint_without_manifest_loads_and_names_damage_on_load(
    kind, two_checkpoints, model_dir, tmp_path
):
    root = _copy(two_checkpoints, tmp_path)
    inject("no_manifest", root)
    step2 = os.path.join(root, "step2")
    trainable, loader = _worker(model_dir)
    recover.load_worker_state(recover.find_latest(root), 0, trainable, loader)  # as before
    fault = inject(kind, root)
    assert recover.find_latest(root) == step2  # nothing to check it against
    with pytest.raises(recover.RecoverError, match=f"{fault.path}.*delete {step2} "):
        recover.load_worker_state(step2, 0, *_worker(model_dir))


# ---- end to end ---------------------------------------------------------------------------

RUN = [
    "train_batch_size=4",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=4",
    "eval=false",
    "exp_ctrl.ckpt_freq_steps=1",
    "exp_ctrl.benchmark_steps=3",
    "exp_ctrl.save_freq_epochs=null",
]


@pytest.mark.slow
def test_e2e_resume_skips_a_truncated_checkpoint(tmp_path, no_leftover_processes):
    # Run 1 keeps the checkpoints of steps 1 and 2; the newest gets cut short; run 2 resumes
    # from step 1 and finishes step 2.  (~60 s on 2 cores: two runs)
    args = RUN + ["max_recover_checkpoints=2"]
    qs.finish(qs.start("ppo-math", args, tmp_path), timeout=300)
    run_dir = tmp_path / "ppo-math" / "t"
    inject("truncated_weights", run_dir)
    resume = args + ["recover_mode=resume", "exp_ctrl.benchmark_steps=2"]
    qs.finish(qs.start("ppo-math", resume, tmp_path), timeout=300)
    log = (run_dir / "logs" / "master_worker_0.log").read_text()
    assert "resuming from the older recover checkpoint" in log
    assert "step2 is not a complete recover checkpoint: models/actor/model.safetensors has" in log
    assert "running steps 2..2 (resumed from" in log
    assert qs.steps(run_dir) == [1, 2]


@pytest.mark.slow
def test_e2e_full_disk_fails_the_run_naming_it_and_keeps_the_last_checkpoint(
    tmp_path, no_leftover_processes
):
    # A real 45 MB file system under the recover root: a checkpoint of the tiny model takes
    # ~29 MB, so step 1's fits and step 2's (written while step 1's still exists) does not.
    root = tmp_path / "ppo-math" / "t" / "checkpoints" / "recover"
    try:
        disk = inject("full_disk", root, size=45 << 20)
    except FaultUnavailable as e:
        pytest.skip(str(e))
    with disk:
        out = qs.finish(qs.start("ppo-math", RUN, tmp_path), timeout=300, code=1)
        assert "CheckpointWriteError: no space left for recover checkpoint" in out
        assert f"{root}/step2.tmp" in out and "no space left on device" in out
        assert sorted(os.listdir(root)) == ["latest", "step1"]  # no partial step2.tmp
        assert recover.check_checkpoint(str(root / "step1")) == []
        assert recover.find_latest(str(root)) == str(root / "step1")
