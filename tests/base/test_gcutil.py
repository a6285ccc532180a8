"""freeze_startup_objects: start-up objects leave the collector's scans, later garbage does not;
keep_freed_memory: large tensors come from the heap, which keeps them when freed."""

import gc
import weakref

import pytest
from heap_probe import WHERE_A_LARGE_TENSOR_LIVES

from realhf.base.gcutil import freeze_startup_objects


class _Node:
    pass


def test_start_up_objects_are_frozen_and_later_cycles_are_still_collected():
    kept = _Node()
    try:
        n = freeze_startup_objects()
        # frozen objects can still be freed (another thread, e.g. xdist's, drops its own)
        # but nothing joins the frozen set without another freeze
        assert n > 0 and 0 < gc.get_freeze_count() <= n
        assert not any(o is kept for o in gc.get_objects())  # frozen: not scanned any more
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle made after start-up
        alive = weakref.ref(a)
        del a, b
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


_WHERE = (
    WHERE_A_LARGE_TENSOR_LIVES
    + r"""
import sys
from realhf.base import gcutil
if sys.argv[1] == "keep":
    assert gcutil.keep_freed_memory()
print(where_a_large_tensor_lives())
"""
)


@pytest.mark.parametrize("mode,where", [("keep", "heap"), ("default", "mapping")])
def test_keep_freed_memory_serves_large_tensors_from_the_heap(mode, where):
    """With it, a 64 MB tensor comes from glibc's heap, which keeps it when freed (until a
    trim); without it, from a mapping of its own, unmapped when freed.  In a process of its
    own: the setting lasts for the process."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _WHERE, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [where]


def test_heap_free_bytes_counts_what_a_trim_can_give_back():
    """Freed heap memory shows in heap_free_bytes until a trim; in a process of its own
    (keep_freed_memory lasts for the process)."""
    import subprocess
    import sys

    code = r"""
import torch
from realhf.base import gcutil
assert gcutil.keep_freed_memory()
t = torch.ones(256 * 2**20, dtype=torch.uint8)
before = gcutil.heap_free_bytes()
del t
freed = gcutil.heap_free_bytes()
assert freed >= before + 255 * 2**20, (before, freed)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr
