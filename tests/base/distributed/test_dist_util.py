"""realhf.base.distributed.dist_util: all-reduce on the device the group's backend needs.

The two-rank gloo test runs this file as a script (``python test_dist_util.py --rank R
...``), one process per rank, meeting in a FileStore.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks

from realhf.base import shutdown
from realhf.base.distributed import dist_util

CPU, CUDA, CUDA1 = torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 1)


@pytest.mark.parametrize(
    "backend, device, expected",
    [
        ("nccl", CPU, CUDA),  # nccl reduces CUDA tensors only: the current device
        ("nccl", CUDA1, CUDA1),  # already on a CUDA device: reduced where it is
        ("gloo", CPU, CPU),
        ("gloo", CUDA1, CUDA1),  # gloo reduces CUDA tensors as well
        ("cpu:gloo,cuda:nccl", CPU, CPU),  # per-device backends pick gloo for CPU
        ("cpu:gloo,cuda:nccl", CUDA1, CUDA1),
    ],
)
def test_reduce_device(backend, device, expected):
    assert dist_util.reduce_device(backend, device) == expected


def test_reduce_device_needs_no_cuda():
    """The choice is made without touching CUDA (testable, and cheap on every call)."""
    assert dist_util.reduce_device("nccl", "cpu") == CUDA


def _run_rank(args) -> None:
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=30)
    )
    r = args.rank
    out = {}
    try:
        t = torch.tensor([r + 1.0, 10.0 * (r + 1)])
        same = dist_util.all_reduce_(t) is t
        out["sum"] = t.tolist()
        out["returns_its_argument"] = same
        lo = torch.tensor([5 - r, r], dtype=torch.int64)
        dist_util.all_reduce_(lo, dist.ReduceOp.MIN)
        out["min"] = lo.tolist()
        hi = torch.tensor([5 - r, r], dtype=torch.int64)
        dist_util.all_reduce_(hi, dist.ReduceOp.MAX, backend="gloo")
        out["max"] = hi.tolist()
        sub = dist.new_group(list(range(args.world)), backend="gloo")
        g = torch.full((3,), float(r))
        dist_util.all_reduce_(g, group=sub)
        out["subgroup_sum"] = g.tolist()
        out["dtype_device"] = [str(g.dtype), str(g.device), str(lo.dtype), str(lo.device)]
    finally:
        with open(os.path.join(args.out_dir, f"rank{r}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
        shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)


@pytest.mark.slow
def test_two_gloo_ranks(tmp_path, no_leftover_processes):
    world = 2
    results = run_ranks(
        __file__, world, lambda r: ["--store", str(tmp_path / "store")], str(tmp_path)
    )
    for res in results:
        assert res["sum"] == [3.0, 30.0], results
        assert res["returns_its_argument"]
        assert res["min"] == [4, 0] and res["max"] == [5, 1]
        assert res["subgroup_sum"] == [1.0, 1.0, 1.0]
        assert res["dtype_device"] == ["torch.float32", "cpu", "torch.int64", "cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for nccl")
def test_nccl_reduces_a_cpu_tensor_on_the_gpu_and_copies_back(tmp_path, monkeypatch):
    """A one-rank nccl group: a CPU tensor is reduced on the current CUDA device and the
    result lands back in the same CPU tensor."""
    torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    seen = []
    real = dist.all_reduce

    def recording(t, *a, **k):
        seen.append(t.device)
        work = real(t, *a, **k)
        t.add_(1)  # one rank reduces to itself: mark the result to see it copied back
        return work

    monkeypatch.setattr(dist, "all_reduce", recording)
    try:
        t = torch.tensor([7, -3], dtype=torch.int64)
        assert dist_util.all_reduce_(t, dist.ReduceOp.MAX) is t
        assert t.device.type == "cpu" and t.tolist() == [8, -2]
        f = torch.tensor([1.5], device="cuda")
        assert dist_util.all_reduce_(f) is f  # already on the GPU: reduced in place
        assert f.item() == 2.5
        assert [d.type for d in seen] == ["cuda", "cuda"]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--store", "--out-dir"):
        p.add_argument(a, required=True)
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    _run_rank(p.parse_args())
