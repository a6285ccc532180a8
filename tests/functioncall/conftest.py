"""Fixtures for the sandbox tests: which modes can run here."""

import os
import shutil

import pytest


def _modes():
    if os.geteuid() != 0:
        return []
    modes = ["rlimit"]
    if shutil.which("bwrap"):
        modes.insert(0, "bwrap")
    return modes


SANDBOX_MODES = _modes()

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the sandbox switches to a dedicated uid, which needs root"
)


@pytest.fixture(params=SANDBOX_MODES or [pytest.param(None, marks=needs_root)])
def mode(request):
    """Each sandbox mode that can run on this machine."""
    if request.param == "bwrap":
        from functioncall.code.sandbox import _probe_bwrap

        reason = _probe_bwrap()
        if reason is not None:
            pytest.skip(f"bwrap cannot create namespaces here: {reason}")
    return request.param
