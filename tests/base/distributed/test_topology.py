import pytest

from realhf.base.distributed.topology import (
    DataPipeTensorParallelTopology,
    PipeDataTensorParallelTopology,
    ProcessTopology,
)


def test_row_major_layout_by_hand():
    t = PipeDataTensorParallelTopology(num_pp=2, num_dp=3, num_tp=2)
    assert t.world_size() == 12
    # last axis fastest: rank = ((pipe * 3) + data) * 2 + tensor
    assert t.get_rank(pipe=0, data=0, tensor=1) == 1
    assert t.get_rank(pipe=0, data=1, tensor=0) == 2
    assert t.get_rank(pipe=1, data=2, tensor=1) == 11
    assert t.get_coord(7) == (1, 0, 1)
    assert t.get_coord(7).data == 0
    for r in range(12):
        assert t.get_rank(**t.get_coord(r)._asdict()) == r


def test_filter_and_axis_lists_by_hand():
    t = PipeDataTensorParallelTopology(2, 2, 2)
    assert t.filter_match(pipe=1) == [4, 5, 6, 7]
    assert t.filter_match(data=0, tensor=1) == [1, 5]
    assert t.filter_match() == list(range(8))
    assert t.get_axis_list("tensor", 0) == [0, 2, 4, 6]
    assert t.get_axis_comm_lists("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_inference_layout_and_singleton_axis():
    t = DataPipeTensorParallelTopology(num_dp=2, num_pp=1, num_tp=2)
    assert t.get_axis_names() == ["data", "pipe", "tensor"]
    assert t.get_rank(data=1, pipe=0, tensor=0) == 2
    assert t.get_axis_comm_lists("pipe") == [[0], [1], [2], [3]]
    assert t.get_dim("data") == 2


def test_rank_repr():
    t = PipeDataTensorParallelTopology(2, 2, 2)
    assert t.get_rank_repr(5) == "pipe_01-tensor_01"
    # ranks that differ only in data share the repr (same parameter shard)
    assert t.get_rank_repr(1) == t.get_rank_repr(3)
    assert t.get_rank_repr(6, omit_axes=(), inner_sep="", outer_sep=".") == "pipe01.data01.tensor00"


def test_equality_and_errors():
    assert ProcessTopology(["a", "b"], [2, 3]) == ProcessTopology(["a", "b"], [2, 3])
    assert ProcessTopology(["a", "b"], [2, 3]) != ProcessTopology(["b", "a"], [2, 3])
    t = ProcessTopology(["a", "b"], [2, 3])
    with pytest.raises(ValueError, match="one dim per axis"):
        ProcessTopology(["a"], [1, 2])
    with pytest.raises(ValueError, match="distinct"):
        ProcessTopology(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(["a"], [0])
    with pytest.raises(ValueError, match="exactly the axes"):
        t.get_rank(a=0)
    with pytest.raises(ValueError, match="outside"):
        t.get_rank(a=0, b=3)
    with pytest.raises(ValueError, match="out of range"):
        t.get_coord(6)
    with pytest.raises(ValueError, match="Unknown axis"):
        t.filter_match(c=0)
    with pytest.raises(ValueError, match="out of range"):
        t.get_axis_list("b", 3)
