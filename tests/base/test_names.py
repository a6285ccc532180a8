import pytest

from realhf.base import constants, names


def test_every_key_is_under_the_trial_root(monkeypatch):
    monkeypatch.setenv("USER", "alice")
    root = names.trial_root("exp", "t")
    assert root == "alice/exp/t"
    keys = [
        names.worker_status("exp", "t", "model_worker/0"),
        names.worker("exp", "t", "model_worker/0"),
        names.worker_key("exp", "t", "k"),
        names.request_reply_stream("exp", "t", "master"),
        names.push_pull_stream("exp", "t", "rollout"),
        names.push_pull_stream_peers("exp", "t", "rollout"),
        names.distributed_peer("exp", "t", "actor"),
        names.distributed_local_peer("exp", "t", "host1", "actor"),
        names.distributed_master("exp", "t", "actor"),
        names.model_version("exp", "t", "actor"),
        names.metric_server("exp", "t", "tb", "main"),
        names.gen_servers("exp", "t"),
        names.gen_server_manager("exp", "t"),
        names.training_samples("exp", "t"),
        names.trainer_start("exp", "t"),
        names.used_data_ids("exp", "t"),
        names.experiment_status("exp", "t"),
        names.update_weights_from_disk("exp", "t", 4),
    ]
    assert all(k.startswith(root + "/") for k in keys)
    assert len(set(keys)) == len(keys)
    assert names.worker("exp", "t", "model_worker/0") == "alice/exp/t/worker/model_worker/0"
    assert names.worker("exp", "t", "w").startswith(names.worker_root("exp", "t") + "/")
    assert names.model_version("exp", "t", "actor") == "alice/exp/t/model_version/actor"
    assert names.update_weights_from_disk("exp", "t", 4) == "alice/exp/t/update_weights_from_disk/4"


def test_roots_contain_their_children():
    assert names.request_reply_stream("e", "t", "s").startswith(
        names.request_reply_stream_root("e", "t") + "/"
    )
    assert names.push_pull_stream("e", "t", "s").startswith(
        names.push_pull_stream_root("e", "t") + "/"
    )
    assert names.distributed_master("e", "t", "m").startswith(
        names.distributed_root("e", "t") + "/"
    )
    assert names.worker_status("e", "t", "w").startswith(names.worker_status_root("e", "t") + "/")


def test_bad_segments_rejected():
    with pytest.raises(ValueError, match="worker_name"):
        names.worker("e", "t", "")
    with pytest.raises(ValueError, match="experiment_name"):
        names.trial_root("", "t")
    with pytest.raises(ValueError, match="model_role"):
        names.model_version("e", "t", "a//b")


def test_user_falls_back_without_env(monkeypatch):
    monkeypatch.delenv("USER", raising=False)
    monkeypatch.delenv("LOGNAME", raising=False)
    assert constants.user()
