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

__all__ = ["freeze_startup_objects", "heap_free_bytes", "keep_freed_memory", "trim_heap"]


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
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    # not glibc (macOS, musl): nothing to tune
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        ).split()
    ]


@functools.lru_cache(maxsize=1)
def _mallinfo2():
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None  # glibc >= 2.33
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def heap_free_bytes() -> Optional[int]:
    """Bytes in the free chunks of glibc's heap (``mallinfo2().fordblks``: what a
    :func:`trim_heap` could give back, some of it given back already), or None where
    glibc cannot tell (not glibc, or older than 2.33)."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def _malloc_trim():
    libc = _libc()
    return None if libc is None else libc.malloc_trim


# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Keep the memory a process frees for its own next allocations, until
    :func:`trim_heap` gives it back: glibc then serves every allocation from its heap (no
    mapping of its own, ``M_MMAP_MAX=0``) and never trims the heap by itself
    (``M_TRIM_THRESHOLD`` at its maximum).

    By default a tensor over glibc's mmap threshold (at most 32 MB) is a mapping of its
    own, unmapped when freed: the next one is faulted in and zeroed page by page by the
    kernel, and on a VM that reports free pages to its host (virtio-balloon), faulted in
    by the host too.  A training step frees and retakes such tensors all along its
    backward pass.  At the 0.5B shape in bf16 (``ppo-math``, 16 x 72 tokens) the training
    call took 8.3-8.6 s with this against 10.0-10.3 s without (2026-11-29,
    ``benchmark/scale.py``, two runs each), for 0.2-0.3 GiB more at the peak (holes in
    the heap that a larger tensor cannot reuse).  A generation server's prefill does the
    same with its activations: at the 0.5B shape in bf16 (16 prompts of 128 tokens) each
    prefill faulted ~38k pages in again, 0.35-0.42 s of system CPU, against none with this
    (2026-11-30).  A model worker's process calls this at start (``realhf.apps.remote``; not
    a test's process, whose memory would stay high) and the worker trims at the end of each
    call, where what a call freed is not needed again soon.  Generation servers
    (``realhf.apps.serve`` and the ``generation_server`` worker) call it at start too and
    never trim: they keep their busiest step's memory for the next one.

    Returns whether it applied (glibc only)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))
    )


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
