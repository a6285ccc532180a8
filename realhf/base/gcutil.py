"""Keep Python's cyclic garbage collector off the objects a long-running process made at start.

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

import gc

__all__ = ["freeze_startup_objects"]


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
