import datetime
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, default_seqlens


def _rl_sample(seqlens, prefix="q", seed=0, metadata=True):
    """Items with several sequences each, carrying the standard RL keys."""
    g = torch.Generator().manual_seed(seed)
    ids = [f"{prefix}{i}" for i in range(len(seqlens))]
    n_seq = sum(len(s) for s in seqlens)
    T = sum(map(sum, seqlens))
    data = {
        "packed_input_ids": torch.randint(0, 100, (T,), generator=g),
        "packed_logprobs": torch.randn(T - n_seq, generator=g),
        "rewards": torch.randn(n_seq, generator=g),
        "prompt_mask": torch.zeros(T, dtype=torch.bool),
    }
    meta = {"scores": [float(i) for i in range(len(ids))]} if metadata else None
    return SequenceSample.from_default(ids, seqlens, data, meta)


def _assert_same(a: SequenceSample, b: SequenceSample):
    assert a.ids == b.ids and a.keys == b.keys and a.seqlens == b.seqlens
    assert a.metadata == b.metadata
    for k in a.keys:
        assert torch.equal(a.data[k], b.data[k]), k


# ----------------------------------------------------------------------------- build


def test_from_default_derives_lengths_per_key():
    s = _rl_sample([[3, 4], [2], [5, 1, 1]])
    assert s.seqlens["packed_input_ids"] == [[3, 4], [2], [5, 1, 1]]
    assert s.seqlens["packed_logprobs"] == [[2, 3], [1], [4, 0, 0]]
    assert s.seqlens["rewards"] == [[1, 1], [1], [1, 1, 1]]
    assert len(s) == s.bs == 3
    assert s.item_tokens("packed_input_ids") == [7, 2, 7]
    assert s.cu_seqlens("packed_input_ids").tolist() == [0, 3, 7, 9, 14, 15, 16]
    assert s.cu_seqlens("packed_input_ids").dtype == torch.int32
    # One int per item means single-sequence items.
    s1 = SequenceSample.from_default(["x", "y"], [3, 2], {"packed_input_ids": torch.arange(5)})
    assert s1.seqlens["packed_input_ids"] == [[3], [2]]


def test_default_seqlens_rules():
    assert default_seqlens("values", [[4, 2]]) == [[4, 2]]
    assert default_seqlens("advantages", [[4, 2]]) == [[3, 1]]
    assert default_seqlens("seq_no_eos_mask", [[4, 2]]) == [[1, 1]]
    with pytest.raises(ValueError, match="no default length rule for key 'foo'"):
        default_seqlens("foo", [[1]])
    with pytest.raises(ValueError, match="'advantages'.*L >= 1"):
        default_seqlens("advantages", [[0]])


def _kwargs(**over):
    kw = dict(
        keys={"x"},
        trailing_shapes={"x": ()},
        dtypes={"x": torch.float32},
        ids=["a", "b"],
        seqlens={"x": [[2], [1, 1]]},
        data={"x": torch.zeros(4)},
    )
    kw.update(over)
    return kw


def test_construction_errors_name_key_and_item():
    SequenceSample(**_kwargs())  # the baseline is valid
    with pytest.raises(ValueError, match=r"key 'x' has data of shape \(5,\).*sum to 4.*'a': 2"):
        SequenceSample(**_kwargs(data={"x": torch.zeros(5)}))
    with pytest.raises(ValueError, match="duplicate id 'a' at items 0 and 1"):
        SequenceSample(**_kwargs(ids=["a", "a"]))
    with pytest.raises(ValueError, match="key 'x', item 'b'.*non-negative ints"):
        SequenceSample(**_kwargs(seqlens={"x": [[2], [1, -1]]}, data={"x": torch.zeros(2)}))
    with pytest.raises(ValueError, match="key 'y' is in keys but missing from seqlens"):
        SequenceSample(**_kwargs(keys={"x", "y"}))
    with pytest.raises(ValueError, match="key 'x' has seqlens for 1 items but there are 2"):
        SequenceSample(**_kwargs(seqlens={"x": [[4]]}))
    with pytest.raises(ValueError, match="key 'x' has data of dtype torch.int64"):
        SequenceSample(**_kwargs(data={"x": torch.zeros(4, dtype=torch.int64)}))
    with pytest.raises(ValueError, match=r"trailing shape should be \(\)"):
        SequenceSample(**_kwargs(data={"x": torch.zeros(4, 2)}))
    with pytest.raises(ValueError, match="metadata 'm' has 1 entries for 2 items"):
        SequenceSample(**_kwargs(metadata={"m": [1]}))
    with pytest.raises(ValueError, match="id of item 1 must be a str"):
        SequenceSample(**_kwargs(ids=["a", 3]))


def test_micro_batch_spec_validates():
    assert MicroBatchSpec().n_mbs == 1
    with pytest.raises(ValueError, match="n_mbs must be an integer >= 1, got 0"):
        MicroBatchSpec(n_mbs=0)
    with pytest.raises(ValueError, match="max_tokens_per_mb must be an integer >= 1"):
        MicroBatchSpec(max_tokens_per_mb=0.5)


