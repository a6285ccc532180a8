"""Exact staleness: the bound holds for every trajectory, and nothing is refused needlessly.

A discrete-event simulation drives a :class:`StalenessController` with many concurrent
rollouts of random length (some interrupted by weight updates, some filtered out), a
trainer that consumes ``B`` trajectories per step in index order and bumps the version,
and servers that pick up each new version after a random lag.  Every refusal and every
hold is checked against an independent brute-force argument that it was necessary.
"""

from __future__ import annotations

import random

import pytest

from realhf.base import name_resolve, names
from realhf.system.rollout.staleness import (
    IndexOrderBatcher,
    NameResolveProgress,
    RolloutNotRunning,
    StalenessController,
    TrainerProgress,
)


def _late_if_all_accepted(accepted: int, B: int, deadlines) -> bool:
    """Whether accepting ``deadlines`` in EDF order from index ``accepted`` misses one."""
    for k, d in enumerate(sorted(deadlines)):
        if (accepted + k) // B > d:
            return True
    return False


def simulate(
    eta: int,
    B: int,
    *,
    cap: int,
    ticks: int,
    seed: int,
    reject_p: float = 0.1,
    lose_p: float = 0.0,
):
    """``lose_p``: chance that an accepted trajectory never arrives (its worker died after
    taking the index); the trainer's missing indices are then reissued, and some lost ones
    still arrive late (a second copy of the index)."""
    rng = random.Random(seed)
    lost = {}  # index -> record that never arrived
    late = []  # (tick, index, record): copies that arrive after their index was reissued
    ctl = StalenessController(B, eta, cap)
    batcher: IndexOrderBatcher = IndexOrderBatcher(B)
    served = 0  # version the servers run
    trainer_version = 0  # published by the trainer
    update_at = None  # tick when the servers pick up trainer_version
    running = {}  # rollout_id -> dict(admission, remaining ticks, version_start, version_end)
    finished_wait = {}  # held: rollout_id -> record
    trained = []  # (trained_version, version_start, version_end, deadline)
    n_interrupted = n_held = n_refused = n_rejected = n_duplicates = 0
    for tick in range(ticks):
        # servers pick up a published version after a lag (interrupts running rollouts)
        if update_at is not None and tick >= update_at:
            served = trainer_version
            update_at = None
            for r in running.values():
                if r["version_start"] is not None and r["left"] > 0:
                    n_interrupted += 1
        # many workers ask for slots; each refusal must be necessary
        for _ in range(rng.randint(0, 6)):
            a = ctl.admit(served, owner=f"w{rng.randint(0, 3)}")
            if a is None:
                n_refused += 1
                n_running = len(running) + len(finished_wait)
                assert (
                    n_running >= cap
                    or ctl.holes
                    or _late_if_all_accepted(
                        ctl.accepted_total,
                        B,
                        [r["adm"].deadline for r in running.values()]
                        + [r["adm"].deadline for r in finished_wait.values()]
                        + [served + eta],
                    )
                )
                break
            running[a.rollout_id] = {"adm": a, "left": rng.randint(1, 12), "version_start": None}
        # rollouts generate: first chunk fixes version_start, the last one version_end
        for rid in list(running):
            r = running[rid]
            if r["version_start"] is None and rng.random() < 0.7:
                r["version_start"] = served
            if r["version_start"] is None:
                continue
            r["left"] -= 1
            r["version_end"] = served
            if r["left"] <= 0:
                del running[rid]
                if rng.random() < reject_p:
                    ctl.reject(rid)
                    n_rejected += 1
                else:
                    finished_wait[rid] = r
        # hand finished rollouts on; a hold must be necessary
        for rid in sorted(finished_wait, key=lambda _: rng.random()):
            r = finished_wait[rid]
            others = [x["adm"].deadline for x in running.values()] + [
                x["adm"].deadline for k, x in finished_wait.items() if k != rid
            ]
            holes = ctl.holes
            idx = ctl.accept(rid)
            if idx is None:
                n_held += 1
                assert holes or _late_if_all_accepted(
                    ctl.accepted_total + 1, B, [d for d in others if d < r["adm"].deadline]
                )
                continue
            del finished_wait[rid]
            if rng.random() < lose_p:
                lost[idx] = r
                continue
            batcher.add(idx, r)
        # the trainer reports what its next batch misses; the lost ones are reissued
        for k in batcher.missing():
            if k in lost:
                r = lost.pop(k)
                assert ctl.reissue(k) and not ctl.reissue(k)
                if rng.random() < 0.5:
                    late.append((tick + rng.randint(0, 4), k, r))
        for item in [x for x in late if x[0] <= tick]:
            late.remove(item)
            n_duplicates += not batcher.add(item[1], item[2])
        # the trainer consumes one batch per tick at most, in index order
        batch = batcher.pop_batch()
        if batch is not None:
            step = trainer_version
            for r in batch:
                trained.append((step, r["version_start"], r["version_end"], r["adm"].deadline))
            trainer_version += 1
            update_at = tick + rng.randint(0, 3)
    return dict(
        trained=trained,
        steps=trainer_version,
        interrupted=n_interrupted,
        held=n_held,
        refused=n_refused,
        rejected=n_rejected,
        duplicates=n_duplicates,
        ctl=ctl,
    )


