"""Param spec layout and interval helpers."""

from __future__ import annotations

import pytest
import torch

from realhf.impl.model.nn.flat_param import (
    build_param_spec,
    flat_intervals,
    flat_view,
    layer_interval,
)


def _spec():
    return build_param_spec(
        [
            (0, [("wte.weight", (4, 2))]),
            (1, [("a.weight", (2, 2)), ("a.bias", (2,))]),
            (2, [("weight", (3, 2))]),
        ]
    )


def test_reverse_layer_order_and_total():
    spec, total = _spec()
    assert total == 8 + 4 + 2 + 6
    assert spec["2.weight"].offset == 0
    assert spec["1.a.weight"].offset == 6 and spec["1.a.bias"].offset == 10
    assert spec["0.wte.weight"].offset == 12 and spec["0.wte.weight"].end == total


def test_intervals_merge_adjacent_and_sort():
    spec, _ = _spec()
    assert flat_intervals(spec, ["0.wte.weight", "1.a.bias", "1.a.weight"]) == [(6, 20)]
    assert flat_intervals(spec, ["2.weight", "0.wte.weight"]) == [(0, 6), (12, 20)]
    assert layer_interval(spec, 1) == (6, 12)
    with pytest.raises(KeyError, match="not in the param spec"):
        flat_intervals(spec, ["9.x"])


def test_flat_view_shares_storage():
    spec, total = _spec()
    flat = torch.arange(total, dtype=torch.float32)
    v = flat_view(flat, spec["1.a.bias"])
    assert v.tolist() == [10.0, 11.0]
    v.zero_()
    assert flat[10] == 0


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="declared twice"):
        build_param_spec([(0, [("w", (1,)), ("w", (1,))])])
