"""Push/pull streams: grouping maths and real ZMQ sockets (in-memory name_resolve)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from realhf.system.transport.errors import NoMessage, StreamTimeout
from realhf.system.transport.push_pull import (
    EndOfStream,
    PullerStream,
    PusherStream,
    consumers_of,
    grouping,
    producers_of,
)

EXP = "pp"


@dataclasses.dataclass(frozen=True)
class Traj:
    producer: int
    seq: int


@pytest.mark.parametrize("n_producers", range(1, 9))
@pytest.mark.parametrize("n_consumers", range(1, 9))
def test_grouping_is_contiguous_balanced_and_covers_everyone(n_producers, n_consumers):
    groups = grouping(n_producers, n_consumers)
    assert sorted(groups) == list(range(n_consumers))
    assert all(groups[c] for c in groups), "every consumer has a producer"
    for p in range(n_producers):
        cs = consumers_of(p, n_producers, n_consumers)
        assert cs == list(range(cs[0], cs[-1] + 1)), "a producer feeds a contiguous block"
        assert all(p in groups[c] for c in cs)
    if n_producers >= n_consumers:
        flat = [p for c in range(n_consumers) for p in groups[c]]
        assert flat == list(range(n_producers)), "contiguous blocks in order, each producer once"
        sizes = [len(g) for g in groups.values()]
        assert max(sizes) - min(sizes) <= 1
    else:
        assert all(len(g) == 1 for g in groups.values())
        sizes = [len(consumers_of(p, n_producers, n_consumers)) for p in range(n_producers)]
        assert max(sizes) - min(sizes) <= 1


def test_grouping_examples_and_bad_input():
    assert grouping(5, 2) == {0: [0, 1], 1: [2, 3, 4]}
    assert grouping(2, 4) == {0: [0], 1: [0], 2: [1], 3: [1]}
    with pytest.raises(ValueError, match="n_consumers must be a positive int"):
        grouping(3, 0)
    with pytest.raises(ValueError, match="producer_index 3 is out of range"):
        consumers_of(3, 3, 1)
    with pytest.raises(ValueError, match="consumer_index 2 is out of range"):
        producers_of(2, 3, 2)


@pytest.mark.usefixtures("memory_name_resolve")
def test_many_producers_to_many_consumers(trial):
    P, Q, N = 3, 2, 25
    pullers = [PullerStream(EXP, trial, "roll", c, message_types=[Traj]) for c in range(Q)]
    pushers = [PusherStream(EXP, trial, "roll", p, P, Q, connect_timeout=5) for p in range(P)]
    for seq in range(N):
        for p, pusher in enumerate(pushers):
            pusher.push(Traj(p, seq), timeout=5)
    for pusher in pushers:
        pusher.close()
    try:
        for c, puller in enumerate(pullers):
            got = list(puller.iterate(producers_of(c, P, Q), timeout=5))
            assert {m.producer for m in got} == set(producers_of(c, P, Q))
            for p in producers_of(c, P, Q):
                assert [m.seq for m in got if m.producer == p] == list(range(N)), "in order"
            assert {p: e.n_sent for p, e in puller.ended.items()} == {
                p: N for p in producers_of(c, P, Q)
            }
    finally:
        for puller in pullers:
            puller.close()


@pytest.mark.usefixtures("memory_name_resolve")
def test_fewer_producers_round_robin_over_their_consumers(trial):
    pullers = [PullerStream(EXP, trial, "roll", c) for c in range(2)]
    pusher = PusherStream(EXP, trial, "roll", 0, 1, 2, connect_timeout=5)
    for seq in range(6):
        pusher.push(Traj(0, seq))
    pusher.close()
    try:
        got = [[m.seq for m in p.iterate([0], timeout=5)] for p in pullers]
        assert got == [[0, 2, 4], [1, 3, 5]]
        assert [p.ended[0].n_sent for p in pullers] == [3, 3]
    finally:
        for p in pullers:
            p.close()


@pytest.mark.usefixtures("memory_name_resolve")
def test_bounded_buffer_push_times_out_naming_the_consumer(trial):
    puller = PullerStream(EXP, trial, "roll", 0, hwm=1)
    pusher = PusherStream(EXP, trial, "roll", 0, 1, 1, hwm=1, connect_timeout=5)
    blob = b"x" * (4 << 20)  # big messages fill the socket buffers quickly
    try:
        with pytest.raises(StreamTimeout) as ei:
            for _ in range(64):
                pusher.push(blob, timeout=0.2)
        assert "consumer 0" in str(ei.value) and "'roll'" in str(ei.value)
        assert pusher.n_sent < 64
    finally:
        pusher.abort()  # the consumer is not reading: no EndOfStream
        puller.close()


@pytest.mark.usefixtures("memory_name_resolve")
def test_consumer_errors(trial):
    puller = PullerStream(EXP, trial, "roll", 0, message_types=[Traj])
    pusher = PusherStream(EXP, trial, "roll", 0, 1, 1, connect_timeout=5)
    try:
        with pytest.raises(NoMessage):
            puller.pull(timeout=0)
        t0 = time.monotonic()
        with pytest.raises(StreamTimeout, match="no message within 0.2s"):
            puller.pull(timeout=0.2)
        assert time.monotonic() - t0 < 1
        pusher.push({"not": "a Traj"})
        with pytest.raises(TypeError, match="accepts only \\['Traj'\\]"):
            puller.pull(timeout=5)
        with pytest.raises(StreamTimeout, match=r"Producers \[0\] have not finished"):
            list(puller.iterate([0], timeout=0.2))
        pusher.close()
        assert isinstance(puller.pull(timeout=5), EndOfStream)
    finally:
        puller.close()


@pytest.mark.usefixtures("memory_name_resolve")
def test_producer_waits_for_consumer_address_with_timeout(trial):
    with pytest.raises(StreamTimeout, match="consumer 0 did not publish its address"):
        PusherStream(EXP, trial, "nobody", 0, 1, 1, connect_timeout=0.2)
    with pytest.raises(ValueError, match="hwm must be a positive int"):
        PullerStream(EXP, trial, "roll", 0, hwm=0)