@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_trajectory_is_trained_too_stale(eta, seed):
    B = 8
    res = simulate(eta, B, cap=64, ticks=600, seed=seed)
    assert res["steps"] > 20 and res["rejected"] > 0
    # with eta = 0 every rollout of step v finishes before step v trains, so none is interrupted
    assert (res["interrupted"] > 0) == (eta > 0)
    for step, v_start, v_end, deadline in res["trained"]:
        assert step - v_start <= eta, (step, v_start, eta)
        assert step <= deadline and v_start <= v_end <= step
    # the bound is reached: with eta > 0 some trajectories are trained exactly eta versions late
    worst = max(step - v_start for step, v_start, _, _ in res["trained"])
    assert worst == eta or eta == 0


@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_lost_deliveries_are_reissued_within_the_bound(eta, seed):
    B = 8
    res = simulate(eta, B, cap=64, ticks=600, seed=seed, lose_p=0.05)
    ctl = res["ctl"]
    assert res["steps"] > 20, "training stalls on lost indices"
    assert ctl.stats["reissued"] > 5 and ctl.stats["filled_holes"] >= ctl.stats["reissued"] - 1
    assert res["duplicates"] > 0  # late copies of reissued indices were dropped, not trained
    for step, v_start, v_end, deadline in res["trained"]:
        assert step - v_start <= eta, (step, v_start, eta)
        assert step <= deadline and v_start <= v_end <= step
    assert len(res["trained"]) == B * res["steps"]


def test_reissued_index_goes_to_the_next_acceptance():
    ctl = StalenessController(2, 1, 8)
    a = [ctl.admit(0, "w") for _ in range(4)]
    assert [ctl.accept(x.rollout_id) for x in a[:3]] == [0, 1, 2]
    assert not ctl.reissue(3) and not ctl.reissue(-1)  # never given out
    # B(v+η+1) = 4 indices may be trained by step 1: 3 accepted, 1 running
    assert ctl.capacity(0) == 0
    assert ctl.reissue(1) and ctl.holes == [1]
    assert ctl.capacity(0) == 1  # the hole is free again
    assert ctl.accept(a[3].rollout_id) == 1 and ctl.holes == [] and ctl.accepted_total == 3


def test_more_offpolicyness_means_more_throughput():
    steps = [simulate(eta, 8, cap=64, ticks=400, seed=3)["steps"] for eta in (0, 1, 4)]
    assert steps[0] < steps[1] < steps[2], steps