# ----------------------------------------------------------------------------- items


def test_gather_unpack_round_trip_and_trailing_dims():
    s = _rl_sample([[3, 4], [2], [5, 1, 1], [6]])
    parts = s.unpack()
    assert [p.ids for p in parts] == [["q0"], ["q1"], ["q2"], ["q3"]]
    assert parts[2].seqlens["packed_logprobs"] == [[4, 0, 0]]
    _assert_same(SequenceSample.gather(parts), s)
    # Trailing dims travel with the packed dim.
    t = SequenceSample.from_default(["a", "b"], [2, 3], {"values": torch.randn(5, 2, 3)})
    assert t.trailing_shapes["values"] == (2, 3)
    u = t.unpack()
    assert u[1].data["values"].shape == (3, 2, 3)
    _assert_same(SequenceSample.gather(u), t)


def test_gather_errors():
    a, b = _rl_sample([[2]], "a"), _rl_sample([[3]], "b")
    with pytest.raises(ValueError, match="duplicate id 'a0'"):
        SequenceSample.gather([a, a])
    with pytest.raises(
        ValueError, match="key 'packed_input_ids' has data in some samples but not in sample 1"
    ):
        SequenceSample.gather([a, b.meta()])
    with pytest.raises(ValueError, match="sample 1 lacks key 'rewards'"):
        SequenceSample.gather([a, b.select(["packed_input_ids"])], keys=["rewards"])
    g = SequenceSample.gather([a, b], keys=["rewards"])
    assert g.keys == {"rewards"} and g.ids == ["a0", "b0"]


def test_select_items_and_shuffled():
    s = _rl_sample([[3], [4, 1], [2], [5]])
    sel = s.select_items([2, 0])
    assert sel.ids == ["q2", "q0"] and sel.metadata["scores"] == [2.0, 0.0]
    assert torch.equal(
        sel.data["packed_input_ids"],
        torch.cat([s.data["packed_input_ids"][8:10], s.data["packed_input_ids"][:3]]),
    )
    # Contiguous selections are views.
    assert (
        sel is not s
        and s.select_items([1, 2]).data["packed_input_ids"].data_ptr()
        == s.data["packed_input_ids"][3:].data_ptr()
    )
    a, b = s.shuffled(7), s.shuffled(7)
    assert a.ids == b.ids and sorted(a.ids) == sorted(s.ids)
    with pytest.raises(IndexError, match="index 4 out of range"):
        s.select_items([4])


# ----------------------------------------------------------------------------- split


def test_split_hand_made_and_restore_order():
    # Tokens per item (packed_input_ids has the most): 4, 9, 8, 1, 2. Decreasing:
    # 9 | 8 | 4 open groups; 2 joins the smaller of the one-item groups that fit (4);
    # 1 joins a one-item group, the smaller (8).
    s = _rl_sample([[4], [4, 5], [8], [1], [2]])
    mbs, fwd, bwd = s.split(MicroBatchSpec(max_tokens_per_mb=10))
    assert [m.ids for m in mbs] == [["q0", "q4"], ["q1"], ["q2", "q3"]]
    assert fwd == [0, 4, 1, 2, 3] and bwd == [0, 2, 3, 4, 1]
    assert [fwd[i] for i in bwd] == [0, 1, 2, 3, 4]
    restored = SequenceSample.gather(mbs).select_items(bwd)
    _assert_same(restored, s)
    # n_mbs forces more micro-batches than the budget needs.
    mbs, _, _ = s.split(MicroBatchSpec(n_mbs=4))
    assert len(mbs) == 4


