"""realhf._C's pool for large CPU tensors (realhf.impl.tensor_pool): it serves tensors from
its reserved range, reuses and joins freed blocks, keeps their memory (no page faults to take
it again) until a trim, falls back to torch's allocator when full, and is safe across
threads.  Each test runs in a process of its own: the pool is the process's CPU allocator
from its installation on."""

import os
import subprocess
import sys

import pytest

from realhf.impl import tensor_pool

pytestmark = pytest.mark.skipif(
    tensor_pool._C is None or not hasattr(tensor_pool._C, "tensor_pool_install"),
    reason="realhf._C is not built (pip install --no-build-isolation -e .)",
)


def _run(code: str, env=None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


_PRELUDE = r"""
import random, resource, threading
import torch
from realhf.impl import tensor_pool as tp
MiB = 2**20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
"""


def test_blocks_are_reused_joined_and_kept_until_a_trim():
    _run(
        _PRELUDE
        + r"""
assert tp.install(reserve_bytes=1024 * MiB, min_bytes=MiB)
assert not tp.install(reserve_bytes=1024 * MiB)  # once per process
assert tp.installed()
s0 = tp.stats()
assert s0["reserved_bytes"] == 1024 * MiB and s0["min_bytes"] == MiB and s0["live_blocks"] == 0

small = torch.ones(1000)  # below min_bytes: torch's own allocator
assert tp.stats()["live_blocks"] == 0

# Consecutive blocks from the range, rounded up to pages.
a = torch.full((10 * MiB + 1,), 1, dtype=torch.uint8)
b = torch.full((10 * MiB,), 2, dtype=torch.uint8)
c = torch.full((10 * MiB,), 3, dtype=torch.uint8)
assert b.data_ptr() == a.data_ptr() + 10 * MiB + 4096
assert c.data_ptr() == b.data_ptr() + 10 * MiB
s = tp.stats()
assert s["live_blocks"] == 3 and s["live_bytes"] == 30 * MiB + 4096, s

# a and b freed: one free block of their joined size, which a 20 MiB tensor takes first
# (best fit) before the untouched rest of the range.
base = a.data_ptr()
del a, b
assert tp.stats()["live_blocks"] == 1
d = torch.full((20 * MiB,), 4, dtype=torch.uint8)
assert d.data_ptr() == base
assert bool((c == 3).all()) and bool((d == 4).all())

# Freed memory stays in the process: taking it again faults (almost) nothing in.
big = torch.ones(64 * MiB // 4)
held = rss()
del big
assert rss() > held - 8 * MiB, (held, rss())
f0 = faults()
again = torch.ones(64 * MiB // 4)
assert faults() - f0 < 256, faults() - f0  # 64 MiB fresh would be >= 16k 4 KiB faults
del again

# The same sizes again and again: the pool does not grow.
rng = random.Random(0)
sizes = [rng.randrange(MiB, 16 * MiB) for _ in range(40)]
def churn():
    rng = random.Random(1)
    held = []
    for n in sizes:
        held.append(torch.empty(n, dtype=torch.uint8))
        if len(held) > 6:
            held.pop(rng.randrange(len(held)))
    held.clear()
churn()
touched = tp.stats()["touched_bytes"]
for _ in range(10):
    churn()
assert tp.stats()["touched_bytes"] == touched

# A trim gives the free blocks' pages back; live tensors keep theirs.
del d
before = rss()
given = tp.trim()
assert given >= 64 * MiB, given
assert rss() < before - 80 * MiB, (before, rss(), given)  # d and big were written
assert bool((c == 3).all())
s = tp.stats()
assert s["touched_bytes"] == c.data_ptr() + 10 * MiB - base, s
del c
assert tp.stats()["live_blocks"] == 0 and tp.stats()["fallbacks"] == 0
print("ok")
"""
    )


def test_a_full_range_falls_back_to_torchs_allocator():
    _run(
        _PRELUDE
        + r"""
assert tp.install(reserve_bytes=4 * MiB, min_bytes=MiB)
a = torch.full((3 * MiB,), 7, dtype=torch.uint8)  # in the range
b = torch.full((8 * MiB,), 8, dtype=torch.uint8)  # does not fit: torch's allocator
s = tp.stats()
assert s["live_blocks"] == 1 and s["fallbacks"] == 1, s
assert bool((a == 7).all()) and bool((b == 8).all())
del a, b
assert tp.stats()["live_blocks"] == 0
print("ok")
"""
    )


def test_threads_allocate_and_free_concurrently():
    _run(
        _PRELUDE
        + r"""
assert tp.install(reserve_bytes=2048 * MiB, min_bytes=MiB)
errors = []
def work(k):
    rng = random.Random(k)
    try:
        held = []
        for i in range(300):
            t = torch.full((rng.randrange(MiB, 4 * MiB),), k, dtype=torch.uint8)
            held.append(t)
            if len(held) > 4:
                u = held.pop(rng.randrange(len(held)))
                assert bool((u == k).all()), "a block was handed out twice"
    except Exception as e:
        errors.append(e)
threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
for t in threads: t.start()
for t in threads: t.join(120)
assert not errors, errors
s = tp.stats()
assert s["live_blocks"] == 0 and s["live_bytes"] == 0 and s["free_blocks"] == 1, s
print("ok")
"""
    )


def test_switched_off_or_misconfigured_by_the_environment():
    out = _run(
        _PRELUDE + "print(tp.install(), tp.stats(), tp.trim())",
        env={tensor_pool.ENV: "0"},
    )
    assert out.split("\n")[-2] == "False {} 0"
    bad = subprocess.run(
        [sys.executable, "-c", _PRELUDE + "tp.install()"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, tensor_pool.ENV: "maybe"},
    )
    assert bad.returncode != 0 and "REALHF_TENSOR_POOL='maybe'" in bad.stderr, bad.stderr
    with pytest.raises(ValueError, match="must be > 0"):
        tensor_pool.install(reserve_bytes=0)
