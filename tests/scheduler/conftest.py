"""Fixtures for multi-process tests: nothing we launch may outlive a test."""

from __future__ import annotations

import time

import psutil
import pytest


def _descendants():
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_leftover_processes():
    """Fail the test if processes it started are still alive 10 s after it ends.

    Processes that existed before the test (e.g. the session's etcd) are ignored.
    Call the yielded function to check earlier, inside the test.
    """
    before = set(_descendants())

    def check(timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while True:
            left = {pid: p for pid, p in _descendants().items() if pid not in before}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        names = []
        for p in left.values():
            try:
                names.append((p.pid, p.cmdline()))
            except psutil.NoSuchProcess:
                pass
        assert not names, f"processes left behind: {names}"

    yield check
    check()
