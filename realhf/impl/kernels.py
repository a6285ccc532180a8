"""Hot-path kernels on packed data, with pure-PyTorch references and a fallback.

* `gae_packed`: generalised advantage estimation over a packed batch of sequences.
* `slice_intervals` / `set_intervals` / `merge_intervals`: copies between a flat
  parameter buffer and the packed intervals that parameter reallocation sends.
* `simd_cpu` / `simd_isa`: the extension where this CPU runs its vector kernels (the
  generation engine's decode attention, RMSNorm and RoPE, and training's log-softmax over
  the vocabulary, built for AVX-512 and for AVX2; their callers fall back to numba or
  torch's ops without them).

Each public function dispatches to the compiled extension for the tensor's device —
`realhf._C` (C++, CPU) or `realhf._C_cuda` (CUDA) — which `pip install
--no-build-isolation -e .` builds from `csrc/`. When the extension for that device is
missing it runs the `*_reference` function instead and warns once per process. The
references are what the tests compare the kernels against.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

try:
    from realhf import _C
except ImportError:  # not built: the references are used
    _C = None
try:
    from realhf import _C_cuda
except ImportError:  # no CUDA toolkit or CPU-only torch at build time
    _C_cuda = None

_warned = False

__all__ = [
    "SIMD_ISAS",
    "simd_cpu",
    "simd_isa",
    "simd_isas",
    "backend",
    "gae_packed",
    "gae_packed_reference",
    "gae_packed_naive",
    "slice_intervals",
    "slice_intervals_reference",
    "set_intervals",
    "set_intervals_reference",
    "merge_intervals",
    "merge_intervals_reference",
]


def _extension_for(device: torch.device):
    if device.type == "cpu":
        return _C
    if device.type == "cuda":
        return _C_cuda
    return None


def backend(device: str | torch.device = "cpu") -> str:
    """Which implementation runs for tensors on `device`: "cpp", "cuda" or "reference"."""
    device = torch.device(device)
    if _extension_for(device) is None:
        return "reference"
    return "cuda" if device.type == "cuda" else "cpp"


#: the builds of ``realhf._C``'s vector CPU kernels (``csrc/simd.h``), widest first
SIMD_ISAS = ("avx512", "avx2")


@functools.cache
def simd_isa() -> Optional[str]:
    """The widest build of ``realhf._C``'s vector CPU kernels (the generation engine's
    decode attention, RMSNorm and RoPE) this CPU runs: ``"avx512"`` (AVX-512 F/BW/DQ/VL),
    ``"avx2"`` (AVX2 with FMA), or ``None`` (extension not built, or built before these
    kernels, or by another compiler than GCC, or a CPU with neither)."""
    if _C is None or not hasattr(_C, "simd_isa"):
        return None
    return _C.simd_isa() or None


def simd_isas() -> tuple:
    """Every build this CPU runs, widest first (an AVX-512 CPU runs the AVX2 one too): the
    values the kernels' ``isa`` argument takes here."""
    best = simd_isa()
    return SIMD_ISAS[SIMD_ISAS.index(best) :] if best else ()


@functools.cache
def simd_cpu():
    """``realhf._C`` where this CPU runs its vector kernels (:func:`simd_isa`), else
    ``None``. Its ``decode_attention``, ``rms_norm`` and ``rope`` run the widest build
    unless given ``isa=``."""
    return _C if simd_isa() else None


