"""A pool for large CPU tensors that keeps the memory they free for the next ones.

torch's CPU allocator gives a large tensor's memory back to the C library when the tensor
is freed, and the C library gives it back to the kernel (a mapping of its own, or the heap
trimmed by :func:`realhf.base.gcutil.trim_heap`).  The next large tensor is then faulted in
page by page.  On a VM that reports free pages to its host (virtio-balloon free page
reporting) a page that sat free for a few seconds is faulted in by the host too:
0.3-1.5 s of system time per GiB (``benchmark/refault.py``).  A model worker frees and
takes back gigabytes in every call: activations, the gradient it releases while it
generates, generation's packed weights.

:func:`install` makes ``realhf._C``'s pool (``csrc/tensor_pool.cpp``) torch's CPU allocator
for the process.  Tensors of at least ``min_bytes`` come from one reserved range of
addresses, the smallest free block that holds them, and a freed block is joined with its
free neighbours; the memory stays in the process, so the process holds its busiest call's
memory between calls (the peak it reaches anyway) and takes it again without a fault.
Smaller tensors go to torch's own allocator.  :func:`trim` gives the free blocks back.

At the Qwen2.5-0.5B shape, 16 x 82 tokens, in one process cycling generation and training
as a sync PPO model worker does (2-core Xeon VM, 2026-12-02): fp32 training 18.7-20.3 s ->
12.8-13.3 s, generation 9.0-9.8 -> 8.2-8.5 s, peak RSS 12.25 -> 12.0 GiB; bf16 training
7.0-8.3 -> 4.9-5.1 s, generation 4.6-5.6 -> 4.2-4.3 s, peak 10.01 -> 9.91 GiB.

Model workers and generation servers install it at start (:mod:`realhf.apps.remote`);
``REALHF_TENSOR_POOL=0`` turns it off.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from realhf.base import logging
from realhf.impl.kernels import _C

__all__ = ["ENV", "install", "installed", "stats", "trim"]

logger = logging.getLogger("tensor_pool")

#: the environment variable that turns the pool off (``0``) for a worker process
ENV = "REALHF_TENSOR_POOL"
#: tensors below this size stay with torch's allocator (the C library's small blocks)
DEFAULT_MIN_BYTES = 1 << 20


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _enabled() -> bool:
    v = os.environ.get(ENV, "1").strip().lower()
    if v in ("1", "on", "true", "yes", ""):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{ENV}={v!r}: use 1 (the default: pool large CPU tensors) or 0 (off)")


def install(reserve_bytes: Optional[int] = None, min_bytes: int = DEFAULT_MIN_BYTES) -> bool:
    """Make the pool torch's CPU allocator for this process (once; tensors that exist keep
    their own allocator).  ``reserve_bytes`` of addresses are reserved, none committed
    (default: twice the machine's memory); a tensor the range cannot hold goes to torch's
    allocator.  Returns whether this call installed it: False where it is installed
    already, turned off by ``REALHF_TENSOR_POOL=0``, or ``realhf._C`` lacks it."""
    if not _enabled():
        logger.info(f"{ENV}=0: large CPU tensors use torch's allocator")
        return False
    if _C is None or not hasattr(_C, "tensor_pool_install"):
        logger.warning(
            "realhf._C has no tensor pool (not built, or built before it): large CPU tensors "
            "use torch's allocator. Build it with `pip install --no-build-isolation -e .`."
        )
        return False
    reserve = int(reserve_bytes) if reserve_bytes is not None else 2 * _physical_memory()
    if reserve <= 0 or min_bytes <= 0:
        raise ValueError(
            f"tensor_pool.install: reserve_bytes ({reserve}) and min_bytes ({min_bytes}) "
            "must be > 0"
        )
    try:
        done = bool(_C.tensor_pool_install(reserve, int(min_bytes)))
    except RuntimeError as e:
        logger.warning(f"{e}; large CPU tensors use torch's allocator")
        return False
    if done:
        logger.info(
            f"large CPU tensors (>= {min_bytes / 2**20:g} MiB) keep their memory in the "
            f"process: a pool over {reserve / 2**30:.0f} GiB of reserved addresses"
        )
    return done


def installed() -> bool:
    """Whether this process's CPU tensors come from the pool."""
    return bool(stats())


def stats() -> Dict[str, int]:
    """The pool's counters: ``live_bytes`` / ``live_blocks`` (tensors held now),
    ``touched_bytes`` (the extent of the range in use since the last trim: what the pool
    adds to the process's memory at most), ``free_blocks``, ``reserved_bytes``,
    ``min_bytes`` and ``fallbacks`` (tensors the range could not hold).  Empty where no
    pool is installed."""
    if _C is None or not hasattr(_C, "tensor_pool_stats"):
        return {}
    return dict(_C.tensor_pool_stats())


def trim() -> int:
    """Give the pages of the pool's free blocks back to the system (the next tensors there
    fault them in again); returns the bytes given back."""
    if _C is None or not hasattr(_C, "tensor_pool_trim"):
        return 0
    return int(_C.tensor_pool_trim())
