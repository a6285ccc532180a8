"""freeze_startup_objects: start-up objects leave the collector's scans, later garbage does not."""

import gc
import weakref

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
