"""Errors that cross process boundaries keep their context through pickling."""

from __future__ import annotations

import pickle

from realhf.system.transport.errors import ErrorInfo, ExperimentFailed, RemoteError, StreamTimeout


def _info():
    try:
        raise KeyError("missing shard")
    except KeyError as e:
        return ErrorInfo.from_exception(
            e, worker="model_worker/3", handle_name="train_step", request_id="abc"
        )


def test_error_info_and_remote_error_text():
    info = _info()
    assert info.exc_type == "KeyError" and "_info" in info.traceback
    err = RemoteError(info)
    text = str(err)
    assert text.startswith(
        "KeyError: 'missing shard' in model_worker/3 while handling 'train_step'"
    )
    assert "(request abc)" in text and "--- remote traceback from model_worker/3 ---" in text
    assert str(pickle.loads(pickle.dumps(err))) == text


def test_experiment_failed_and_stream_timeout_pickle():
    e = ExperimentFailed("exp", "t1", {"b/1": "LOST: gone", "a/0": "ERROR during poll: x"})
    assert str(e).splitlines() == [
        "experiment 'exp' trial 't1' failed:",
        "  a/0: ERROR during poll: x",
        "  b/1: LOST: gone",
    ]
    again = pickle.loads(pickle.dumps(e))
    assert again.failures == e.failures and str(again) == str(e)
    t = pickle.loads(pickle.dumps(StreamTimeout("no reply from w/0", waited_for="w/0")))
    assert isinstance(t, TimeoutError) and t.waited_for == "w/0" and str(t) == "no reply from w/0"