def test_the_originals_counterexample_is_held_not_trained_late():
    """B=2, eta=1: version-1 rollouts finishing first must not push version-0 ones to step 2."""
    ctl = StalenessController(2, 1, 100)
    olds = [ctl.admit(0, "w") for _ in range(4)]
    assert ctl.admit(0, "w") is None and ctl.refusal(0) == "staleness"
    assert [ctl.accept(a.rollout_id) for a in olds[:2]] == [0, 1]  # trained by step 0 -> version 1
    news = [ctl.admit(1, "w") for _ in range(2)]
    assert all(news) and ctl.admit(1, "w") is None
    assert ctl.accept(news[0].rollout_id) is None  # would take index 2 = step 1, needed by olds
    assert not ctl.can_accept(news[1].rollout_id)
    assert ctl.accept(olds[2].rollout_id) == 2
    assert ctl.accept(news[0].rollout_id) is None  # index 3 is still needed by olds[3]
    ctl.reject(olds[3].rollout_id)  # filtered out: frees its slot and the hold
    assert ctl.accept(news[0].rollout_id) == 3 and ctl.accept(news[1].rollout_id) == 4
    assert 4 // 2 <= news[1].deadline


def test_rejection_releases_the_slot_and_concurrency_cap():
    ctl = StalenessController(4, 0, 3)
    a = [ctl.admit(0, "w") for _ in range(3)]
    assert ctl.admit(0, "w") is None and ctl.refusal(0) == "capacity" and ctl.capacity(0) == 0
    ctl.reject(a[0].rollout_id)
    assert ctl.capacity(0) == 1 and ctl.admit(0, "w") is not None
    with pytest.raises(RolloutNotRunning, match="not running"):
        ctl.accept(a[0].rollout_id)


def test_release_owner_frees_only_that_owners_slots():
    ctl = StalenessController(10, 0, 10)
    mine = [ctl.admit(0, "dead").rollout_id for _ in range(3)]
    theirs = ctl.admit(0, "alive").rollout_id
    assert sorted(ctl.release_owner("dead")) == sorted(mine)
    assert ctl.running == 1 and ctl.is_running(theirs) and ctl.stats["released"] == 3


def test_state_dict_round_trip_resets_to_the_trainers_count():
    ctl = StalenessController(4, 1, 16)
    ids = [ctl.admit(0, "w").rollout_id for _ in range(6)]
    for r in ids[:5]:
        ctl.accept(r)
    state = ctl.state_dict()
    assert state["accepted_total"] == 5
    new = StalenessController(4, 1, 16)
    new.load_state_dict(state, trained_samples=4)  # one accepted trajectory was never trained
    assert new.accepted_total == 4 and new.running == 0 and new.stats["accepted"] == 5
    with pytest.raises(RolloutNotRunning):  # rollouts of the old run are gone
        new.accept(ids[5])
    assert new.capacity(1) == 4 * 3 - 4
    with pytest.raises(ValueError, match="train_batch_size"):
        StalenessController(8, 1, 16).load_state_dict(state, 4)


def test_index_order_batcher():
    b = IndexOrderBatcher(3, start_index=6)
    for i in (8, 6):
        b.add(i, f"t{i}")
    assert b.pop_batch() is None and b.missing() == [7]
    b.add(9, "t9")
    b.add(7, "t7")
    assert b.pop_batch() == ["t6", "t7", "t8"] and b.next_index == 9
    # a second copy of an index (reissued after its worker died, and the original still
    # arrived) is dropped: the first arrival wins
    assert b.add(7, "again") is False and b.add(10, "t10") and b.add(10, "copy") is False
    assert b.duplicates == 2 and b.missing() == [11]


def test_name_resolve_progress(memory_name_resolve, trial):
    p = NameResolveProgress("exp", trial, "actor")
    assert isinstance(p, TrainerProgress)
    assert p.version() == 0 and p.trained_samples() == 0
    name_resolve.add(names.model_version("exp", trial, "actor"), "3")
    name_resolve.add(names.training_samples("exp", trial), "24")
    assert p.version() == 3 and p.trained_samples() == 24
    name_resolve.add(names.training_samples("exp", trial), "x", replace=True)
    with pytest.raises(ValueError, match="not an integer"):
        p.trained_samples()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_head_offpolicyness=-1"):
        StalenessController(4, -1, 4)
    with pytest.raises(ValueError, match="version=-2"):
        StalenessController(4, 0, 4).admit(-2, "w")
