"""SampleBuffer: the master's bookkeeping of items, keys, holders and consumers."""

from __future__ import annotations

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.system.dag.buffer import BufferError, SampleBuffer


def _meta(ids, lens, key="packed_prompts", dtype=torch.long, metadata=None):
    return SequenceSample(
        keys={key},
        trailing_shapes={key: ()},
        dtypes={key: dtype},
        ids=list(ids),
        seqlens={key: [[l] for l in lens]},
        data=None,
        metadata=metadata or {},
    )


def test_add_orders_by_birth_and_ready_needs_all_keys():
    b = SampleBuffer()
    b.add(_meta(["b", "a"], [3, 5], metadata={"q": ["qb", "qa"]}), owner=1)
    b.add(_meta(["c"], [2], metadata={"q": ["qc"]}), owner=0)
    assert b.ids == ["b", "a", "c"]
    assert b.ready("gen", ["packed_prompts"]) == ["b", "a", "c"]
    assert b.ready("train", ["packed_prompts", "rewards"]) == []
    b.amend(_meta(["a"], [1], key="rewards", dtype=torch.float32), owner=0)
    assert b.ready("train", ["packed_prompts", "rewards"]) == ["a"]
    assert b.holders("a", "packed_prompts") == [1] and b.holders("a", "rewards") == [0]
    assert b.ready("gen", ["packed_prompts"], among=["c", "b"]) == ["b", "c"]


def test_mark_consumed_removes_from_ready_and_twice_is_an_error():
    b = SampleBuffer()
    b.add(_meta(["x", "y"], [1, 2]), owner=0)
    b.mark_consumed(["x"], "gen")
    assert b.ready("gen", ["packed_prompts"]) == ["y"]
    assert b.ready("other", ["packed_prompts"]) == ["x", "y"]
    assert not b.consumed(["x", "y"], ["gen"])
    b.mark_consumed(["y"], "gen")
    assert b.consumed(["x", "y"], ["gen"])
    with pytest.raises(BufferError, match="consumed item 'x' twice"):
        b.mark_consumed(["x"], "gen")


def test_meta_builds_sample_and_fills_missing_metadata():
    b = SampleBuffer()
    b.add(_meta(["a", "b"], [3, 4], metadata={"q": ["qa", "qb"]}), owner=0)
    out = SequenceSample(
        keys={"scores"},
        trailing_shapes={"scores": (2,)},
        dtypes={"scores": torch.float32},
        ids=["b"],
        seqlens={"scores": [[1]]},
        data=None,
        metadata={"verdict": [True]},
    )
    b.amend(out, owner=1)
    m = b.meta(["b", "a"], ["packed_prompts"])
    assert m.data is None and m.ids == ["b", "a"]
    assert m.seqlens["packed_prompts"] == [[4], [3]]
    assert m.metadata == {"q": ["qb", "qa"], "verdict": [True, None]}
    s = b.meta(["b"], ["scores"])
    assert s.trailing_shapes["scores"] == (2,) and s.dtypes["scores"] == torch.float32
    with pytest.raises(BufferError, match="lacks keys"):
        b.meta(["a"], ["scores"])


def test_errors_name_the_problem():
    b = SampleBuffer()
    b.add(_meta(["a"], [2]), owner=0)
    with pytest.raises(BufferError, match="already in the buffer"):
        b.add(_meta(["a"], [2]), owner=1)
    with pytest.raises(BufferError, match="no item 'zz'"):
        b.entry("zz")
    with pytest.raises(BufferError, match="already owned by rank 0"):
        b.amend(_meta(["a"], [2]), owner=1)
    with_data = SequenceSample.from_default(["a"], [2], {"rewards": torch.zeros(1)})
    with pytest.raises(BufferError, match="received tensors"):
        b.amend(with_data, owner=0)


def test_holders_item_tokens_and_remove():
    b = SampleBuffer()
    b.add(_meta(["a", "b"], [2, 9]), owner=1)
    b.amend(_meta(["a", "b"], [7, 1], key="packed_input_ids"), owner=0)
    b.add_holder(["a"], "packed_prompts", 0)
    b.add_holder(["a"], "packed_prompts", 0)  # idempotent
    assert b.holder_map(["a", "b"], ["packed_prompts"]) == {
        ("a", "packed_prompts"): [1, 0],
        ("b", "packed_prompts"): [1],
    }
    # packed_prompts has 11 tokens in total, packed_input_ids 8: measured on packed_prompts.
    assert b.item_tokens(["a", "b"], ["packed_input_ids", "packed_prompts"]) == [2, 9]
    assert b.item_tokens(["a", "b"], []) == [1, 1]
    b.remove(["a"])
    assert b.ids == ["b"] and "a" not in b and len(b) == 1
