"""Shutdown works from any state (issue 22).

A worker that fails before its ``configure`` completed must leave only the real error
in its log: its exit path (``Worker.run`` -> ``_close`` -> ``_exit_hook``) may not trip
over what configure never built.  The reported case was the master worker, whose
``configure`` request could not be unpickled (the experiment's config class was not
importable in the worker); its exit hook then logged a second traceback,
``'MasterWorker' object has no attribute 'trace'``.

Every worker kind goes through the real poll loop and exit path

* with an unreadable ``configure`` (its config class lives in a module only the
  controller has), over the real ZMQ control socket;
* told to ``exit`` before any ``configure``;
* with a ``configure`` whose config raises on first use;

plus a master whose configure fails half-way (after binding its request stream), and
the reported case end to end: a ``python -m realhf.apps.remote`` master worker process.
"""

from __future__ import annotations

import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys
import threading
import types
from typing import List

import pytest
import zmq

from realhf.api.core.system_api import WorkerInformation
from realhf.base import logging, name_resolve, names
from realhf.base.net import auth
from realhf.system.worker.base import (
    CONTROL_KIND,
    ControlReply,
    ControlRequest,
    WorkerControlServer,
    WorkerStatus,
    make_worker,
    read_error,
    read_status,
    registered_worker_types,
)

EXP = "shutdown-test"
# Every worker type realhf registers (test_every_worker_kind_is_covered keeps this complete).
WORKER_TYPES = (
    "master_worker",
    "model_worker",
    "rollout_worker",
    "gserver_manager",
    "generation_server",
    "smoke_model",
    "smoke_master",
    "smoke_producer",
    "smoke_consumer",
)
# The smoke experiment's worker types register on import of their module.
importlib.import_module("realhf.experiments.smoke")

GONE_MODULE = "realhf_test_config_only_the_launcher_has"


class ConfigBroken(Exception):
    """Raised by :func:`_config_raising_on_use` (the 'real error' of those tests)."""


def _info(trial: str, wtype: str) -> WorkerInformation:
    return WorkerInformation(EXP, trial, wtype, 0, 1)


def _unreadable_configure(trial: str, wtype: str) -> bytes:
    """A pickled ``configure`` request that this process cannot unpickle.

    Its config class lives in a module that exists only while pickling, as when an
    experiment's config class is defined in the launcher's ``__main__`` or in a module
    the worker was not given with ``--import``.
    """
    mod = types.ModuleType(GONE_MODULE)
    sys.modules[GONE_MODULE] = mod
    try:
        exec("class ExperimentConfig:\n    n = 1\n", mod.__dict__)
        req = ControlRequest(
            "configure", dict(worker_info=_info(trial, wtype), config=mod.ExperimentConfig())
        )
        return pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        del sys.modules[GONE_MODULE]


def _config_raising_on_use(config_class: type):
    """An instance of ``config_class`` (so configure accepts it) whose fields raise when read."""

    class RaisingConfig(config_class):
        def __getattribute__(self, name):
            if name.startswith("__"):
                return object.__getattribute__(self, name)
            raise ConfigBroken(f"the experiment's config is broken (reading {name!r})")

    return object.__new__(RaisingConfig)


class ScriptedControl:
    """An in-memory control channel: serves ``requests`` in order, then ``exit``.

    It stands in for :class:`WorkerControlServer` where a request cannot be pickled
    (a config class built inside a test); the loop and exit path are the real ones.
    """

    def __init__(self, requests: List[ControlRequest]):
        self.requests = list(requests) + [ControlRequest("exit")]
        self.replies: List[ControlReply] = []
        self.closed = False

    def recv(self, timeout: float):
        return self.requests.pop(0) if self.requests else None

    def send(self, reply: ControlReply) -> None:
        self.replies.append(reply)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def worker_log(tmp_path):
    """The path of a log file that receives every realhf logger's records during the test."""
    path = str(tmp_path / "worker.log")
    logging.add_file_handler(path)
    yield path
    logging.remove_file_handler(path)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _assert_only_the_real_error(log: str, real_error: str) -> None:
    assert real_error in log, f"the real error {real_error!r} is missing from the log:\n{log}"
    assert "exit hook failed" not in log, f"the exit path failed too:\n{log}"
    assert "has no attribute" not in log, f"the exit path failed too:\n{log}"
    # ``_fail`` logs the error once, with its traceback (a chained cause adds one more).
    assert len(re.findall(r"^Traceback", log, re.M)) <= 2, log
    assert log.count("failed during") == 1, log


