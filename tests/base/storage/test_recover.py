"""Recover checkpoints: atomic commit, discovery, pruning, and a worker's state round trip."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import TinyItems

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import FinetuneSpec
from realhf.base.storage import recover
from realhf.impl.dataset.shard_loader import ShardLoader


def _commit(root, step, keep=1):
    tmp = recover.prepare_tmp_dir(root, step)
    with open(os.path.join(tmp, "payload"), "w") as f:
        f.write(str(step))
    return recover.commit(root, tmp, step, {"step": step}, keep=keep)


def test_commit_renames_and_points_latest(tmp_path):
    root = str(tmp_path / "recover")
    assert recover.find_latest(str(tmp_path)) is None
    final = _commit(root, 2)
    assert final == os.path.join(root, "step2") and not os.path.exists(final + ".tmp")
    assert recover.find_latest(root) == final
    assert recover.read_master_state(final) == {"step": 2}


def test_a_half_written_checkpoint_is_ignored_and_cleaned(tmp_path):
    root = str(tmp_path)
    _commit(root, 2)
    dead = recover.prepare_tmp_dir(root, 4)  # a run died while writing step 4
    assert recover.find_latest(root).endswith("step2")
    assert os.path.isdir(dead)
    _commit(root, 6)
    assert not os.path.exists(dead)


def test_old_checkpoints_are_pruned(tmp_path):
    root = str(tmp_path)
    for step in (2, 4, 6):
        _commit(root, step, keep=2)
    assert sorted(os.listdir(root)) == ["latest", "step4", "step6"]
    _commit(root, 6, keep=2)  # the same step again (after a resume) replaces it
    assert recover.find_latest(root).endswith("step6")


def test_a_crash_while_replacing_the_same_step_keeps_a_checkpoint(tmp_path, monkeypatch):
    # Re-saving the step a run resumed from: the old directory has to leave its name
    # before the new one can take it.  A crash in between used to leave `latest` naming
    # nothing (the old one was already deleted), so the run could not resume at all.
    root = str(tmp_path)
    _commit(root, 6)
    real_rename = os.rename

    def crash_on_the_new_one(src, dst):
        if src.endswith("step6.tmp"):
            raise KeyboardInterrupt("killed between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_the_new_one)
    tmp = recover.prepare_tmp_dir(root, 6)
    with pytest.raises(KeyboardInterrupt):
        recover.commit(root, tmp, 6, {"step": 6, "again": True})
    monkeypatch.setattr(os, "rename", real_rename)
    latest = recover.find_latest(root)
    assert latest == os.path.join(root, "step6")
    assert recover.read_master_state(latest) == {"step": 6}  # the complete old one
    _commit(root, 6)  # and the next commit of the step succeeds, leaving no debris
    assert sorted(os.listdir(root)) == ["latest", "step6"]


def test_latest_naming_an_incomplete_dir_is_an_error(tmp_path):
    (tmp_path / "latest").write_text("step3")
    with pytest.raises(recover.RecoverError, match="not a complete recover checkpoint"):
        recover.find_latest(str(tmp_path))


def _engine(model_dir, lora_rank=0):
    from realhf.api.cli_args import LoraConfig
    from realhf.impl.model.backend import TrainEngine
    from realhf.impl.model.nn.lora import add_lora
    from realhf.impl.model.nn.real_model import ReaLModel

    model = ReaLModel.from_hf(model_dir)
    if lora_rank:
        add_lora(
            model, LoraConfig(lora_rank), generator=torch.Generator().manual_seed(len(model_dir))
        )
    return model, TrainEngine(
        model, OptimizerConfig(lr=1e-2, weight_decay=0.0), FinetuneSpec(1, 8, 2)
    )


def _step(engine):
    g = torch.Generator().manual_seed(0)
    data = SequenceSample.from_default(
        ["a", "b"], [5, 4], {"packed_input_ids": torch.randint(0, 100, (9,), generator=g)}
    )

    def loss_fn(logits, mb):
        return logits.float().pow(2).mean(), {}

    return engine.train_batch(data, MicroBatchSpec(), loss_fn, lambda mb: 9.0)


@pytest.mark.slow  # builds a model and an optimizer (imports transformers)
def test_worker_state_round_trip(tmp_path):
    from tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model("qwen2", tmp_path / "model")
    model, engine = _engine(path)
    _step(engine)
    loader = ShardLoader(TinyItems(6), seed=1)
    loader.take(0, 4)
    ckpt = str(tmp_path / "ckpt")
    written = recover.save_worker_state(ckpt, 0, {"actor": (model, engine)}, loader.state_dict())
    assert recover.model_dir(ckpt, "actor") in written
    assert os.path.exists(recover.optimizer_path(ckpt, "actor", 0))

    model2, engine2 = _engine(path)  # fresh weights from the original directory
    loader2 = ShardLoader(TinyItems(6), seed=1)
    recover.load_worker_state(ckpt, 0, {"actor": (model2, engine2)}, loader2)
    assert torch.equal(model.flat_params, model2.flat_params)
    assert engine2.n_steps == 1 and (loader2.epoch, loader2.n_used) == (0, 4)
    # The next optimizer step is bit-identical: moments and step count were restored.
    assert _step(engine) == _step(engine2)
    assert torch.equal(model.flat_params, model2.flat_params)

    with pytest.raises(recover.RecoverError, match="rank1.pt"):
        recover.load_worker_state(ckpt, 1, {"actor": (model2, engine2)})


@pytest.mark.slow  # builds a model and an optimizer (imports transformers)
def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_only(tmp_path):
    from tiny_models import make_tiny_hf_model

    path = str(make_tiny_hf_model("qwen2", tmp_path / "model"))
    model, engine = _engine(path, lora_rank=4)
    _step(engine)
    ckpt = str(tmp_path / "ckpt")
    recover.save_worker_state(ckpt, 0, {"actor": (model, engine)}, None)
    saved = sorted(os.listdir(recover.model_dir(ckpt, "actor")))
    assert saved == ["adapter_config.json", "adapter_model.safetensors"]
    moments = torch.load(recover.optimizer_path(ckpt, "actor", 0))["optimizer"]["state"]
    assert sum(v["exp_avg"].numel() for v in moments.values()) == model.lora.flat.numel()

    model2, engine2 = _engine(path, lora_rank=4)  # the base, fresh adapters
    assert not torch.equal(model2.lora.flat, model.lora.flat)
    recover.load_worker_state(ckpt, 0, {"actor": (model2, engine2)})
    assert torch.equal(model.lora.flat, model2.lora.flat) and engine2.n_steps == 1
    assert _step(engine) == _step(engine2)  # the next step is bit-identical
    assert torch.equal(model.lora.flat, model2.lora.flat)
    assert torch.equal(model.flat_params, model2.flat_params)  # the base never moved


class _Counter:
    """An interface with state (like an adaptive KL controller)."""

    def __init__(self):
        self.value = 0.0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_interface_states_round_trip(tmp_path):
    a, plain = _Counter(), object()
    a.value = 0.25
    ckpt = str(tmp_path)
    written = recover.save_worker_state(ckpt, 1, {}, None, {"actor_train": a, "gen": plain})
    assert written == [recover.interface_state_path(ckpt, "actor_train", 1)]
    b = _Counter()
    recover.load_worker_state(ckpt, 1, {}, None, {"actor_train": b, "gen": plain})
    assert b.value == 0.25
    with pytest.raises(recover.RecoverError, match="state of MFC 'critic_train'"):
        recover.load_worker_state(ckpt, 1, {}, None, {"critic_train": _Counter()})


# ---- damaged checkpoints and full disks ------------------------------------------------


def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(tmp_path, caplog):
    root = str(tmp_path)
    _commit(root, 2, keep=2)
    _commit(root, 4, keep=2)
    os.truncate(os.path.join(root, "step4", "payload"), 0)
    with caplog.at_level("WARNING"):
        assert recover.find_latest(root) == os.path.join(root, "step2")
    assert "payload has 0 bytes, 1 were written" in caplog.text
    # Moved aside: neither this nor a later run picks it again; pruning leaves it alone.
    assert sorted(os.listdir(root)) == ["latest", "step2", "step4.invalid"]
    assert recover.find_latest(root) == os.path.join(root, "step2")
    _commit(root, 3, keep=1)
    assert sorted(os.listdir(root)) == ["latest", "step3", "step4.invalid"]


def test_latest_naming_a_missing_dir_falls_back(tmp_path):
    root = str(tmp_path)
    _commit(root, 2, keep=2)
    (tmp_path / "latest").write_text("step9")
    assert recover.find_latest(root) == os.path.join(root, "step2")


def test_no_usable_checkpoint_is_an_error_naming_the_damage_and_the_fix(tmp_path):
    root = str(tmp_path)
    _commit(root, 2)
    (tmp_path / "step2" / "master.json").write_text("{garbage")
    with pytest.raises(recover.RecoverError) as e:
        recover.find_latest(root)
    msg = str(e.value)
    assert "step2 is not a complete recover checkpoint: master.json is not readable JSON" in msg
    assert "master.json has 8 bytes" in msg
    assert f"delete {root}" in msg and "recover_mode=disabled" in msg
    assert os.path.isdir(tmp_path / "step2")  # nothing moved: the user decides


def test_a_checkpoint_without_manifest_still_loads(tmp_path):
    # Written before manifests existed: master.json is all that marks it complete.
    root = str(tmp_path)
    _commit(root, 2)
    os.remove(tmp_path / "step2" / "manifest.json")
    assert recover.check_checkpoint(str(tmp_path / "step2")) == []
    assert recover.find_latest(root) == os.path.join(root, "step2")
    (tmp_path / "step2" / "master.json").write_text("")
    with pytest.raises(recover.RecoverError, match="master.json is not readable JSON"):
        recover.find_latest(root)
    with pytest.raises(recover.RecoverError, match="cannot read .*master.json"):
        recover.read_master_state(str(tmp_path / "step2"))


def test_a_damaged_state_file_names_itself_on_load(tmp_path):
    # The load-time net for what a check cannot see (old checkpoints, mid-file damage).
    a = _Counter()
    ckpt = str(tmp_path)
    recover.save_worker_state(ckpt, 0, {}, None, {"actor_train": a})
    path = recover.interface_state_path(ckpt, "actor_train", 0)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(recover.RecoverError, match=f"cannot read {path}.*delete {ckpt}"):
        recover.load_worker_state(ckpt, 0, {}, None, {"actor_train": _Counter()})


def test_a_full_disk_fails_the_write_and_keeps_the_previous_checkpoint(tmp_path):
    from file_faults import small_filesystem

    root = tmp_path / "recover"
    with small_filesystem(root, 1 << 20):
        _commit(str(root), 2)
        tmp = recover.prepare_tmp_dir(str(root), 4)
        big = _Counter()
        big.value = torch.zeros(1 << 19)  # 2 MiB: does not fit
        with pytest.raises(recover.CheckpointWriteError) as e:
            recover.save_worker_state(tmp, 0, {}, None, {"actor_train": big})
        assert str(e.value).startswith(f"no space left for recover checkpoint {tmp}: ")
        recover.discard_tmp_dir(tmp)  # what the master does with the error
        assert sorted(os.listdir(root)) == ["latest", "step2"]
        assert recover.find_latest(str(root)) == str(root / "step2")


def test_has_checkpoint_sees_committed_steps_only(tmp_path):
    root = tmp_path / "recover"
    assert not recover.has_checkpoint(str(root))  # no directory at all
    for name in ("step3.tmp", "step2.invalid", "step1.replaced", "latest"):
        (root / name).mkdir(parents=True)
    assert not recover.has_checkpoint(str(root))
    (root / "step4").mkdir()
    assert recover.has_checkpoint(str(root))
