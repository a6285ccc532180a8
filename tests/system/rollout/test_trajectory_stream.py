"""The trainer's trajectory stream: index order, exact batches, staleness check, recovery state."""

from __future__ import annotations

import json

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.rollout_api import GroupGeneration, Trajectory
from realhf.api.core.worker_api import TrajectoryStreamSpec
from realhf.base.storage import recover
from realhf.impl.agent.math_single_step import build_trajectory
from realhf.system.rollout.trajectory_stream import (
    StalenessViolation,
    TrajectoryStreamLoader,
    rollout_position,
)
from realhf.system.transport.push_pull import PusherStream


def _prompt(qid: str) -> SequenceSample:
    ids = torch.tensor([3, 4, 5])
    return SequenceSample(
        keys={"packed_prompts"},
        trailing_shapes={"packed_prompts": ()},
        dtypes={"packed_prompts": torch.long},
        ids=[qid],
        seqlens={"packed_prompts": [[3]]},
        data={"packed_prompts": ids},
        metadata={"query_id": [qid]},
    )


def _traj(
    index: int, v0: int = 0, v1: int = 0, worker: str = "rollout_worker/0", epoch: int = 0
) -> Trajectory:
    qid = f"q{index}"
    gen = GroupGeneration(
        qid, (3, 4, 5), ((6, 7), (8,)), ((-0.5, -0.25), (-1.0,)), (False, True), (v0, v0), (v1, v1)
    )
    return Trajectory(
        index,
        build_trajectory(_prompt(qid), gen, [5.0, -5.0]),
        f"r{index}",
        worker,
        data_epoch=epoch,
    )


@pytest.fixture
def stream(memory_name_resolve, trial, tmp_path):
    made = []

    def make(B=2, eta=1, epoch_size=4, rank=0, timeout=5.0):
        spec = TrajectoryStreamSpec(
            epoch_size=epoch_size, batch_size=B, max_head_offpolicyness=eta, wait_timeout_s=timeout
        )
        loader = TrajectoryStreamLoader(
            spec, "exp", trial, rank, log_path=str(tmp_path / "traj.jsonl")
        )
        made.append(loader)
        if rank != 0:
            return loader, None
        pusher = PusherStream("exp", trial, "rollout", 0, 1, 1, connect_timeout=5)
        made.append(pusher)
        return loader, pusher

    yield make
    for x in made:
        x.close()


def test_batches_are_released_in_index_order_exactly_b_at_a_time(stream, tmp_path):
    loader, pusher = stream(B=2, eta=1, epoch_size=4)
    for i in (1, 3, 0, 2):  # any arrival order
        pusher.push(_traj(i, v0=0 if i < 2 else 1, epoch=0), timeout=5)
    first = loader.take(0, 2)
    assert [s.ids[0] for s in first] == ["q0#0", "q1#1"]
    assert first[0].metadata["index"] == [0] and "rewards" in first[0].keys
    st = loader.take_stats()
    assert st["rollout/staleness_max"] == 0 and st["rollout/reward"] == 0.0
    second = loader.take(0, 2)
    assert [s.ids[0] for s in second] == ["q2#2", "q3#3"]
    assert loader.take_stats()["rollout/staleness_max"] == 0  # version 1 trained at step 1
    assert loader.remaining == 0 and loader.next_index == 4
    with pytest.raises(ValueError, match="exactly batch_size=2"):
        loader.take(1, 1)
    lines = [json.loads(l) for l in open(tmp_path / "traj.jsonl")]
    assert [(r["step"], r["indices"], r["trained_version"]) for r in lines] == [
        (1, [0, 1], 0),
        (2, [2, 3], 1),
    ]
    assert (
        lines[1]["version_start"] == [[1, 1], [1, 1]]
        and lines[0]["workers"] == ["rollout_worker/0"] * 2
    )


def test_a_missing_index_times_out_naming_it(stream):
    loader, pusher = stream(B=2, timeout=1.0)
    pusher.push(_traj(1), timeout=5)
    with pytest.raises(
        TimeoutError, match=r"trajectories \[0\.\.0\] of step 0 \(1 later ones arrived\)"
    ):
        loader.take(0, 2)


def test_a_too_stale_trajectory_stops_the_run(stream):
    loader, pusher = stream(B=1, eta=1, epoch_size=4)
    for i in range(3):
        pusher.push(_traj(i, v0=0), timeout=5)
    loader.take(0, 1)  # step 0 trains version-0 data: staleness 0
    loader.take(0, 1)  # step 1: staleness 1 = eta
    with pytest.raises(StalenessViolation, match="staleness 2 > max_head_offpolicyness=1"):
        loader.take(0, 1)


def test_state_round_trip_keeps_position_and_trained_prompts(stream, tmp_path):
    loader, pusher = stream(B=2, eta=4, epoch_size=4)
    for i, (w, e) in enumerate([("rw/0", 0), ("rw/1", 0), ("rw/0", 1), ("rw/0", 1)]):
        pusher.push(_traj(i, worker=w, epoch=e), timeout=5)
    loader.take(0, 2)
    loader.take(0, 2)
    state = loader.state_dict()
    assert state["next_index"] == 4 and state["epoch"] == 0 and state["n_used"] == 4
    # rw/0 moved on to its epoch 1: only the prompts of that epoch are kept
    assert state["rollout_positions"] == {
        "rw/0": {"epoch": 1, "used_ids": ["q2", "q3"]},
        "rw/1": {"epoch": 0, "used_ids": ["q1"]},
    }
    ckpt = tmp_path / "ckpt"
    recover.save_worker_state(str(ckpt), 0, {}, state)
    assert rollout_position(str(ckpt), "rw/1") == {"epoch": 0, "used_ids": ["q1"]}
    assert rollout_position(str(ckpt), "rw/9") is None

    again, _ = stream(B=2, eta=4, epoch_size=4, rank=1)  # shard size 0: wrong state
    with pytest.raises(ValueError, match="not a trajectory stream of epoch size 0"):
        again.load_state_dict(state)
    resumed = TrajectoryStreamLoader(loader.spec, "exp", "other", 3)
    resumed.size = 4  # as rank 0 would have it, without binding a second puller
    resumed.load_state_dict(state)
    assert resumed.next_index == 4 and resumed.remaining == 0
    assert resumed.take(1, 0) == [] and resumed.epoch == 1  # the epoch moves on when asked


def test_other_ranks_hold_nothing_and_follow_epochs(stream):
    loader, _ = stream(rank=1, epoch_size=4)
    assert len(loader) == 0 and loader.puller is None
    assert loader.take(0, 0) == [] and loader.take(1, 0) == [] and loader.epoch == 1
    with pytest.raises(RuntimeError, match="only model worker 0 pulls"):
        loader.take(1, 2)


def test_spec_validation():
    with pytest.raises(ValueError, match="multiple of batch_size=3"):
        TrajectoryStreamSpec(epoch_size=10, batch_size=3)
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        TrajectoryStreamSpec(epoch_size=3, batch_size=3, max_head_offpolicyness=-1)
