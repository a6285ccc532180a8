"""Reproducible randomness across processes.

Each worker derives its own seed from the experiment seed and a stable string
key (its worker name, or e.g. ``"model_worker/3:dataloader"``), so reruns draw
the same numbers and two workers never share a stream by accident.  The
derivation hashes with SHA-256 rather than ``hash()``, which Python salts per
process.
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Optional

import numpy as np

__all__ = ["derive_seed", "set_random_seed", "get_seed", "get_shuffle_seed"]

_base_seed: Optional[int] = None
_key: Optional[str] = None

_MAX_SEED = 2**32 - 1  # numpy's legacy seeding accepts [0, 2**32)


def derive_seed(base_seed: int, key: str) -> int:
    """A seed in ``[0, 2**32)`` that depends only on ``base_seed`` and ``key``."""
    if not isinstance(base_seed, int) or isinstance(base_seed, bool) or base_seed < 0:
        raise ValueError(f"base_seed must be a non-negative int, got {base_seed!r}.")
    if not isinstance(key, str):
        raise TypeError(f"seed key must be a str, got {type(key).__name__}: {key!r}.")
    digest = hashlib.sha256(f"{base_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def set_random_seed(base_seed: int, key: str = "") -> int:
    """Seed python, numpy and torch for this process; return the seed used.

    The seed is ``derive_seed(base_seed, key)`` (``key=""`` still hashes, so
    ``set_random_seed(1)`` and ``set_random_seed(1, "x")`` differ).  Also sets
    ``PYTHONHASHSEED`` for child processes.
    """
    seed = derive_seed(base_seed, key)
    global _base_seed, _key
    _base_seed, _key = base_seed, key
    # The running interpreter fixed its hash seed at start-up; this only makes
    # set/dict iteration order reproducible in the processes it spawns.
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch
    except ImportError:  # base must not need torch to import
        return seed
    torch.manual_seed(seed)  # seeds every device's generator, CUDA included
    return seed


def get_seed() -> int:
    """The base seed given to :func:`set_random_seed`; raises if never set."""
    if _base_seed is None:
        raise RuntimeError(
            "No seed set in this process; call "
            "realhf.base.seeding.set_random_seed(seed, key) first."
        )
    return _base_seed


def get_shuffle_seed(epoch: int, key: str = "dataset") -> int:
    """Seed for shuffling data in ``epoch``: the same on every rank that shares ``key``.

    Derived from the *base* seed (not the per-worker one) so all data-parallel
    ranks shuffle identically.
    """
    return derive_seed(get_seed(), f"{key}:epoch{epoch}")