def _run_in_thread(worker, control):
    result = {}
    t = threading.Thread(
        target=lambda: result.setdefault("rc", worker.run(control, idle_wait=0.01)), daemon=True
    )
    t.start()
    return t, result


def _send(sock: zmq.Socket, data: bytes, timeout: float = 10.0) -> ControlReply:
    """Send raw pickled bytes as the controller would: signed with the run's secret."""
    auth.send(sock, CONTROL_KIND, data)
    assert sock.poll(int(timeout * 1000)), "the worker did not answer its control request"
    got = auth.recv(sock, CONTROL_KIND, "test controller")
    assert got is not None, "the worker's answer did not carry the run's MAC"
    return pickle.loads(got[1])


def test_every_worker_kind_is_covered(memory_name_resolve, trial):
    """A new worker type must join WORKER_TYPES, so that its shutdown is tested too."""
    import realhf.system

    for m in pkgutil.walk_packages(realhf.system.__path__, "realhf.system."):
        importlib.import_module(m.name)
    realhf_types = {
        t
        for t in registered_worker_types()
        if type(make_worker(t, EXP, trial, t, 0)).__module__.startswith("realhf.")
    }
    assert realhf_types <= set(WORKER_TYPES), sorted(realhf_types - set(WORKER_TYPES))


@pytest.mark.parametrize("wtype", WORKER_TYPES)
def test_unreadable_configure_fails_the_worker_with_only_that_error(
    memory_name_resolve, trial, worker_log, wtype
):
    """The reported path: the configure request's config class cannot be unpickled."""
    w = make_worker(wtype, EXP, trial, wtype, 0)
    control = WorkerControlServer(EXP, trial, w.worker_name, host="127.0.0.1")
    t, result = _run_in_thread(w, control)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control.address)
    try:
        reply = _send(sock, _unreadable_configure(trial, wtype))
        t.join(timeout=10)
        if t.is_alive():  # a worker that carried on: stop it as the controller would
            _send(sock, pickle.dumps(ControlRequest("exit")))
            t.join(timeout=10)
    finally:
        sock.close()
    assert not t.is_alive()
    _assert_only_the_real_error(_read(worker_log), f"No module named '{GONE_MODULE}'")
    # The controller gets the real error and how to fix it, and sees ERROR, as for a
    # configure that raised.
    assert reply.error is not None
    assert f"No module named '{GONE_MODULE}'" in reply.error.traceback
    assert "--import" in reply.error.message
    assert result["rc"] == 1
    assert read_status(EXP, trial, w.worker_name) == WorkerStatus.ERROR
    assert read_error(EXP, trial, w.worker_name) == reply.error
    # The control address is withdrawn on exit.
    with pytest.raises(name_resolve.NameEntryNotFoundError):
        name_resolve.get(names.worker(EXP, trial, w.worker_name))


@pytest.mark.parametrize("wtype", WORKER_TYPES)
def test_exit_before_configure_is_clean(memory_name_resolve, trial, worker_log, wtype):
    """``exit`` straight after start-up (the controller gave up before configuring it)."""
    w = make_worker(wtype, EXP, trial, wtype, 0)
    control = ScriptedControl([])
    assert w.run(control, idle_wait=0.01) == 0 and control.closed
    log = _read(worker_log)
    assert "ERROR" not in log and "Traceback" not in log, log


