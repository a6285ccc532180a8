"""The KV cache of the generation engine: pages of one token pool, shared by a group.

Design decisions:

- **A memory budget in tokens, in pages.** The cache is one pool of
  ``n_pages * page_size`` token positions per layer (``k, v: [n_layers,
  n_tokens, n_kv_heads, head_dim]``). A sequence holds a *page table*: the
  pages its positions live on, position ``t`` at row ``table[t // P] * P +
  t % P``. How many sequences fit is then a question of their lengths, not a
  fixed slot count: the budget (``EngineConfig.kv_cache_tokens``) is what a
  run can afford, and ``max_running_requests`` only caps the decode batch.
- **A group shares its prompt.** The answers GRPO samples for one prompt are
  admitted together; the first takes pages for the whole prompt and the others
  share its full pages (reference counts). The prompt's partial last page is
  copied per answer, because that is where each answer's first tokens go.
  Positions below the prompt length are never written again, so shared pages
  need no copy-on-write. A group of G answers of a P-token prompt holds
  ``P + G * answer`` tokens instead of ``G * (P + answer)``.
- **Pages are reserved at admission, for the whole answer.** A sequence takes
  pages for ``prompt + max_new_tokens`` when it is admitted, so a running
  sequence never runs out of cache and nothing is ever preempted; a request
  that could never fit (more tokens than the whole pool) is refused when it is
  submitted. The price is capacity held by answers that stop early, given back
  the moment they finish.
- **No paged-attention kernel is needed.** The numba decode kernel (float32 or bfloat16 on
  the CPU) follows the page table itself. The device-agnostic path gathers each
  sequence's rows into a padded ``[B, L, n_kv, d]`` tensor per layer per step
  (one ``index_select``), which costs about one more read and write of the live
  cache, small next to reading the weights at real model shapes.
- The pool is zero-filled once at start. The padded decode path reads
  ``max(lens)`` positions of every sequence and masks the invalid ones; a
  masked score gets weight 0, but ``0 * NaN`` is NaN, so never-written memory
  holding NaN bit patterns would poison the output (it did: the engine emitted
  token 0 only when earlier tests in the process had left NaNs in freed memory).
  Zeros make every position attention can touch finite.
- Free pages are handed out lowest-first, so the rows a step touches stay
  compact and a lightly loaded server keeps few pages resident.
- There is no cache across requests: a resubmitted prompt is prefilled again,
  which for the short prompts of RL rollouts costs little next to decoding.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, List, Sequence, Tuple

import torch

#: tokens per page: small enough that a prompt's copied last page costs little,
#: large enough that a page table stays short
PAGE_SIZE = 16


def pages_for(n_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Pages that hold ``n_tokens`` positions."""
    return -(-n_tokens // page_size)


def pages_to_admit(
    prompt_len: int, new_tokens: int, shares_prompt: bool, page_size: int = PAGE_SIZE
) -> int:
    """Pages a sequence takes when admitted: its whole length, less the prompt's full
    pages when a group mate admitted with it holds them (``shares_prompt``)."""
    shared = prompt_len // page_size if shares_prompt else 0
    return pages_for(prompt_len + new_tokens, page_size) - shared


def tokens_to_hold(
    requests: Iterable[Tuple[Hashable, int, int]], page_size: int = PAGE_SIZE
) -> int:
    """Cache positions that hold ``requests`` — ``(prompt key, prompt length,
    max_new_tokens)`` each — all at once, a group's prompt shared as the scheduler
    shares it among mates admitted together.  (Enough for any subset of them too.)"""
    seen = set()
    pages = 0
    for key, plen, new in requests:
        pages += pages_to_admit(plen, new, key in seen, page_size)
        seen.add(key)
    return pages * page_size


class PagedKVCache:
    """A pool of key/value pages and their allocator (reference-counted).

    Args:
        n_layers, n_kv_heads, head_dim: model geometry.
        n_tokens: the budget: positions held at once over all sequences (rounded up
            to whole pages).
        page_size: positions per page.
        dtype, device: of the cache tensors.
    """

    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_tokens: int,
        page_size: int = PAGE_SIZE,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # Two positions at least: a sequence holds one prompt token and one generated token.
        if n_tokens < 2 or page_size < 1:
            raise ValueError(
                f"PagedKVCache needs n_tokens >= 2 and page_size >= 1, got {n_tokens} and "
                f"{page_size}"
            )
        self.page_size = page_size
        self.n_pages = pages_for(n_tokens, page_size)
        shape = (n_layers, self.n_pages * page_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._refs = [0] * self.n_pages
        # A min-heap: lowest pages first (see the module docstring).
        self._free: List[int] = list(range(self.n_pages))
        heapq.heapify(self._free)

    @property
    def n_tokens(self) -> int:
        """Positions the pool holds."""
        return self.n_pages * self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the two cache tensors."""
        return self.k.numel() * self.k.element_size() * 2

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers."""
        return self.nbytes // self.n_tokens

    @property
    def n_free(self) -> int:
        """Number of unused pages."""
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        """Take the ``n`` lowest free pages; raises when fewer are free (callers check)."""
        if n > len(self._free):
            raise RuntimeError(
                f"PagedKVCache.alloc: {n} pages asked, {len(self._free)} free; check n_free "
                "before admitting"
            )
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more holder of ``pages`` (allocated ones)."""
        for p in pages:
            if self._refs[p] == 0:
                raise RuntimeError(f"PagedKVCache.share: page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one holder of each page; a page nobody holds is free (its contents garbage)."""
        for p in pages:
            if not 0 <= p < self.n_pages or self._refs[p] == 0:
                raise RuntimeError(f"PagedKVCache.free: page {p} is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def rows(self, table: Sequence[int], start: int, end: int) -> List[int]:
        """Pool rows of positions ``[start, end)`` of a sequence with page table ``table``."""
        P = self.page_size
        return [table[t // P] * P + t % P for t in range(start, end)]

    def write(self, layer: int, rows: torch.Tensor, k, v) -> None:
        """Store ``k, v [T, n_kv_heads, head_dim]`` at pool ``rows [T]``."""
        self.k[layer].index_copy_(0, rows, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, rows, v.to(self.v.dtype))


def check_cache_fits(model_config, n_tokens: int, dtype: torch.dtype, device) -> None:
    """Refuse a cache that cannot fit: 90% of free GPU memory, or 80% of host RAM.

    On the CPU pages become resident only when written, but a long-running
    server eventually writes every page. ``model_config`` needs ``n_layers``,
    ``n_kv_heads`` and ``head_dim``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    mc = model_config
    need = 2 * mc.n_layers * mc.n_kv_heads * mc.head_dim * itemsize * n_tokens
    device = torch.device(device)
    # The margins leave room for what the cache does not count: activations and logits of
    # a step, and on the CPU, where the limit is total RAM, the weights and everything else.
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        limit, what = 0.9 * free, "90% of the free GPU memory"
    else:
        import psutil

        limit, what = 0.8 * psutil.virtual_memory().total, "80% of the host memory"
    if need > limit:
        per_token = need / max(1, n_tokens)
        raise ValueError(
            f"the KV cache needs {need / 2**30:.1f} GiB for {n_tokens} tokens "
            f"({per_token / 2**10:.1f} KiB each), more than {what} ({limit / 2**30:.1f} GiB); "
            f"lower EngineConfig.kv_cache_tokens to at most {int(limit // per_token)} (or "
            "max_running_requests x context_length when it is not set)"
        )
