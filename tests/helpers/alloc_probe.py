"""The largest single CPU allocation a call makes (torch profiler), for memory-bound tests."""

from __future__ import annotations

import torch


def biggest_allocation(fn) -> int:
    """Bytes of the largest single allocation while ``fn()`` runs."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage for e in prof.events())
