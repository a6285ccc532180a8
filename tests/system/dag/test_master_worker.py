"""The master worker in-process, against model-worker stand-ins that keep metadata only.

The stand-ins (threads speaking the real request/reply stream) load a real
``ShardLoader`` and answer every handle with metadata; they share one table of which
rank holds which (item, key), apply the master's transfer plans to it and check that
each MFC call finds all its input data in place.  The real model worker is tested in
test_model_worker.py and, with the master, as processes in test_dag_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Dict, List, Set, Tuple

import pytest
import torch

from realhf.api.cli_args import ExperimentControlConfig
from realhf.api.core.allocation import ParallelismConfig
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.dfg import MFCDef
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.system_api import WorkerInformation
from realhf.api.core.worker_api import MasterWorkerConfig
from realhf.base import constants, name_resolve, names
from realhf.base.storage import recover
from realhf.impl.dataset.shard_loader import ShardLoader
from realhf.system.dag.master_worker import MasterWorker
from realhf.system.dag.messages import (
    MFC_HANDLES,
    REQUEST_STREAM,
    DataPosition,
    EvalReply,
    FetchReply,
    Handle,
    MFCReply,
    SpecReply,
)
from realhf.system.transport.errors import NoMessage, StreamTimeout
from realhf.system.transport.request_reply import ReplyServer
from realhf.system.worker.base import WorkerStatus

EXP = "master-test"

# ---- stand-in model workers -------------------------------------------------------------


class _Items:
    def __init__(self, rank: int, world: int, n: int):
        self.items = [
            SequenceSample.from_default(
                [f"q{i}"],
                [1 + i % 5],
                {"packed_prompts": torch.zeros(1 + i % 5, dtype=torch.long)},
                metadata={"answer": [str(i)]},
            )
            for i in range(n)
            if i % world == rank
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class StandIn(threading.Thread):
    """Answers the master like a model worker would, with metadata only."""

    def __init__(self, trial, rank, world, n_items, mfcs, held, calls, seed=1, shard=None):
        super().__init__(daemon=True)
        self.trial, self.rank, self.world = trial, rank, world
        # shard: (index, count) of the data shard this worker loads (a replica head's);
        # None: shard `rank` of `world`.
        index, count = shard if shard is not None else (rank, world)
        self.loader = ShardLoader(_Items(index, count, n_items), seed)
        self.fetched = 0
        self.plan_steps: List = []  # every transfer step this worker was sent
        self.mfcs = {m.name: m for m in mfcs}
        self.held: Dict[int, Set[Tuple[str, str]]] = held  # shared by all stand-ins
        self.calls: List[tuple] = calls
        self.error = None
        self.stop = threading.Event()
        self.call_indices: List[tuple] = []

    def run(self):
        try:
            self._serve()
        except BaseException as e:  # surfaced by the test
            self.error = e

    def _serve(self):
        server = ReplyServer(
            EXP, self.trial, REQUEST_STREAM, f"model_worker/{self.rank}", connect_timeout=20
        )
        while not self.stop.is_set():
            try:
                req = server.poll(timeout=0.05)
            except (NoMessage, StreamTimeout):
                continue
            h, d = Handle(req.handle_name), req.data
            if h is Handle.SPEC:
                out = SpecReply(f"model_worker/{self.rank}", len(self.loader), 0, True, ("actor",))
            elif h is Handle.INITIALIZE:
                if d.recover_dir:
                    with open(recover.data_state_path(d.recover_dir, self.rank)) as f:
                        self.loader.load_state_dict(json.load(f))
                out = DataPosition(self.loader.epoch, self.loader.n_used, len(self.loader))
            elif h is Handle.FETCH:
                self.fetched += 1
                items = self.loader.take(d.epoch, min(d.n, 2))  # at most 2 per call
                meta = SequenceSample.gather(items).meta() if items else None
                for s in items:
                    self.held[self.rank].add((s.ids[0], "packed_prompts"))
                out = FetchReply(
                    meta, DataPosition(self.loader.epoch, self.loader.n_used, len(self.loader))
                )
            elif h in MFC_HANDLES:
                out = self._mfc(d)
            elif h is Handle.EVALUATE:
                out = EvalReply(f"model_worker/{self.rank}", {"accuracy": 0.5}, 3, 0.0, 0.0)
            elif h is Handle.CHECKPOINT:
                try:
                    out = recover.save_worker_state(d.dir, self.rank, {}, self.loader.state_dict())
                except recover.RecoverError as e:  # replied, as a real model worker does
                    server.reply_error(req, e)
                    continue
            elif h in (Handle.SAVE, Handle.CLEAR_DATA_CACHE, Handle.MODEL_VERSION):
                out = None
            elif h is Handle.EXIT:
                server.reply(req, None)
                server.close()
                return
            else:
                raise ValueError(h)
            server.reply(req, out)

    def _mfc(self, req):
        mfc = self.mfcs[req.mfc_name]
        ids = req.meta.ids
        assert ids, "every rank gets items"
        self.plan_steps.extend(req.plan)
        for step in req.plan:  # apply the plan: only the receiver records the copy
            if step.dst == self.rank:
                for i in step.ids:
                    assert (i, step.key) in self.held[step.src], (step, self.rank)
                    self.held[self.rank].add((i, step.key))
        for i in ids:
            for k in mfc.input_keys:
                assert (i, k) in self.held[self.rank], (
                    f"rank {self.rank} lacks {k} of {i} for {mfc.name}"
                )
        self.calls.append((mfc.name, self.rank, req.step.global_step, tuple(ids)))
        self.call_indices.append((mfc.name, req.step.global_step, req.call))
        out = None
        lens = req.meta.seqlens[mfc.input_keys[0]]
        if mfc.drops_items:  # keeps the items q<i> with i % 3 != 0
            lens = [n for i, n in zip(ids, lens) if int(i[1:]) % 3]
            ids = [i for i in ids if int(i[1:]) % 3]
        if mfc.output_keys and ids:
            out = SequenceSample(
                keys=set(mfc.output_keys),
                trailing_shapes={k: () for k in mfc.output_keys},
                dtypes={k: torch.float32 for k in mfc.output_keys},
                ids=list(ids),
                seqlens={k: lens for k in mfc.output_keys},
                data=None,
            )
            for i in ids:
                for k in mfc.output_keys:
                    self.held[self.rank].add((i, k))
        return MFCReply(
            f"model_worker/{self.rank}", mfc.name, out, {"n": float(len(ids))}, 1.0, 2.0
        )


def _mfcs(bs_a: int, bs_b: int):
    return [
        MFCDef(
            "gen",
            "actor",
            "generate",
            "g",
            n_seqs=bs_a,
            input_keys=["packed_prompts"],
            output_keys=["seq"],
        ),
        MFCDef(
            "score", "ref", "inference", "s", n_seqs=bs_b, input_keys=["seq"], output_keys=["score"]
        ),
        MFCDef(
            "train",
            "actor",
            "train_step",
            "t",
            n_seqs=bs_a,
            input_keys=["seq", "score", "packed_prompts"],
        ),
    ]


def _master_config(world, n_items, bs, epochs, **kw):
    mfcs = _mfcs(bs, kw.pop("n_seqs_b", bs))
    if kw.pop("score_drops", False):
        mfcs[1].drops_items = True
    return MasterWorkerConfig(
        seed=1,
        mfcs=mfcs,
        n_model_workers=world,
        train_batch_size=bs,
        ft_spec=FinetuneSpec(epochs, n_items, bs),
        timeout=20.0,
        plot_curves=False,
        exp_ctrl=ExperimentControlConfig(total_train_epochs=epochs, **kw.pop("ctl", {})),
        **kw,
    )


@pytest.fixture
def run_env(tmp_path, memory_name_resolve, trial):
    constants.clear_experiment_trial_names()
    constants.set_experiment_trial_names(EXP, trial)
    constants.set_fileroot(str(tmp_path))
    yield trial
    constants.clear_experiment_trial_names()
    constants.set_fileroot(None)


def _shard(layout, rank, n_items):
    """``(shard, n_items)`` of ``rank`` in ``layout``: the head (pipe 0, tensor 0: the first
    rank of each block of p·m) of replica k loads shard k of d, the other ranks nothing."""
    per_replica = layout.pipe * layout.tensor
    head = rank % per_replica == 0
    return dict(shard=(rank // per_replica, layout.data), n_items=n_items if head else 0)


def _run_master(trial, cfg, n_items, stop_after=None, held=None, calls=None):
    """Run a master and stand-ins; returns (master, calls, stand-ins)."""
    held = held if held is not None else {r: set() for r in range(cfg.n_model_workers)}
    calls = calls if calls is not None else []
    workers = [
        StandIn(
            trial,
            r,
            cfg.n_model_workers,
            mfcs=cfg.mfcs,
            held=held,
            calls=calls,
            **_shard(cfg.layout, r, n_items),
        )
        for r in range(cfg.n_model_workers)
    ]
    master = MasterWorker(EXP, trial, "master_worker", 0)
    master.handle_control(
        "configure", worker_info=WorkerInformation(EXP, trial, "master_worker", 0, 1), config=cfg
    )
    for w in workers:
        w.start()
    master.handle_control("start")

    async def drive():
        while master.status == WorkerStatus.RUNNING:
            await master.step_async()
            if stop_after is not None and master.started and master.step.global_step >= stop_after:
                return

    try:
        asyncio.run(asyncio.wait_for(drive(), 60))
    finally:
        master._exit_hook()
    return master, calls, workers


def _metrics(tmp_path, trial):
    with open(tmp_path / EXP / trial / "metrics.jsonl") as f:
        return [json.loads(l) for l in f]


def test_every_item_goes_through_every_mfc_once_per_epoch(tmp_path, run_env):
    trial = run_env
    # 14 items, batches of 6: steps of 6, 6 and 2 items per epoch; "score" calls 3 at a time.
    cfg = _master_config(2, 14, 6, 2, n_seqs_b=3, ctl={"eval_freq_steps": 3}, eval=True)
    master, calls, workers = _run_master(trial, cfg, 14)
    assert master.status == WorkerStatus.COMPLETED, master.status
    assert all(w.error is None for w in workers), [w.error for w in workers]
    records = _metrics(tmp_path, trial)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["n_items"] for r in records] == [6, 6, 2] * 2
    assert [r["epoch"] for r in records] == [1, 1, 1, 2, 2, 2]
    assert [r["epoch_step"] for r in records] == [1, 2, 3] * 2
    assert [("eval/accuracy" in r) for r in records] == [False, False, True, False, False, True]
    for name in ("gen", "score", "train"):
        for epoch_steps in ((0, 1, 2), (3, 4, 5)):
            ids = [i for (n, _, s, c) in calls if n == name and s in epoch_steps for i in c]
            assert sorted(ids) == sorted(f"q{i}" for i in range(14)), (name, epoch_steps)
    # "score" ran in calls of 3 items (split 2 + 1 over the ranks), 2 calls for a full step.
    score_step0 = [c for (n, r, s, c) in calls if n == "score" and s == 0]
    assert sorted(len(c) for c in score_step0) == [1, 1, 2, 2]
    assert sorted(set(i for i in workers[0].call_indices if i[:2] == ("score", 0))) == [
        ("score", 0, 0),
        ("score", 0, 1),
    ]
    assert records[0]["score/n"] == 1.5 and records[0]["gen/n"] == 3.0
    trace = json.load(open(tmp_path / EXP / trial / "trace.json"))
    xs = [e for e in trace if e["ph"] == "X" and e["name"] == "train"]
    assert len(xs) == 6 * 2 and {e["pid"] for e in xs} == {1, 2}
    assert name_resolve.get(names.training_samples(EXP, trial)) == "28"
    assert os.listdir(tmp_path / EXP / trial / "tensorboard")


def test_dynamic_sampling_refills_the_batch_with_new_items(tmp_path, run_env):
    trial = run_env
    # "score" drops q<i> with i % 3 == 0 (a third of the items); steps of 6 items over 2
    # replicas; 30 items per epoch.
    cfg = _master_config(2, 30, 6, 2, score_drops=True, max_fill_rounds=4, ctl={})
    master, calls, workers = _run_master(trial, cfg, 30)
    assert master.status == WorkerStatus.COMPLETED, master.status
    assert all(w.error is None for w in workers), [w.error for w in workers]
    records = _metrics(tmp_path, trial)
    gen = [(s, i) for (n, _, s, c) in calls if n == "gen" for i in c]
    score = [(s, i) for (n, _, s, c) in calls if n == "score" for i in c]
    train = [(s, i) for (n, _, s, c) in calls if n == "train" for i in c]
    assert sorted(gen) == sorted(score)  # the fill phase ran on every fetched item
    assert all(int(i[1:]) % 3 for _, i in train)  # no dropped item is trained
    for r in records:
        step = r["step"] - 1
        trained = [i for s, i in train if s == step]
        fetched = [i for s, i in gen if s == step]
        kept = [i for i in fetched if int(i[1:]) % 3]
        assert len(set(trained)) == len(trained) == r["n_items"] == r["dynamic_sampling/kept"]
        assert set(trained) <= set(kept)
        # an epoch's last item cannot be split over the 2 replicas: fetched and skipped
        assert r["dynamic_sampling/skipped"] in (0, 1)
        assert r["dynamic_sampling/fetched"] == len(fetched) + r["dynamic_sampling/skipped"]
        assert r["dynamic_sampling/surplus"] == len(kept) - len(trained)
        last_of_epoch = r is records[-1] or records[step + 1]["epoch"] != r["epoch"]
        if r["dynamic_sampling/rounds"] < 4 and not last_of_epoch:
            assert len(trained) == 6  # refilled: a full batch whenever rounds and data allow
    assert max(r["dynamic_sampling/rounds"] for r in records) >= 2
    assert [r["epoch"] for r in records] == [1] * 4 + [2] * 3 + [3] * 3
    # Per epoch (the steps until the 30 items ran out) every item was fetched at most once,
    # and everything fetched was cleared.
    epochs = {r["step"] - 1: r["epoch"] for r in records}
    for e in (1, 2):
        ids = [i for s, i in gen if epochs[s] == e]
        assert len(ids) == len(set(ids))
    assert len(master.runner.buffer) == 0


def test_resume_continues_from_the_checkpoint_exactly(tmp_path, run_env):
    trial = run_env
    cfg = _master_config(2, 10, 4, 2, ctl={"ckpt_freq_steps": 2}, recover_mode="auto")
    # steps/epoch = 3 (4, 4, 2); the first run "dies" after step 5 (checkpoints at 2 and 4).
    held, calls = {0: set(), 1: set()}, []
    master, _, workers = _run_master(trial, cfg, 10, stop_after=5, held=held, calls=calls)
    for w in workers:  # the stand-ins were left waiting, like orphaned processes
        assert w.error is None
        w.stop.set()
    root = recover.recover_root(None)
    assert recover.find_latest(root).endswith("step4")
    assert sorted(os.listdir(root)) == ["latest", "step4"]
    held2, calls2 = {0: set(), 1: set()}, []
    master2, _, workers2 = _run_master(trial, cfg, 10, held=held2, calls=calls2)
    assert master2.status == WorkerStatus.COMPLETED
    assert all(w.error is None for w in workers2), [w.error for w in workers2]
    records = _metrics(tmp_path, trial)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # step 5 of the dead run dropped
    # Steps 5 and 6 of the resumed run use exactly the items the first run left in epoch 2.
    first = [i for (n, _, s, c) in calls if n == "train" and s in (3,) for i in c]
    resumed = [i for (n, _, s, c) in calls2 if n == "train" and s in (4, 5) for i in c]
    assert min(s for (_, _, s, _) in calls2) == 4
    assert sorted(first + resumed) == sorted(f"q{i}" for i in range(10))
    # The dead run's step 5 (index 4) drew the same items as the resumed one.
    dead5 = sorted(i for (n, _, s, c) in calls if n == "train" and s == 4 for i in c)
    assert dead5 == sorted(i for (n, _, s, c) in calls2 if n == "train" and s == 4 for i in c)


def test_resume_from_a_checkpoint_at_an_epoch_boundary(tmp_path, run_env):
    trial = run_env
    # 3 steps per epoch and a checkpoint every 3 steps: the checkpoint of step 3 is taken
    # when every shard is used up but the loaders have not moved to epoch 2 yet.
    cfg = _master_config(2, 10, 4, 2, ctl={"ckpt_freq_steps": 3}, recover_mode="auto")
    calls = []
    _, _, workers = _run_master(trial, cfg, 10, stop_after=4, calls=calls)
    for w in workers:
        w.stop.set()
    assert recover.find_latest(recover.recover_root(None)).endswith("step3")
    calls2 = []
    master2, _, workers2 = _run_master(trial, cfg, 10, calls=calls2)
    assert master2.status == WorkerStatus.COMPLETED
    assert all(w.error is None for w in workers2), [w.error for w in workers2]
    assert [r["step"] for r in _metrics(tmp_path, trial)] == [1, 2, 3, 4, 5, 6]
    epoch2 = sorted(i for (n, _, s, c) in calls2 if n == "train" for i in c)
    assert epoch2 == sorted(f"q{i}" for i in range(10))
    assert sorted(i for (n, _, s, c) in calls if n == "train" and s == 3 for i in c) == sorted(
        i for (n, _, s, c) in calls2 if n == "train" and s == 3 for i in c
    )


def test_resume_mode_without_a_checkpoint_fails(tmp_path, run_env):
    trial = run_env
    cfg = _master_config(2, 8, 4, 1, recover_mode="resume")
    master, _, workers = _run_master(trial, cfg, 8)
    assert master.status == WorkerStatus.ERROR
    from realhf.system.worker.base import read_error

    assert (
        "holds no complete recover checkpoint" in read_error(EXP, trial, "master_worker/0").message
    )


def test_config_rejects_calls_smaller_than_the_dp_degree():
    with pytest.raises(ValueError, match="would get a call of 1 item"):
        _master_config(2, 9, 4, 1)  # the last step of an epoch holds 1 item
    with pytest.raises(ValueError, match="n_seqs=8 items per call, more than a step holds"):
        _master_config(2, 8, 4, 1, n_seqs_b=8)


def test_layout_splits_calls_over_replicas_and_fetches_from_heads(tmp_path, run_env):
    trial = run_env
    # d2p1m2: replica 0 = ranks 0, 1 and replica 1 = ranks 2, 3 (heads 0 and 2); 12 items,
    # steps of 6, "score" 3 items at a time (split 2 + 1 over the replicas).
    cfg = _master_config(4, 12, 6, 2, n_seqs_b=3, layout=ParallelismConfig(2, 1, 2))
    master, calls, workers = _run_master(trial, cfg, 12)
    assert master.status == WorkerStatus.COMPLETED, master.status
    assert all(w.error is None for w in workers), [w.error for w in workers]
    assert [w.fetched > 0 for w in workers] == [True, False, True, False]
    # Per call: the ranks of a replica got the same items, the two replicas disjoint parts.
    per_call: Dict[tuple, Dict[int, tuple]] = {}
    seen: Dict[tuple, int] = {}
    for name, rank, step, ids in calls:
        k = seen[(name, rank, step)] = seen.get((name, rank, step), -1) + 1
        per_call.setdefault((name, step, k), {})[rank] = ids
    assert len(per_call) == 2 * 2 * (1 + 2 + 1)  # 2 epochs x 2 steps x (gen, score x 2, train)
    for key, by_rank in per_call.items():
        assert sorted(by_rank) == [0, 1, 2, 3], key
        assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3], key
        assert not set(by_rank[0]) & set(by_rank[2]), key
    for name in ("gen", "score", "train"):
        for epoch_steps in ((0, 1), (2, 3)):
            ids = [
                i
                for (n, r, s, c) in calls
                if n == name and r in (0, 2) and s in epoch_steps
                for i in c
            ]
            assert sorted(ids) == sorted(f"q{i}" for i in range(12)), (name, epoch_steps)
    # Outputs are held by every rank of the replica that computed them: they only ever
    # move between replicas; dataset items move from a head to its replica's peers too.
    replica = [0, 0, 1, 1]
    for w in workers:
        for st in w.plan_steps:
            if st.key != "packed_prompts":
                assert replica[st.src] != replica[st.dst], st.describe()
    records = _metrics(tmp_path, trial)
    assert [r["n_items"] for r in records] == [6, 6, 6, 6]
    assert records[0]["score/n"] == 1.5 and records[0]["gen/n"] == 3.0  # per replica


def test_resume_refuses_a_checkpoint_of_another_layout(tmp_path, run_env):
    from realhf.system.worker.base import read_error

    trial = run_env
    kw = dict(ctl={"ckpt_freq_steps": 1}, recover_mode="auto")
    cfg = _master_config(2, 8, 4, 2, layout=ParallelismConfig(1, 1, 2), **kw)
    _, _, workers = _run_master(trial, cfg, 8, stop_after=2)
    for w in workers:
        w.stop.set()
    assert recover.find_latest(recover.recover_root(None)).endswith("step2")
    master, _, workers = _run_master(trial, _master_config(2, 8, 4, 2, **kw), 8)  # d2p1m1
    for w in workers:
        w.stop.set()
    assert master.status == WorkerStatus.ERROR
    msg = read_error(EXP, trial, "master_worker/0").message
    assert "was written by trainer layout d1p1m2, this run has layout d2p1m1" in msg
    assert "run with d1p1m2 or delete the checkpoint" in msg


def test_config_rejects_a_layout_that_does_not_span_the_workers():
    with pytest.raises(
        ValueError,
        match=r"layout='d1p1m2': the layout spans d·p·m = 2 model workers but n_model_workers=4",
    ):
        _master_config(4, 8, 4, 1, layout=ParallelismConfig(1, 1, 2))
    # Calls must cover the data-parallel degree d, not d·p·m: a last step of 1 item is fine.
    _master_config(4, 9, 4, 1, layout=ParallelismConfig(1, 2, 2))
    with pytest.raises(ValueError, match="a call of 1 item.s. for 2 data-parallel ranks"):
        _master_config(4, 9, 4, 1, layout=ParallelismConfig(2, 1, 2))


def test_a_full_disk_at_a_checkpoint_fails_the_run_and_keeps_the_last_one(
    tmp_path, run_env, monkeypatch
):
    from file_faults import small_filesystem

    from realhf.system.worker.base import read_error

    class _Payload:  # 0.75 MiB in step 1's checkpoint, 3 MiB in step 2's: does not fit
        def __init__(self, step):
            self.step = step

        def state_dict(self):
            return {"x": torch.zeros(self.step**2 * (3 << 16))}

        def load_state_dict(self, state):
            pass

    real_save = recover.save_worker_state

    def save_with_payload(ckpt_dir, rank, trainable, loader_state):
        step = int(os.path.basename(ckpt_dir)[len("step") : -len(".tmp")])
        return real_save(ckpt_dir, rank, trainable, loader_state, {"big": _Payload(step)})

    monkeypatch.setattr(recover, "save_worker_state", save_with_payload)
    trial = run_env
    root = tmp_path / "recover"
    cfg = _master_config(2, 8, 2, 1, ctl={"ckpt_freq_steps": 1}, recover_dir=str(root))
    with small_filesystem(root, 2 << 20):
        master, _, workers = _run_master(trial, cfg, 8)
        for w in workers:
            w.stop.set()
        assert master.status == WorkerStatus.ERROR
        msg = read_error(EXP, trial, "master_worker/0").message
        assert f"no space left for recover checkpoint {root}/step2.tmp" in msg
        assert sorted(os.listdir(root)) == ["latest", "step1"]  # the partial one is gone
        assert recover.find_latest(str(root)) == str(root / "step1")
