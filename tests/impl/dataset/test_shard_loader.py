"""ShardLoader: seeded epoch order, position, and exact resumption."""

from __future__ import annotations

import json

import pytest
import torch

from realhf.api.core.data_api import SequenceSample
from realhf.impl.dataset.shard_loader import ShardLoader


class _Items:
    def __init__(self, n, prefix="x"):
        self.items = [
            SequenceSample.from_default(
                [f"{prefix}{i}"], [1], {"packed_prompts": torch.tensor([i])}
            )
            for i in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _ids(items):
    return [s.ids[0] for s in items]


def test_epochs_are_permutations_fixed_by_seed_and_epoch():
    a, b = ShardLoader(_Items(10), seed=3), ShardLoader(_Items(10), seed=3)
    e0 = _ids(a.take(0, 4)) + _ids(a.take(0, 10))
    assert sorted(e0) == sorted(f"x{i}" for i in range(10)) and a.remaining == 0
    assert _ids(b.take(0, 10)) == e0
    e1 = _ids(a.take(1, 10))
    assert sorted(e1) == sorted(e0) and e1 != e0 and a.epoch == 1
    assert _ids(ShardLoader(_Items(10), seed=4).take(0, 10)) != e0


def test_moving_on_early_or_skipping_an_epoch_is_refused():
    loader = ShardLoader(_Items(4), seed=0)
    loader.take(0, 2)
    with pytest.raises(ValueError, match="loader is in epoch 0 with 2 items left"):
        loader.take(1, 1)
    loader.take(0, 2)
    with pytest.raises(ValueError, match="asked for items of epoch 2"):
        loader.take(2, 1)


def test_state_roundtrip_resumes_the_same_order():
    full = ShardLoader(_Items(9), seed=7)
    order = _ids(full.take(0, 9)) + _ids(full.take(1, 9))
    a = ShardLoader(_Items(9), seed=7)
    got = _ids(a.take(0, 9)) + _ids(a.take(1, 4))
    state = json.loads(json.dumps(a.state_dict()))
    b = ShardLoader(_Items(9), seed=7)
    b.load_state_dict(state)
    assert (b.epoch, b.n_used, b.remaining) == (1, 4, 5)
    got += _ids(b.take(1, 9))
    assert got == order


def test_state_of_another_shard_is_refused():
    a = ShardLoader(_Items(4), seed=1)
    a.take(0, 1)
    with pytest.raises(ValueError, match="shard of 4 items, this worker loaded 5"):
        ShardLoader(_Items(5), seed=1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="names items"):
        ShardLoader(_Items(4, prefix="y"), seed=1).load_state_dict(a.state_dict())


def test_bad_datasets_are_refused():
    class Dup(_Items):
        def __getitem__(self, i):
            return self.items[0]

    with pytest.raises(ValueError, match="id 'x0' appears more than once"):
        ShardLoader(Dup(2), seed=0)

    class Multi(_Items):
        def __getitem__(self, i):
            return SequenceSample.gather(self.items)

    with pytest.raises(TypeError, match="one-item SequenceSample"):
        ShardLoader(Multi(2), seed=0)
