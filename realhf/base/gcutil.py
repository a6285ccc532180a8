"""Keep Python's cyclic garbage collector off the objects a long-running process made at
start, and give the C heap's free memory back to the system.

A server or worker loads a model, a tokenizer, FastAPI and torch modules: millions of
objects that live until exit.  The collector's older generations are scanned whole every
so often, and each such scan walks all of them, for nothing.  On the generation server
this made the event loop's CPU per request bimodal: 0.30-0.36 s per 512 requests
(256 concurrent, 16 tokens) without a full collection in the window, 0.57-0.77 s with one
(2026-11-26, ``benchmark/vs_vllm.py``'s point, 4 runs x 3).  :func:`freeze_startup_objects`
moves everything alive into the permanent generation once start-up is done, so only the
objects made while serving are ever scanned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Optional

__all__ = ["freeze_startup_objects", "trim_heap"]


def freeze_startup_objects() -> int:
    """Collect the young generations, then exclude every object alive now from later
    collections.

    Call at the end of start-up (model and app built), in the process that serves.
    Returns how many objects were frozen.  Frozen objects are never freed, which is what
    start-up objects are meant for; garbage made later is collected as usual.

    Not a full collection first: that walks every object of the process (~0.1 s here on
    an idle host, seconds on a loaded one) without releasing the GIL, and a generation
    server's name-resolve keepalive thread then missed its TTL (CI, 2026-11-29: 4.5 s
    late, the server taken for lost mid-configure).  The old generation's few cycles of
    start-up garbage stay, frozen.
    """
    gc.collect(1)
    gc.freeze()
    return gc.get_freeze_count()


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def trim_heap() -> Optional[bool]:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim(0)``).

    Tensors under glibc's mmap threshold (which grows to 32 MB as large blocks are freed)
    live on the heap, and a freed one stays in the process until the heap above it is free
    too.  A training step frees gigabytes of such activations after its backward pass: at
    the 0.5B shape in bf16 a model worker kept 1.9 GiB of them between calls and, worse,
    next to the 1.8 GiB fp32 gradient allocated after the backward (a fresh mapping, which
    cannot reuse them).  Trimming costs 3-80 ms there.  Returns whether memory was given
    back, or None where there is no glibc.
    """
    fn = _malloc_trim()
    return None if fn is None else bool(fn(0))
