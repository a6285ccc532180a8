"""What it costs on this host to take memory back after it sat free for a while.

    python benchmark/refault.py [--gib 1] [--waits 0,0.5,1,2,4,8] [--page 4k|huge|both]

A model worker frees memory at the end of each call (``realhf.base.gcutil.trim_heap``) and
takes it back in a later one.  On a VM whose guest reports free pages to its host
(virtio-balloon free page reporting), a page that stayed free long enough is given to the
host, and faulting it in again waits for the host.  This maps ``--gib`` of anonymous
memory, touches every page, unmaps it, sleeps ``wait`` seconds, and repeats: each line is
the time to touch the next mapping after that wait.  With ``huge`` the mappings are
``madvise(MADV_HUGEPAGE)`` (torch's large CPU tensors are, under ``THP_MEM_ALLOC_ENABLE=1``,
which ``realhf`` sets).  The last line is JSON.

On the 2-core Xeon (AMX) VM of 2026-12-02, 1 GiB: 4 KiB pages 0.36-0.38 s whatever the
wait; huge pages 0.14 s right away, 0.46 s after 2 s free, 0.79 s after 4 s, 1.43 s after
8 s (``benchmark/results/runs/refault_xeon_amx_2026-12-02_s75.log``; the other probes of
that session are in ``benchmark/results/scale.md``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import time


def touch_after(nbytes: int, huge: bool, wait: float) -> float:
    """Sleep ``wait`` seconds (the memory freed before it stays free), then time touching a
    fresh ``nbytes`` mapping page by page, and free it."""
    time.sleep(wait)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            m.madvise(mmap.MADV_HUGEPAGE)
        t = time.perf_counter()
        for i in range(0, nbytes, mmap.PAGESIZE):
            m[i] = 1
        return time.perf_counter() - t
    finally:
        m.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--waits", default="0,0.5,1,2,4,8", help="seconds, comma separated")
    p.add_argument("--page", choices=["4k", "huge", "both"], default="both")
    args = p.parse_args()
    if args.gib <= 0:
        p.error("--gib must be > 0")
    try:
        waits = [float(w) for w in args.waits.split(",")]
    except ValueError:
        p.error(f"--waits takes seconds separated by commas, got {args.waits!r}")
    if any(w < 0 for w in waits):
        p.error("--waits must be >= 0")
    nbytes = int(args.gib * 2**30) // mmap.PAGESIZE * mmap.PAGESIZE
    kinds = {"4k": [False], "huge": [True], "both": [False, True]}[args.page]
    out = {}
    for huge in kinds:
        name = "huge" if huge else "4k"
        touch_after(nbytes, huge, 0)  # the first mapping of a kind pays for its page tables
        out[name] = {}
        for w in waits:
            s = touch_after(nbytes, huge, w)
            out[name][str(w)] = s
            print(f"{name:4s} pages: {args.gib:g} GiB taken back after {w:g} s free: {s:.3f} s")
    print(json.dumps({"gib": args.gib, "seconds_to_touch": out}))


if __name__ == "__main__":
    main()
