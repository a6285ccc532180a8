"""``weight_sync=broadcast``: the trainer's weight sender and a server's receiver, over real
gloo pairs on loopback (receivers in this process, or in a child process that dies or hangs
mid-transfer)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from rank_processes import fresh_context
from weight_senders import HalfSender, SlowTailSender

from realhf.impl.model.comm import weight_broadcast as wb
from realhf.impl.model.comm.weight_broadcast import (
    WeightReceiver,
    WeightSender,
    WeightsSuperseded,
    WeightSyncError,
)
from realhf.impl.model.nn.flat_param import ParamSpec

N = 300_000  # elements: 19 buckets of 64 KiB in fp32 with the bucket size below
BUCKET = 64 << 10
SPEC = {"a": ParamSpec(0, (1000, 100)), "b": ParamSpec(100_000, (200_000,))}
HOST = "127.0.0.1"


@pytest.fixture
def sender():
    s = WeightSender(host=HOST, timeout=5.0, bucket_bytes=BUCKET)
    yield s
    s.close()


@pytest.fixture
def receiver():
    r = WeightReceiver("test-server", host=HOST)
    yield r
    r.close()


def _weights(seed=0, dtype=torch.float32):
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_a_pulled_version_equals_the_staged_one_and_the_pair_is_reused(sender, receiver):
    w = _weights()
    sender.stage(w, SPEC, 3)
    w.zero_()  # staging copied it: the trainer goes on training its own buffer
    dst = torch.zeros(N)
    assert receiver.receive(sender.address, 3, dst, SPEC, timeout=10) == N * 4
    assert torch.equal(dst, _weights())
    sender.stage(_weights(1), SPEC, 4)
    receiver.receive(sender.address, 4, dst, SPEC, timeout=10)
    assert torch.equal(dst, _weights(1))
    # One pair served both pulls.
    assert sender.wait_transfers(10)
    assert sender.sent == 2 and len(sender._pairs) == 1 and sender.failed == 0


def test_a_pull_answered_while_the_last_transfer_ends_waits_for_it_and_both_count(receiver):
    """CI 2026-11-29: the sender's side of a transfer ended after the server's next pull was
    answered, and that end cleared the pair's busy mark while the next transfer ran (so
    wait_transfers returned with one transfer uncounted).  Transfers on a pair now run one
    after the other and are counted apart."""
    sender = SlowTailSender(host=HOST, timeout=5.0, bucket_bytes=BUCKET)
    try:
        dst = torch.zeros(N)
        sender.stage(_weights(), SPEC, 1)
        receiver.receive(sender.address, 1, dst, SPEC, timeout=10)
        sender.stage(_weights(2), SPEC, 2)
        receiver.receive(sender.address, 2, dst, SPEC, timeout=10)  # the first still ends
        assert torch.equal(dst, _weights(2))
        assert sender._busy_pairs  # the second transfer's end is still to come
        assert sender.wait_transfers(10)
        assert sender.sent == 2 and sender.failed == 0 and not sender._busy_pairs
    finally:
        sender.close()


def test_a_pair_that_stops_pulling_is_dropped_and_its_server_can_come_back(sender, receiver):
    """A replaced server never pulls again: after STALE_PAIR_VERSIONS versions without a
    pull its pair's sockets go; a server that does come back makes a new pair."""
    dst = torch.zeros(N)
    sender.stage(_weights(), SPEC, 1)
    receiver.receive(sender.address, 1, dst, SPEC, timeout=10)
    # The receiver returns once its bytes landed; the sender's side of the transfer ends
    # a moment later, and a pair still in a transfer is never dropped.
    assert sender.wait_transfers(10)
    assert len(sender._pairs) == 1
    for v in range(2, 2 + wb.STALE_PAIR_VERSIONS):
        sender.stage(_weights(v), SPEC, v)
        assert len(sender._pairs) == 1  # pulled recently enough: kept
    v = 2 + wb.STALE_PAIR_VERSIONS
    sender.stage(_weights(v), SPEC, v)
    assert sender._pairs == {}  # pulled none of the last ones: dropped
    receiver.receive(sender.address, v, dst, SPEC, timeout=10)  # back: a new pair
    assert torch.equal(dst, _weights(v)) and len(sender._pairs) == 1 and sender.failed == 0


def test_a_receiver_of_another_dtype_gets_the_weights_converted(sender, receiver):
    sender.stage(_weights(dtype=torch.bfloat16), SPEC, 1)
    dst = torch.zeros(N)  # fp32 server, bf16 trainer
    receiver.receive(sender.address, 1, dst, SPEC, timeout=10)
    assert torch.equal(dst, _weights(dtype=torch.bfloat16).float())


