"""LocalStore: a model worker's per-item tensors."""

from __future__ import annotations

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.system.dag.local_store import LocalStore


def _sample():
    return SequenceSample.from_default(
        ids=["a", "b"],
        seqlens=[[2, 1], [3]],
        data={"packed_input_ids": torch.arange(6), "rewards": torch.tensor([1.0, 2.0, 3.0])},
        metadata={"q": ["qa", "qb"]},
    )


def test_put_sample_then_assemble_in_any_order():
    store = LocalStore("mw")
    store.put_sample(_sample())
    assert sorted(store.ids()) == ["a", "b"] and store.has("a", "rewards")
    meta = _sample().select(["packed_input_ids"]).meta().select_items([1, 0])
    out = store.sample(meta)
    assert out.ids == ["b", "a"]
    assert out.data["packed_input_ids"].tolist() == [3, 4, 5, 0, 1, 2]
    assert out.metadata == {"q": ["qb", "qa"]}


def test_errors_name_item_and_key():
    store = LocalStore("mw/1")
    store.put("a", "k", torch.zeros(2), [2])
    with pytest.raises(KeyError, match="mw/1 holds no data for key 'v' of item 'a'"):
        store.get("a", "v")
    with pytest.raises(ValueError, match="data has 3 rows but seqlens"):
        store.put("a", "k", torch.zeros(3), [2])
    meta = SequenceSample(
        keys={"k"},
        trailing_shapes={"k": ()},
        dtypes={"k": torch.float32},
        ids=["a"],
        seqlens={"k": [[5]]},
        data=None,
    )
    with pytest.raises(ValueError, match="holds 2 rows but the master expects seqlens"):
        store.sample(meta)
    with pytest.raises(ValueError, match="metadata-only"):
        store.put_sample(meta)


def test_drop_ignores_unknown_ids():
    store = LocalStore()
    store.put_sample(_sample())
    assert store.drop(["a", "zz"]) == 1
    assert store.ids() == ["b"]