@pytest.mark.parametrize("seed", range(10))
def test_split_random_within_budget(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    seqlens = [rng.integers(1, 30, size=rng.integers(1, 4)).tolist() for _ in range(n)]
    s = _rl_sample(seqlens, seed=seed)
    budget = int(max(s.item_tokens("packed_input_ids")) + rng.integers(0, 100))
    spec = MicroBatchSpec(n_mbs=int(rng.integers(1, 5)), max_tokens_per_mb=budget)
    mbs, fwd, bwd = s.split(spec)
    assert len(mbs) >= min(spec.n_mbs, n)
    assert all(sum(m.item_tokens("packed_input_ids")) <= budget for m in mbs)
    assert sorted(fwd) == list(range(n))
    _assert_same(SequenceSample.gather(mbs).select_items(bwd), s)


def test_split_item_over_budget_names_item():
    s = _rl_sample([[3], [4, 5]])
    with pytest.raises(
        ValueError, match=r"item 'q1' has 9 tokens of key 'packed_input_ids'.*at least 9"
    ):
        s.split(MicroBatchSpec(max_tokens_per_mb=8))


def test_split_metadata_only_sample():
    m = _rl_sample([[5], [5], [5]]).meta()
    mbs, _, _ = m.split(MicroBatchSpec(max_tokens_per_mb=10))
    assert [x.ids for x in mbs] == [["q0", "q1"], ["q2"]] and all(x.data is None for x in mbs)


def _synced_worker(rank, init_file, seqlens_per_rank, n_mbs, result_q):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        s = _rl_sample(seqlens_per_rank[rank], prefix=f"r{rank}_")
        spec = MicroBatchSpec(n_mbs=n_mbs, max_tokens_per_mb=10)
        try:
            mbs, fwd, _ = s.synced_data_parallel_split(spec)
            result_q.put((rank, len(mbs), sorted(fwd)))
        except ValueError as e:
            result_q.put((rank, "error", str(e)))
        except BaseException as e:  # surface anything else in the parent's assertion
            result_q.put((rank, "crash", repr(e)))
    finally:
        dist.destroy_process_group()
    from realhf.base import shutdown

    shutdown.hard_exit(0)  # a plain return could abort in teardown (see base/shutdown.py)


def _run_synced(tmp_path, seqlens_per_rank, n_mbs=1):
    # fork, not spawn: under --import-mode=importlib a child cannot re-import this module.
    ctx = mp.get_context("fork")
    tmp_path.mkdir(parents=True, exist_ok=True)
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_synced_worker, args=(r, tmp_path / "init", seqlens_per_rank, n_mbs, q))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    out = dict((r, rest) for r, *rest in (q.get(timeout=30) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return out


@pytest.mark.slow
def test_synced_split_agrees_on_count(tmp_path):
    # Rank 0 fits in one micro-batch; rank 1 needs three: both end with three.
    out = _run_synced(tmp_path, [[[3], [2], [4]], [[9], [8], [7], [1]]])
    assert out[0] == [3, [0, 1, 2]]
    assert out[1][0] == 3
    # A rank with fewer items than the agreed count fails on every rank, not a hang.
    out = _run_synced(tmp_path / "b", [[[3], [2]], [[9], [8], [7]]])
    assert out[0][0] == "error" and out[1][0] == "error"
    assert "need 3 micro-batches but one rank has only 2 items" in out[0][1]


def test_synced_split_without_distributed_is_split():
    s = _rl_sample([[5], [6], [3]])
    assert (
        s.synced_data_parallel_split(MicroBatchSpec(max_tokens_per_mb=9))[1]
        == s.split(MicroBatchSpec(max_tokens_per_mb=9))[1]
    )


# ----------------------------------------------------------------------------- keys


def test_select_update_remap():
    s = _rl_sample([[3], [4, 1]])
    sub = s.select(["rewards"])
    assert sub.keys == {"rewards"} and sub.data["rewards"] is s.data["rewards"]
    with pytest.raises(KeyError, match="no key 'nope'"):
        s.select(["nope"])
    # update_ merges keys of the same ids given in another order.
    adv = SequenceSample.from_default(
        ["q1", "q0"], [[4, 1], [3]], {"advantages": torch.tensor([1.0, 2, 3, 4, 5])}, {"v": [1, 0]}
    )
    s.update_(adv)
    assert s.seqlens["advantages"] == [[2], [3, 0]]
    assert s.data["advantages"].tolist() == [4.0, 5, 1, 2, 3] and s.metadata["v"] == [0, 1]
    with pytest.raises(ValueError, match="ids differ"):
        s.update_(_rl_sample([[3]], prefix="z"))
    s.remap_keys_({"advantages": "adv", "rewards": "r"})
    assert s.keys == {"adv", "r", "packed_input_ids", "packed_logprobs", "prompt_mask"}
    assert s.data["adv"].tolist() == [4.0, 5, 1, 2, 3] and s.dtypes["r"] == torch.float32
    with pytest.raises(ValueError, match="maps two keys onto 'r'"):
        s.remap_keys_({"adv": "r"})
    with pytest.raises(KeyError, match="no key 'gone'"):
        s.remap_keys_({"gone": "x"})


def test_update_meta_with_data():
    s = _rl_sample([[3], [2]]).meta()
    s.update_(SequenceSample.from_default(["q0", "q1"], [3, 2], {"values": torch.ones(5)}))
    assert s.data["values"].shape == (5,) and s.data["rewards"] is None


def test_meta_and_json_round_trip():
    s = _rl_sample([[3, 4], [2]])
    m = s.meta()
    assert m.data is None and m.seqlens == s.seqlens
    m.seqlens["rewards"][0][0] = 99  # a deep copy: the source is untouched
    assert s.seqlens["rewards"][0][0] == 1
    wire = json.loads(json.dumps(s.as_json_compatible()))
    back = SequenceSample.from_json_compatible(wire)
    assert back.data is None
    assert back.as_json_compatible() == s.as_json_compatible()
    assert back.dtypes["prompt_mask"] == torch.bool
    with pytest.raises(ValueError, match="unknown dtype name 'float99'"):
        SequenceSample.from_json_compatible(
            {**wire, "dtypes": {**wire["dtypes"], "rewards": "float99"}}
        )
