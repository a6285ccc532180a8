"""Fixtures for tests/system: an in-memory name-resolve store and fresh trial names."""

from __future__ import annotations

import itertools

import pytest

from realhf.base import name_resolve

_counter = itertools.count()


@pytest.fixture
def memory_name_resolve():
    """Point name_resolve at a fresh in-memory store for one test."""
    repo = name_resolve.reconfigure("memory")
    yield repo
    name_resolve.reconfigure("memory")


@pytest.fixture
def trial():
    """A trial name unique within the test session (keys never collide)."""
    return f"t{next(_counter)}"