def _kernel_or_warn(device: torch.device):
    """The extension module for `device`, or None (after one warning) to use the reference."""
    global _warned
    ext = _extension_for(device)
    if ext is None and not _warned:
        _warned = True
        warnings.warn(
            f"realhf kernels: no compiled extension for {device.type} tensors "
            "(realhf._C / realhf._C_cuda not built); using the slower pure-PyTorch "
            "references. Build them with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return ext


# ----------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------


def _check_gae(rewards, values, cu_seqlens, bootstrap):
    for name, x in (
        ("rewards", rewards),
        ("values", values),
        ("cu_seqlens", cu_seqlens),
        ("bootstrap", bootstrap),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 1:
            raise ValueError(
                f"gae_packed: {name} must be a 1-D tensor, got {getattr(x, 'shape', type(x))}"
            )
    if not rewards.is_floating_point() or values.dtype != rewards.dtype:
        raise ValueError(
            f"gae_packed: rewards and values must share a float dtype, got {rewards.dtype} and "
            f"{values.dtype}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"gae_packed: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if bootstrap.dtype != torch.bool:
        raise ValueError(f"gae_packed: bootstrap must be bool, got {bootstrap.dtype}")
    B, T = cu_seqlens.numel() - 1, rewards.numel()
    if B < 0:
        raise ValueError("gae_packed: cu_seqlens needs at least one entry (a leading 0)")
    if bootstrap.numel() != B:
        raise ValueError(f"gae_packed: bootstrap has {bootstrap.numel()} entries for {B} sequences")
    if values.numel() != T + B:
        raise ValueError(
            f"gae_packed: values must have T + B = {T} + {B} entries (each sequence has one "
            f"more value than rewards: the value after its last step), got {values.numel()}"
        )
    devices = {x.device for x in (rewards, values, cu_seqlens, bootstrap)}
    if len(devices) != 1:
        raise ValueError(
            f"gae_packed: all tensors must be on one device, got {sorted(map(str, devices))}"
        )
    cu = cu_seqlens.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(
            f"gae_packed: cu_seqlens must run from 0 to T={T}, got {int(cu[0])}..{int(cu[-1])}"
        )
    if B and bool((cu[1:] < cu[:-1]).any()):
        i = int(torch.nonzero(cu[1:] < cu[:-1])[0])
        raise ValueError(
            f"gae_packed: cu_seqlens decreases at sequence {i}: {cu[i : i + 2].tolist()}"
        )


def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bootstrap: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a packed batch of B sequences.

    Shapes: rewards [T], values [T + B], cu_seqlens [B + 1] (int32 or int64, from 0 to T),
    bootstrap [B] bool. Returns (advantages [T], returns [T]) in the dtype of rewards.

    Sequence i has n_i = cu_seqlens[i+1] - cu_seqlens[i] steps with rewards
    r = rewards[cu[i] : cu[i+1]] and n_i + 1 values v = values[cu[i] + i : cu[i+1] + i + 1]:
    the value offset of sequence i is cu[i] + i, and v[n_i] is the value of the state
    after the last step. For PPO on token sequences of length L: n_i = L - 1 (shifted
    per-token rewards) and the L values of the sequence's tokens. Backwards over
    t = n_i - 1 .. 0, with A[n_i] = 0:

        next_value = 0 if (t == n_i - 1 and not bootstrap[i]) else v[t + 1]
        delta[t]   = r[t] + gamma * next_value - v[t]
        A[t]       = delta[t] + gamma * lam * A[t + 1]
        R[t]       = A[t] + v[t]

    So a finished sequence (bootstrap False, e.g. it ended with EOS) ignores v[n_i]; a
    truncated one (bootstrap True) bootstraps from it. Empty sequences (n_i = 0) are
    allowed and produce nothing. Float16/bfloat16 inputs are computed in float32.
    """
    _check_gae(rewards, values, cu_seqlens, bootstrap)
    ext = _kernel_or_warn(rewards.device)
    # Half types in float32: the backward recurrence accumulates over hundreds of steps.
    compute = rewards.dtype if rewards.dtype in (torch.float32, torch.float64) else torch.float32
    r, v = rewards.to(compute), values.to(compute)
    if ext is None:
        adv, ret = gae_packed_reference(r, v, cu_seqlens, bootstrap, gamma, lam)
    else:
        adv, ret = ext.gae_packed(r, v, cu_seqlens, bootstrap, float(gamma), float(lam))
    return adv.to(rewards.dtype), ret.to(rewards.dtype)


def gae_packed_reference(rewards, values, cu_seqlens, bootstrap, gamma, lam):
    """Vectorised pure-PyTorch `gae_packed` (same arguments and semantics).

    It sweeps all sequences at once from their ends: step k updates position
    end_i - 1 - k of every sequence longer than k, so there are max(n_i) steps of
    vector work and memory stays O(T + B) (no padding to the longest sequence).
    """
    _check_gae(rewards, values, cu_seqlens, bootstrap)
    device, T = rewards.device, rewards.numel()
    cu = cu_seqlens.to(device, torch.int64)
    lens = cu[1:] - cu[:-1]
    B = lens.numel()
    seq = torch.repeat_interleave(torch.arange(B, device=device), lens)
    pos = torch.arange(T, device=device)
    v_t = values[pos + seq]
    v_next = values[pos + seq + 1]
    is_last = pos == cu[1:][seq] - 1
    next_value = torch.where(is_last & ~bootstrap[seq], torch.zeros_like(v_next), v_next)
    delta = rewards + gamma * next_value - v_t
    adv = torch.empty_like(rewards)
    # Longest first, so the sequences still running at step k are a prefix.
    order = torch.argsort(lens, descending=True, stable=True)
    ends = cu[1:][order]
    lens_cpu = lens.cpu()
    max_len = int(lens_cpu.max()) if B else 0
    # n_running[k]: how many sequences are longer than k.
    n_running = (B - torch.bincount(lens_cpu, minlength=max_len + 1).cumsum(0)).tolist()
    gl = gamma * lam
    for k in range(max_len):
        idx = ends[: n_running[k]] - 1 - k
        adv[idx] = delta[idx] if k == 0 else delta[idx] + gl * adv[idx + 1]
    return adv, adv + v_t


def gae_packed_naive(rewards, values, cu_seqlens, bootstrap, gamma, lam):
    """`gae_packed` as a per-sequence Python loop over Python floats (the benchmark's
    baseline and the tests' most literal statement of the semantics)."""
    _check_gae(rewards, values, cu_seqlens, bootstrap)
    r, v = rewards.tolist(), values.tolist()
    cu, boot = cu_seqlens.tolist(), bootstrap.tolist()
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for i in range(len(cu) - 1):
        s, e, off = cu[i], cu[i + 1], cu[i] + i
        last = 0.0
        for t in range(e - s - 1, -1, -1):
            nv = 0.0 if (t == e - s - 1 and not boot[i]) else v[off + t + 1]
            last = r[s + t] + gamma * nv - v[off + t] + gamma * lam * last
            adv[s + t] = last
            ret[s + t] = last + v[off + t]
    like = dict(dtype=rewards.dtype, device=rewards.device)
    return torch.tensor(adv, **like), torch.tensor(ret, **like)


# ----------------------------------------------------------------------------------
# Flat-buffer intervals
# ----------------------------------------------------------------------------------


def _as_intervals(intervals, what: str) -> torch.Tensor:
    """Intervals as a contiguous int64 CPU tensor of shape [N, 2]."""
    if isinstance(intervals, torch.Tensor):
        t = intervals.detach().to("cpu", torch.int64)
    else:
        arr = np.asarray(intervals, dtype=np.int64)
        t = torch.from_numpy(arr.reshape(-1, 2) if arr.size == 0 else arr)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(
            f"{what}: intervals must be (start, end) pairs of shape [N, 2], got {tuple(t.shape)}"
        )
    return t.contiguous()


def _check_intervals(iv: torch.Tensor, size: int, what: str) -> int:
    """Checks 0 <= start <= end <= size for every interval; returns the total length."""
    if iv.numel():
        bad = (iv[:, 0] < 0) | (iv[:, 1] < iv[:, 0]) | (iv[:, 1] > size)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"{what}: interval {i} = [{int(iv[i, 0])}, {int(iv[i, 1])}) must satisfy "
                f"0 <= start <= end <= {size} (the flat buffer size)"
            )
    return int((iv[:, 1] - iv[:, 0]).sum()) if iv.numel() else 0


def _check_flat(x, name: str, what: str):
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"{what}: {name} must be a contiguous 1-D tensor, got {getattr(x, 'shape', type(x))}"
        )


def slice_intervals(src: torch.Tensor, intervals, out: torch.Tensor | None = None) -> torch.Tensor:
    """The concatenation of ``src[s:e]`` for each ``(s, e)`` in ``intervals``, in order.

    Args:
        src: a contiguous 1-D tensor (any dtype; fp32/fp16/bf16 in practice).
        intervals: [N, 2] start/end pairs (tensor, array or list of pairs), half-open,
            0 <= s <= e <= len(src). They may overlap and come in any order.
        out: optional preallocated result (same dtype and device, sum of lengths).

    Returns:
        A 1-D tensor of sum(e - s) elements; piece j starts at the sum of the lengths
        of intervals before j.
    """
    what = "slice_intervals"
    _check_flat(src, "src", what)
    iv = _as_intervals(intervals, what)
    total = _check_intervals(iv, src.numel(), what)
    if out is not None:
        _check_flat(out, "out", what)
        if out.numel() != total or out.dtype != src.dtype or out.device != src.device:
            raise ValueError(
                f"{what}: out must hold {total} {src.dtype} elements on {src.device}, got "
                f"{out.numel()} {out.dtype} on {out.device}"
            )
    ext = _kernel_or_warn(src.device)
    if ext is None:
        res = slice_intervals_reference(src, iv)
        return res if out is None else out.copy_(res)
    return ext.slice_intervals(src, iv.to(src.device), out)


def slice_intervals_reference(src: torch.Tensor, intervals) -> torch.Tensor:
    """`slice_intervals` as a Python loop of tensor slices and one concatenation."""
    iv = _as_intervals(intervals, "slice_intervals_reference").tolist()
    if not iv:
        return src.new_empty(0)
    return torch.cat([src[s:e] for s, e in iv])


def set_intervals(src: torch.Tensor, dst: torch.Tensor, intervals) -> torch.Tensor:
    """Write consecutive pieces of ``src`` into ``dst[s:e]`` for each interval, in place.

    The inverse of `slice_intervals`: afterwards ``slice_intervals(dst, intervals)``
    equals ``src`` when the intervals do not overlap. Overlapping intervals are not
    allowed (which piece wins would be unspecified). Returns ``dst``.
    """
    what = "set_intervals"
    _check_flat(src, "src", what)
    _check_flat(dst, "dst", what)
    if src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(
            f"{what}: src is {src.dtype} on {src.device} but dst is {dst.dtype} on {dst.device}"
        )
    iv = _as_intervals(intervals, what)
    total = _check_intervals(iv, dst.numel(), what)
    if src.numel() != total:
        raise ValueError(f"{what}: src has {src.numel()} elements but the intervals cover {total}")
    ext = _kernel_or_warn(src.device)
    if ext is None:
        return set_intervals_reference(src, dst, iv)
    return ext.set_intervals(src, dst, iv.to(src.device))


def set_intervals_reference(src: torch.Tensor, dst: torch.Tensor, intervals) -> torch.Tensor:
    """`set_intervals` as a Python loop of tensor copies."""
    offset = 0
    for s, e in _as_intervals(intervals, "set_intervals_reference").tolist():
        dst[s:e].copy_(src[offset : offset + e - s])
        offset += e - s
    return dst


def merge_intervals(intervals):
    """Fuse each interval into the previous one when ``prev_end == start``.

    One pass in the given order (no sorting: the order is the packed layout, which
    merging must keep), so ``slice_intervals`` gives the same result before and after.
    Returns a list of (start, end) tuples for list input, else an int64 [M, 2] tensor.
    """
    as_list = not isinstance(intervals, (torch.Tensor, np.ndarray))
    iv = _as_intervals(intervals, "merge_intervals")
    # Intervals are host data whatever the buffer's device: always the CPU kernel.
    if _C is None:
        _kernel_or_warn(torch.device("cpu"))
        merged = torch.tensor(merge_intervals_reference(iv.tolist()), dtype=torch.int64).reshape(
            -1, 2
        )
    else:
        merged = _C.merge_intervals(iv)
    return [tuple(p) for p in merged.tolist()] if as_list else merged


def merge_intervals_reference(intervals: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """`merge_intervals` in plain Python on a list of pairs."""
    out: list[tuple[int, int]] = []
    for s, e in intervals:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