def test_another_version_or_layout_is_refused_before_anything_is_received(sender, receiver):
    dst = torch.full((N,), 7.0)
    with pytest.raises(WeightSyncError, match="staged no version yet") as e:
        receiver.receive(sender.address, 1, dst, SPEC, timeout=10)
    sender.stage(_weights(), SPEC, 5)
    with pytest.raises(WeightSyncError, match="holds weight version 5, not the 6 asked for") as e:
        receiver.receive(sender.address, 6, dst, SPEC, timeout=10)
    assert not e.value.partial and not isinstance(e.value, WeightsSuperseded)
    # An older version than the staged one is gone for good: the error names the newer one.
    with pytest.raises(WeightsSuperseded, match="not the 4 asked for") as e:
        receiver.receive(sender.address, 4, dst, SPEC, timeout=10)
    assert e.value.newer == 5 and not e.value.partial
    other = {"a": ParamSpec(0, (100, 1000)), "b": ParamSpec(100_000, (200_000,))}
    with pytest.raises(WeightSyncError, match="another layout than the trainer") as e:
        receiver.receive(sender.address, 5, dst, other, timeout=10)
    assert not e.value.partial and bool((dst == 7.0).all())


def test_a_transfer_that_breaks_off_is_a_partial_update_and_the_pair_is_remade():
    sender = HalfSender(host=HOST, timeout=5.0, bucket_bytes=BUCKET)
    receiver = WeightReceiver("test-server", host=HOST)
    try:
        sender.stage(_weights(), SPEC, 2)
        dst = torch.zeros(N)
        with pytest.raises(WeightSyncError) as e:
            receiver.receive(sender.address, 2, dst, SPEC, timeout=10)
        assert e.value.partial and "after 65536 bytes" in str(e.value)
        assert sender.failed == 1 and "the trainer died" in sender.last_failure
        # Both sides dropped the pair; the next pull makes a new one (and here breaks again).
        assert not sender._pairs and not receiver._pairs
    finally:
        sender.close()
        receiver.close()


def _join_as(rank, store, name):
    return wb._pair_group(store, name, rank, HOST, 10, "gloo")


def test_a_stranger_that_takes_the_servers_place_in_a_pair_gets_nothing(sender):
    # The rendezvous store is a plain TCPStore: anyone who reaches it can list its keys and
    # race for a pair.  Without the run's secret it cannot prove itself, and nothing is sent.
    sender.stage(_weights(), SPEC, 1)
    r = WeightReceiver("stranger", host=HOST)
    req = {"version": 1, "layout": wb.layout_digest(SPEC), "numel": N, "pair": "p1", "new": True}
    ans = r._ask(sender.address, {**req, "server": "stranger"}, 10)  # (a real server's request)
    group = _join_as(1, torch.distributed.TCPStore(*ans["store"], None, False), "p1")
    wb._bcast(group, torch.zeros(32, dtype=torch.uint8), 10, root=1)  # no valid proof
    with pytest.raises(RuntimeError):  # gloo's "connection closed by peer"
        wb._bcast(group, torch.zeros(4, dtype=torch.int64), 10)  # the sender hung up
    assert sender.failed == 1 and "does not hold this run's secret" in sender.last_failure
    assert sender.sent == 0
    r.close()


def test_a_stranger_that_takes_the_senders_place_lands_no_byte(receiver):
    # A fake sender: it answers the request (as the real one would), then joins the pair
    # first and sends weights without a valid proof.
    import threading

    import zmq

    from realhf.base.distributed.dist_util import master_store
    from realhf.base.net import auth

    store = master_store(HOST, 10)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port(f"tcp://{HOST}")

    def impostor():
        (ident,), body = auth.recv(sock, wb.KIND, "test", n_prefix=1) if sock.poll(10_000) else ()
        req = __import__("json").loads(bytes(body))
        answer = {
            "ok": True,
            "version": 1,
            "numel": N,
            "dtype": "float32",
            "bucket_elems": N,
            "nonce": "00",
            "store": [HOST, store.port],
            "backend": "gloo",
        }
        auth.send(sock, wb.KIND, __import__("json").dumps(answer).encode(), prefix=[ident])
        group = _join_as(0, store, req["pair"])
        wb._bcast(group, torch.zeros(32, dtype=torch.uint8), 10, root=1)
        wb._bcast(group, torch.tensor([wb._MAGIC, 1, N, 1]), 10)
        wb._bcast(group, torch.zeros(32, dtype=torch.uint8), 10)  # no valid proof
        try:
            wb._bcast(group, torch.full((N,), 666.0), 10)
            # (the bytes may all fit in the sockets' buffers:) then wait for an answer
            wb._bcast(group, torch.zeros(4, dtype=torch.int64), 10, root=1)
        except Exception as e:  # noqa: BLE001 — the receiver hung up, as it should
            hung_up.append(str(e))
        finally:
            wb._drop(group)

    hung_up = []
    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    dst = torch.zeros(N)
    with pytest.raises(WeightSyncError, match="does not hold this run's secret") as e:
        receiver.receive(f"{HOST}:{port}", 1, dst, SPEC, timeout=10)
    assert not e.value.partial and bool((dst == 0).all())
    t.join(15)
    # The receiver closed the pair as it refused (though the test still holds its error):
    # the impostor learnt at once, not after its 10 s timeout.
    assert not t.is_alive() and len(hung_up) == 1
    assert "timed out" not in hung_up[0].lower(), hung_up[0]
    sock.close(0)
    ctx.term()