# The smoke model worker and producer build nothing from their config in configure.
CONFIG_READING_TYPES = tuple(t for t in WORKER_TYPES if t not in ("smoke_model", "smoke_producer"))


@pytest.mark.parametrize("wtype", CONFIG_READING_TYPES)
def test_configure_that_raises_leaves_only_that_error(
    memory_name_resolve, trial, worker_log, wtype
):
    w = make_worker(wtype, EXP, trial, wtype, 0)
    config = _config_raising_on_use(type(w).config_class)
    control = ScriptedControl(
        [ControlRequest("configure", dict(worker_info=_info(trial, wtype), config=config))]
    )
    rc = w.run(control, idle_wait=0.01)
    _assert_only_the_real_error(_read(worker_log), "the experiment's config is broken")
    assert rc == 1 and control.closed
    assert control.replies[0].error.exc_type == "ConfigBroken"
    assert read_status(EXP, trial, w.worker_name) == WorkerStatus.ERROR


def test_master_failing_half_way_through_configure_releases_its_stream(
    memory_name_resolve, trial, worker_log, monkeypatch
):
    """After binding its request stream: the exit hook closes that and nothing else."""
    from realhf.api.cli_args import ExperimentControlConfig
    from realhf.api.core.dfg import MFCDef
    from realhf.api.core.model_api import FinetuneSpec
    from realhf.api.core.worker_api import MasterWorkerConfig
    from realhf.system.dag import master_worker
    from realhf.system.dag.messages import REQUEST_STREAM

    def broken_runner(*args, **kwargs):
        raise ConfigBroken("DagRunner could not be built")

    monkeypatch.setattr(master_worker, "DagRunner", broken_runner)
    w = make_worker("master_worker", EXP, trial, "master_worker", 0)
    config = MasterWorkerConfig(
        seed=1,
        mfcs=[MFCDef("train", "actor", "train_step", "t", n_seqs=2, input_keys=["x"])],
        exp_ctrl=ExperimentControlConfig(total_train_epochs=1),
        n_model_workers=1,
        train_batch_size=2,
        ft_spec=FinetuneSpec(1, 4, 2),
    )
    control = ScriptedControl(
        [
            ControlRequest(
                "configure", dict(worker_info=_info(trial, "master_worker"), config=config)
            )
        ]
    )
    assert w.run(control, idle_wait=0.01) == 1
    _assert_only_the_real_error(_read(worker_log), "DagRunner could not be built")
    # The stream's published address went with the client.
    assert name_resolve.find_subtree(names.request_reply_stream(EXP, trial, REQUEST_STREAM)) == []


@pytest.mark.slow
def test_remote_master_worker_with_an_unreadable_config_logs_only_that_error(tmp_path, trial):
    """The reported case end to end.

    ``python -m realhf.apps.remote worker --type master_worker`` with a config it cannot read.
    """
    nr_root = tmp_path / "nr"
    env = dict(
        os.environ,
        REALHF_FILEROOT=str(tmp_path),
        HOME=str(tmp_path),
        REALHF_NAME_RESOLVE=f"file://{nr_root}",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "realhf.apps.remote",
            "worker",
            "--type",
            "master_worker",
            "--index",
            "0",
            "-e",
            EXP,
            "-f",
            trial,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    name_resolve.reconfigure("file", root=str(nr_root))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        address = name_resolve.wait(names.worker(EXP, trial, "master_worker/0"), timeout=60)
        sock.connect(address)
        reply = _send(sock, _unreadable_configure(trial, "master_worker"), timeout=30)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a worker that carried on: stop it
            _send(sock, pickle.dumps(ControlRequest("exit")), timeout=30)
        out, _ = proc.communicate(timeout=30)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        name_resolve.reconfigure("memory")
    _assert_only_the_real_error(out, f"No module named '{GONE_MODULE}'")
    assert reply.error is not None and "--import" in reply.error.message
    assert proc.returncode == 1, out
