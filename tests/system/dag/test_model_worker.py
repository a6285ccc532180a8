"""The model worker in-process (a 1-rank gloo world), driven handle by handle by a real
request client: the toy graph of ``dag_test_experiment`` on a tiny ReaLModel."""

from __future__ import annotations

import os

import dag_test_experiment as dag_test  # noqa: F401  (registers the experiment)
import pytest
import torch
from tiny_models import make_tiny_hf_model

from realhf.api.core.model_api import StepInfo
from realhf.api.core.system_api import WorkerInformation, make_experiment
from realhf.base import constants, name_resolve, names
from realhf.base.storage import recover
from realhf.impl.model.nn.real_model import ReaLModel
from realhf.system.dag.messages import (
    REQUEST_STREAM,
    CheckpointRequest,
    EvalRequest,
    FetchRequest,
    Handle,
    InitializeRequest,
    MFCRequest,
    SaveRequest,
)
from realhf.system.dag.model_worker import PROTOCOL, ModelWorker
from realhf.system.transport.errors import RemoteError, StreamTimeout
from realhf.system.transport.request_reply import RequestClient
from realhf.system.worker.base import WorkerStatus, read_error

EXP = "mw-test"
W = "model_worker/0"


@pytest.fixture
def env(tmp_path, memory_name_resolve, trial):
    constants.clear_experiment_trial_names()
    constants.set_experiment_trial_names(EXP, trial)
    constants.set_fileroot(str(tmp_path))
    yield trial
    constants.clear_experiment_trial_names()
    constants.set_fileroot(None)


class Driver:
    """Send one request, poll the in-process worker until the reply arrives."""

    def __init__(self, worker, client):
        self.worker, self.client = worker, client
        while not client.all_connected():  # the worker connects on its first poll
            worker.step()

    def __call__(self, handle, data=None):
        rid = self.client.request([W], handle, [data])[0]
        for _ in range(2000):
            self.worker.step()
            try:
                return self.client.gather([rid], timeout=0.001)[0].result()
            except StreamTimeout:
                continue
        raise TimeoutError(handle)


