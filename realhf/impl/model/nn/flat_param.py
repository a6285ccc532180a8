"""The flat parameter buffer: every local parameter is a view into one 1-D tensor.

Keeping all weights in a single contiguous buffer lets later code move them as
intervals (parameter reallocation slices ``[start, end)`` ranges and sends them
in a few large messages; offloading copies one tensor) instead of walking
hundreds of small tensors.  The layout is recorded as a *param spec*:
``name -> ParamSpec(offset, shape)``.

Layers are laid out in reverse order (head first, embedding last) so that the
gradients that backward produces first sit at the front of the buffer — a
bucketed gradient all-reduce can then start on the leading bucket while the
rest of backward runs.  Within a layer, parameters keep their declaration order,
so every layer occupies one contiguous interval.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple

import torch


class ParamSpec(NamedTuple):
    """Where one parameter lives in the flat buffer."""

    offset: int
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the last flat index of the parameter."""
        return self.offset + self.numel


def build_param_spec(
    layer_params: Sequence[Tuple[int, Sequence[Tuple[str, Tuple[int, ...]]]]],
) -> Tuple[Dict[str, ParamSpec], int]:
    """Lay out the parameters of several layers in one buffer.

    Args:
        layer_params: ``[(layer_idx, [(local_name, shape), ...]), ...]`` in
            forward order; full names become ``f"{layer_idx}.{local_name}"``.

    Returns:
        ``(spec, total_numel)`` with layers placed in reverse order.
    """
    spec: Dict[str, ParamSpec] = {}
    offset = 0
    for layer_idx, params in reversed(list(layer_params)):
        for local, shape in params:
            name = f"{layer_idx}.{local}"
            if name in spec:
                raise ValueError(f"parameter {name!r} is declared twice")
            shape = tuple(int(s) for s in shape)
            spec[name] = ParamSpec(offset, shape)
            offset += math.prod(shape)
    return spec, offset


def flat_view(flat: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """The view of ``flat`` that holds the parameter described by ``spec``."""
    return flat[spec.offset : spec.end].view(spec.shape)


def flat_intervals(spec: Dict[str, ParamSpec], names: Iterable[str]) -> List[Tuple[int, int]]:
    """Merged, sorted ``[start, end)`` flat intervals covering ``names``.

    Unknown names raise ``KeyError`` listing a few known ones.
    """
    ivs = []
    for n in names:
        if n not in spec:
            known = ", ".join(list(spec)[:5])
            raise KeyError(f"parameter {n!r} is not in the param spec (e.g. {known}, ...)")
        ivs.append((spec[n].offset, spec[n].end))
    ivs.sort()
    merged: List[Tuple[int, int]] = []
    for s, e in ivs:
        if merged and merged[-1][1] >= s:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def layer_interval(spec: Dict[str, ParamSpec], layer_idx: int) -> Tuple[int, int]:
    """The single ``[start, end)`` interval holding all parameters of a layer."""
    prefix = f"{layer_idx}."
    ivs = flat_intervals(spec, [n for n in spec if n.startswith(prefix)])
    if not ivs:
        raise KeyError(f"layer {layer_idx} has no parameters in the param spec")
    if len(ivs) != 1:
        raise AssertionError(f"layer {layer_idx} is not contiguous in the flat buffer: {ivs}")
    return ivs[0]