def test_no_sender_is_a_bounded_wait_that_says_what_it_waited_for(receiver):
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="did not answer within 1s"):
        receiver.receive(f"{HOST}:9", 1, torch.zeros(N), SPEC, timeout=1)
    assert time.monotonic() - t0 < 5


def _die_after_the_header(address, mode, joined):
    """A server that joins its pair, passes the handshake, then dies (SIGKILL) or hangs."""
    r = WeightReceiver("doomed", host=HOST)
    req = {
        "version": 1,
        "layout": wb.layout_digest(SPEC),
        "numel": N,
        "pair": "doomed-pair",
        "new": True,
        "server": "doomed",
    }
    ans = r._ask(address, req, 10)
    assert ans["ok"], ans
    store = torch.distributed.TCPStore(*ans["store"], None, False)
    group = wb._pair_group(store, "doomed-pair", 1, HOST, 10, "gloo")
    wb._bcast(group, wb._proof(b"server", "doomed-pair", ans["nonce"], 1, N), 10, root=1)
    wb._bcast(group, torch.zeros(4, dtype=torch.int64), 10)  # the header
    wb._bcast(group, torch.zeros(32, dtype=torch.uint8), 10)  # the sender's proof
    joined.set()
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_a_server_that_dies_or_hangs_mid_transfer_is_dropped_alone(sender, receiver, mode):
    sender.stage(_weights(), SPEC, 1)
    ctx = fresh_context()
    joined = ctx.Event()
    child = ctx.Process(target=_die_after_the_header, args=(sender.address, mode, joined))
    child.start()
    try:
        assert joined.wait(60), "the doomed server never joined its pair"
        # While the doomed transfer is stuck or broken, another server pulls, and the trainer
        # stages the next version without waiting for it.
        dst = torch.zeros(N)
        receiver.receive(sender.address, 1, dst, SPEC, timeout=10)
        assert torch.equal(dst, _weights())
        t0 = time.monotonic()
        sender.stage(_weights(2), SPEC, 2)
        assert time.monotonic() - t0 < 2
        deadline = time.monotonic() + 20
        while sender.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sender.failed == 1 and "'doomed'" in sender.last_failure
        assert "doomed-pair" not in sender._pairs
        receiver.receive(sender.address, 2, dst, SPEC, timeout=10)
        assert torch.equal(dst, _weights(2))
    finally:
        child.kill()
        child.join(10)


def test_a_pull_during_staging_waits_for_the_copy_and_learns_of_the_new_version(sender, receiver):
    """CI 2026-11-29 (test_killed_trainer_resumes_exactly): a server pulled version 6 while
    the trainer was copying version 7 in, was refused ("staging weight version 7 now") and
    the run failed.  Such a pull now waits for the copy: an older version is then
    superseded by the new one (the pool pulls that instead), the staged one is sent."""
    import threading

    dst = torch.zeros(N)
    sender.stage(_weights(6), SPEC, 6)
    with sender._lock:  # what stage() does first: the copy of version 7 is under way
        snap6, sender._snap, sender._staging = sender._snap, None, 7
    results = {}

    def pull(version):
        try:
            results[version] = receiver.receive(sender.address, version, dst, SPEC, timeout=10)
        except Exception as e:  # noqa: BLE001
            results[version] = e

    t = threading.Thread(target=pull, args=(6,))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for the copy, not refused
    sender._snap = snap6  # (the copy's buffer: stage() reuses the idle one)
    sender.stage(_weights(7), SPEC, 7)
    t.join(10)
    assert isinstance(results[6], WeightsSuperseded) and results[6].newer == 7
    pull(7)
    assert results[7] == N * 4 and torch.equal(dst, _weights(7))
