"""Dedicated sandbox uids: exclusive slots and the sweep after a run."""

import os
import subprocess
import threading
import time

import pytest

from functioncall.code.uid_slots import UidSlot, processes_of, setpriv, sweep_uid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")


def test_concurrent_slots_get_distinct_uids():
    held, lock = [], threading.Lock()
    barrier = threading.Barrier(6)

    def take():
        slot = UidSlot(wait_s=10)
        with lock:
            held.append(slot)
        barrier.wait(timeout=10)  # all six held at once

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    try:
        uids = [s.uid for s in held]
        assert len(uids) == 6 and len(set(uids)) == 6
        assert all(u >= 1000 for u in uids)
    finally:
        for s in held:
            s.release()


def test_no_free_slot_times_out_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("REALHF_SANDBOX_SLOTS", "1")
    first = UidSlot()
    try:
        with pytest.raises(TimeoutError, match="free sandbox uid"):
            UidSlot(wait_s=0.2)
    finally:
        first.release()
    UidSlot(wait_s=1).release()  # released: free again


@pytest.mark.slow
def test_sweep_kills_what_a_uid_left_and_nothing_else():
    slot = UidSlot()
    try:
        bystander = subprocess.Popen(["sleep", "60"])  # root's, must survive
        orphan = subprocess.Popen(setpriv(slot.uid) + ["sleep", "60"], start_new_session=True)
        try:
            deadline = time.monotonic() + 5
            while processes_of(slot.uid) != [str(orphan.pid)]:  # setpriv switches uid after fork
                assert time.monotonic() < deadline, "the orphan never ran as the slot's uid"
                time.sleep(0.02)
            sweep_uid(slot.uid)
            assert orphan.wait(timeout=5) == -9
            assert processes_of(slot.uid) == []
            assert bystander.poll() is None
        finally:
            bystander.kill()
            bystander.wait()
            orphan.kill()
    finally:
        slot.release()
