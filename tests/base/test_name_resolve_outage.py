"""Name resolution rides out outages of its store (etcd killed and restarted): operations
retry with backoff up to the outage tolerance, keepalive'd entries survive a restart, and
past the tolerance the error names the store and the operation."""

import threading
import time

import pytest

from realhf.base.name_resolve.etcd3 import Etcd3NameRecordRepository

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def _repo(server, tolerance, monkeypatch):
    monkeypatch.setenv("REALHF_NAME_RESOLVE_OUTAGE_S", str(tolerance))
    return Etcd3NameRecordRepository(address=server.address, timeout=2)


def _restart_after(server, seconds):
    t = threading.Thread(target=lambda: (time.sleep(seconds), server.start()))
    t.start()
    return t


def test_operations_wait_out_a_restart_and_ttl_entries_survive(restartable_etcd, monkeypatch):
    repo = _repo(restartable_etcd, 30, monkeypatch)
    try:
        repo.add("exp/worker", "RUNNING", keepalive_ttl=4)  # TTL shorter than the outage
        restartable_etcd.stop()
        t = _restart_after(restartable_etcd, 6)
        t0 = time.monotonic()
        assert repo.get("exp/worker") == "RUNNING"  # blocked until etcd was back
        assert 5 < time.monotonic() - t0 < 20
        repo.add("exp/other", "x")
        t.join()
        time.sleep(6)  # longer than the TTL: the keepalive refreshes it again
        assert repo.find_subtree("exp") == ["exp/other", "exp/worker"]
    finally:
        repo.close()


def test_an_outage_longer_than_the_tolerance_names_the_store(restartable_etcd, monkeypatch):
    repo = _repo(restartable_etcd, 2, monkeypatch)
    try:
        restartable_etcd.stop()
        t0 = time.monotonic()
        with pytest.raises(ConnectionError) as e:
            repo.get("exp/worker")
        assert time.monotonic() - t0 < 8
        msg = str(e.value)
        assert f"etcd3 backend at {restartable_etcd.address} was unreachable" in msg
        assert "during get 'exp/worker'" in msg and "REALHF_NAME_RESOLVE_OUTAGE_S" in msg
    finally:
        repo.close()


def test_a_relaunch_waits_for_the_store(restartable_etcd):
    from realhf.apps.main import _wait_for_store

    spec = f"etcd3://{restartable_etcd.address}"
    restartable_etcd.stop()
    with pytest.raises(ConnectionError, match="did not come back within 2s"):
        _wait_for_store(spec, 2)
    t = _restart_after(restartable_etcd, 3)
    t0 = time.monotonic()
    _wait_for_store(spec, 60)
    assert time.monotonic() - t0 > 2
    t.join()


def test_a_long_outage_does_not_delay_the_first_call_after_it(restartable_etcd, monkeypatch):
    # grpc backs off its reconnects while etcd is away (1 s, x1.6 per failed try, up to
    # 120 s): after 10 s of calls it would next try seconds after etcd is back, and a
    # status key (6 s TTL, which a restarted etcd extends by one TTL only) could expire.
    repo = _repo(restartable_etcd, 60, monkeypatch)
    try:
        repo.add("exp/worker", "RUNNING", keepalive_ttl=6)
        restartable_etcd.stop()
        waiting = threading.Thread(target=repo.get, args=("exp/worker",))
        waiting.start()  # a worker waiting for a name retries through the outage
        time.sleep(10)
        restartable_etcd.start()
        t0 = time.monotonic()
        assert repo.get("exp/worker") == "RUNNING"
        assert time.monotonic() - t0 < 1.5
        waiting.join(timeout=5)
        assert not waiting.is_alive()
    finally:
        repo.close()
