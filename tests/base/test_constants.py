import os

import pytest

from realhf.base import constants


@pytest.fixture(autouse=True)
def _clean():
    constants.clear_experiment_trial_names()
    constants.set_fileroot(None)
    yield
    constants.clear_experiment_trial_names()
    constants.set_fileroot(None)


def test_names_unset_raise_clear_error():
    assert not constants.has_experiment_trial_names()
    with pytest.raises(RuntimeError, match="set_experiment_trial_names"):
        constants.experiment_name()
    with pytest.raises(RuntimeError, match="set_experiment_trial_names"):
        constants.trial_name()
    with pytest.raises(RuntimeError):
        constants.run_dir()


def test_names_set_once():
    constants.set_experiment_trial_names("exp", "t1")
    constants.set_experiment_trial_names("exp", "t1")  # same: fine
    assert (constants.experiment_name(), constants.trial_name()) == ("exp", "t1")
    with pytest.raises(RuntimeError, match="already set"):
        constants.set_experiment_trial_names("exp", "t2")
    with pytest.raises(ValueError, match="may not contain"):
        constants.set_experiment_trial_names("a/b", "t")
    with pytest.raises(ValueError, match="non-empty"):
        constants.set_experiment_trial_names("", "t")


def test_fileroot_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("REALHF_FILEROOT", raising=False)
    assert constants.get_fileroot() == os.path.join(os.path.expanduser("~"), ".cache", "realhf")
    monkeypatch.setenv("REALHF_FILEROOT", str(tmp_path / "env"))
    assert constants.get_fileroot() == str(tmp_path / "env")
    constants.set_fileroot(str(tmp_path / "explicit"))
    assert constants.get_fileroot() == str(tmp_path / "explicit")


def test_run_dir_layout(tmp_path):
    constants.set_fileroot(str(tmp_path))
    constants.set_experiment_trial_names("ppo", "run1")
    run = tmp_path / "ppo" / "run1"
    assert constants.run_dir() == str(run)
    assert constants.config_path() == str(run / "config.yaml")
    assert constants.log_dir() == str(run / "logs")
    assert constants.worker_log_path("model_worker/3") == str(run / "logs" / "model_worker_3.log")
    assert constants.checkpoint_dir() == str(run / "checkpoints")
    assert constants.tensorboard_dir() == str(run / "tensorboard")
    assert constants.trace_path() == str(run / "trace.json")
    assert constants.metrics_path() == str(run / "metrics.jsonl")
    assert constants.run_dir("other", "t") == str(tmp_path / "other" / "t")
    assert constants.weight_publication_dir("actor", 3) == str(
        tmp_path / ".cache" / "ppo" / "run1" / "weights" / "actor" / "v3"
    )
    assert constants.name_resolve_root() == str(tmp_path / "name_resolve")
    with pytest.raises(ValueError, match="version"):
        constants.weight_publication_dir("actor", -1)


def test_ensure_writable(tmp_path):
    target = tmp_path / "a" / "b"
    assert constants.ensure_writable(str(target)) == str(target)
    assert target.is_dir()
    blocker = tmp_path / "plain_file"
    blocker.write_text("x")
    # Even root cannot create a directory below a regular file.
    with pytest.raises(PermissionError, match=str(blocker)) as e:
        constants.ensure_writable(str(blocker / "root"))
    assert "REALHF_FILEROOT" in str(e.value)


def test_hf_checkpoints_lists_complete_ones_by_step(tmp_path):
    run = tmp_path / "run"
    for role, step, complete in [
        ("actor", 10, True),
        ("actor", 2, True),
        ("critic", 10, True),
        ("actor", 12, False),  # being written: no config.json yet
    ]:
        d = run / "checkpoints" / role / constants.hf_checkpoint_name(1, step, step)
        d.mkdir(parents=True)
        if complete:
            (d / "config.json").write_text("{}")
    (run / "checkpoints" / "recover" / "step3").mkdir(parents=True)  # not an HF checkpoint
    found = [(s, r) for s, r, _ in constants.hf_checkpoints(str(run))]
    assert found == [(2, "actor"), (10, "actor"), (10, "critic")]
    assert [p for _, _, p in constants.hf_checkpoints(str(run), "critic")] == [
        str(run / "checkpoints" / "critic" / "epoch1epochstep10globalstep10")
    ]
    assert constants.hf_checkpoints(str(tmp_path / "none")) == []