@pytest.mark.slow  # a real model, optimizer and 1-rank gloo world in-process
def test_model_worker_runs_the_toy_graph_and_every_handle(tmp_path, env):
    trial = env
    model_path = make_tiny_hf_model("qwen2", tmp_path / "model")
    exp = make_experiment(
        "dag-test",
        model_path=model_path,
        n_model_workers=1,
        n_items=6,
        train_batch_size=4,
        log_dir=str(tmp_path / "ids"),
        eval=True,
        publish_weights=True,
        timeout=30.0,
    )
    cfg = exp.workers["model_worker"][0]
    worker = ModelWorker(EXP, trial, "model_worker", 0)
    worker.handle_control(
        "configure", worker_info=WorkerInformation(EXP, trial, "model_worker", 0, 1), config=cfg
    )
    worker.handle_control("start")
    client = RequestClient(EXP, trial, REQUEST_STREAM, [W], reply_timeout=30, wait=False)
    call = Driver(worker, client)
    try:
        spec = call(Handle.SPEC)
        assert (spec.dataset_size, spec.eval_dataset_size, spec.can_evaluate) == (6, 4, True)
        assert spec.roles == ("actor", "ref")
        with pytest.raises(RemoteError, match="not initialized"):
            call(Handle.INFERENCE, MFCRequest("plus1", StepInfo(), (), None))
        # That failure ended the worker (a peer could be stuck in a collective with it).
        assert worker.status == WorkerStatus.ERROR
        assert "model 'ref' is not initialized" in read_error(EXP, trial, W).message
    finally:
        worker._exit_hook()
        client.close()

    # A fresh worker for the successful path.
    worker = ModelWorker(EXP, trial, "model_worker", 0)
    worker.handle_control(
        "configure", worker_info=WorkerInformation(EXP, trial, "model_worker", 0, 1), config=cfg
    )
    worker.handle_control("start")
    client = RequestClient(EXP, trial, REQUEST_STREAM, [W], reply_timeout=30, wait=False)
    call = Driver(worker, client)
    try:
        ft_spec = cfg.ft_spec
        pos = call(Handle.INITIALIZE, InitializeRequest(ft_spec))
        assert (pos.epoch, pos.n_used, pos.shard_size) == (0, 0, 6)
        rep = call(Handle.FETCH, FetchRequest(0, 3))
        assert rep.meta.data is None and len(rep.meta) == 2  # dataset_batch_size = 4 // 2
        rep2 = call(Handle.FETCH, FetchRequest(0, 1))
        assert len(rep2.meta) == 1 and rep2.position.n_used == 3
        meta = type(rep.meta).gather([rep.meta, rep2.meta])
        ids = meta.ids
        step = StepInfo(0, 0, 0)

        # A call on the actor that does not train it runs with its gradient memory freed.
        grad_bytes = {}

        def spy(name, run):
            def call_and_record(*a, **k):
                engine = worker.weights.engines["actor"]
                grad_bytes[name] = engine.flat_grad.untyped_storage().nbytes()
                return run(*a, **k)

            return call_and_record

        for name, kind in (("gen", "generate"), ("train", "train_step")):
            iface = worker.interfaces[name]
            setattr(iface, kind, spy(name, getattr(iface, kind)))
        out = call(Handle.GENERATE, MFCRequest("gen", step, (), meta.select(["packed_input_ids"])))
        assert grad_bytes["gen"] == 0
        assert out.output.keys == {"a_out"} and sorted(out.output.ids) == sorted(ids)
        assert out.output.data is None and out.end >= out.start
        a_meta = out.output
        b = call(Handle.INFERENCE, MFCRequest("plus1", step, (), a_meta))
        c = call(Handle.INFERENCE, MFCRequest("times3", step, (), a_meta))
        assert c.output.keys == {"c_out"}  # output_key_remap {"y": "c_out"}
        train_meta = meta.select(["packed_input_ids"])
        train_meta.update_(b.output)
        train_meta.update_(c.output)
        t = call(Handle.TRAIN_STEP, MFCRequest("train", step, (), train_meta))
        assert t.output is None
        actor_grad = worker.weights.engines["actor"].flat_grad
        assert grad_bytes["train"] >= actor_grad.numel() * actor_grad.element_size()
        assert t.stats["mismatches"] == 0.0 and t.stats["n_items"] == 3.0
        assert t.stats["loss"] > 0 and t.stats["lr"] > 0
        # publish_weights: an HF dir of version 1 and the name-resolve key.
        assert name_resolve.get(names.model_version(EXP, trial, "actor")) == "1"
        pub = constants.weight_publication_dir("actor", 1)
        assert os.path.exists(os.path.join(pub, "config.json"))
        assert call(Handle.MODEL_VERSION) == {"actor": 1}

        ev = call(Handle.EVALUATE, EvalRequest(StepInfo(0, 1, 1)))
        assert ev.n_items == 4 and ev.metrics["logprob"] < 0

        save_dir = str(tmp_path / "save" / "actor")
        assert call(Handle.SAVE, SaveRequest({"actor": save_dir})) == [save_dir]
        saved = ReaLModel.from_hf(save_dir)
        assert torch.equal(saved.flat_params, worker.weights.modules["actor"].flat_params)
        assert not torch.equal(saved.flat_params, ReaLModel.from_hf(model_path).flat_params)

        ckpt = str(tmp_path / "ckpt")
        written = call(Handle.CHECKPOINT, CheckpointRequest(ckpt, StepInfo(0, 1, 1)))
        assert recover.data_state_path(ckpt, 0) in written
        assert recover.optimizer_path(ckpt, "actor", 0) in written

        assert call(Handle.CLEAR_DATA_CACHE, tuple(ids)) == 3
        assert len(worker.store) == 0
        with pytest.raises(RemoteError, match="unknown request 'nope'"):
            call("nope")
    finally:
        worker._exit_hook()
        client.close()


def test_config_errors_name_the_fix(tmp_path):
    from realhf.api.core.worker_api import ModelSpec

    with pytest.raises(ValueError, match="not trainable; set trainable=True or drop the optimizer"):
        from realhf.api.cli_args import OptimizerConfig

        ModelSpec("ref", "/x", optimizer=OptimizerConfig())
    with pytest.raises(ValueError, match="dtype='fp8'"):
        ModelSpec("actor", "/x", dtype="fp8")
    exp = make_experiment("dag-test", model_path="/m", n_model_workers=1)
    cfg = exp.workers["model_worker"][0]
    import dataclasses

    with pytest.raises(ValueError, match="trains role 'actor'; set ModelSpec"):
        dataclasses.replace(cfg, models=[ModelSpec("actor", "/m"), ModelSpec("ref", "/m")])
    with pytest.raises(ValueError, match="runs on role 'ref', which is not in models"):
        dataclasses.replace(cfg, models=[cfg.models[0]])


def test_protocol_serves_every_handle_with_the_types_it_names():
    import typing
    from types import NoneType

    assert set(PROTOCOL) == set(Handle)
    for handle, route in PROTOCOL.items():
        hints = typing.get_type_hints(route.handler)
        (request,) = [v for k, v in hints.items() if k != "return"]
        assert (typing.get_origin(request) or request) is route.request, handle
        reply = hints["return"]
        assert (typing.get_origin(reply) or reply) is route.reply, handle
    with pytest.raises(TypeError, match="'fetch' carries data of type int; it takes FetchRequest"):
        PROTOCOL[Handle.FETCH].check_request(Handle.FETCH, 3)
    PROTOCOL[Handle.SPEC].check_request(Handle.SPEC, None)
    assert PROTOCOL[Handle.EXIT].reply is NoneType
