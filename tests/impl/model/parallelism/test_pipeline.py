"""realhf.impl.model.parallelism.pipeline: pipelined inference and 1F1B training.

A toy chain of ``Linear(8, 8) + tanh`` layers (float64, fixed seed) is split into pipeline
stages and fed micro-batches of different row counts; outputs, losses and every parameter's
gradient must equal those of a one-process loop over the same chain.  Multi-rank tests run
this file as a script (``python test_pipeline.py --rank R ...``), one process per rank,
meeting in a FileStore; each launch runs several grids and cases.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks
from torch import nn

from realhf.api.core.allocation import ParallelismConfig
from realhf.base import shutdown
from realhf.impl.model.parallelism.grid import ParallelGrid
from realhf.impl.model.parallelism.pipeline import forward_only, train_1f1b

H = 8
N_LAYERS = 6
ROWS = (3, 5, 2, 4, 1)
DTYPE = torch.float64
CPU = torch.device("cpu")
TOL = 1e-6


# ---- the toy model and its one-process reference ----------------------------------------


def make_layers() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(H, H, dtype=DTYPE) for _ in range(N_LAYERS))


def stage_bounds(pp_size: int, pp_rank: int):
    """Layers ``[lo, hi)`` of stage ``pp_rank``: an even split, earlier stages get the rest."""
    q, r = divmod(N_LAYERS, pp_size)
    lo = pp_rank * q + min(pp_rank, r)
    return lo, lo + q + (pp_rank < r)


def act_shape(i: int):
    return (ROWS[i % len(ROWS)], H)


def make_data(n: int, replica: int):
    """Inputs and targets of ``n`` micro-batches; each data-parallel replica gets its own."""
    g = torch.Generator().manual_seed(100 + replica)
    xs = [torch.randn(act_shape(i), generator=g, dtype=DTYPE) for i in range(n)]
    ts = [torch.randn(act_shape(i), generator=g, dtype=DTYPE) for i in range(n)]
    return xs, ts


def run_layers(layers, x):
    for layer in layers:
        x = torch.tanh(layer(x))
    return x


def make_loss_fn(targets):
    def loss_fn(out, i):
        # Pre-scaled by the caller's rule (here an arbitrary per-micro-batch weight).
        return ((out - targets[i]) ** 2).mean() * (0.5 + 0.25 * i)

    return loss_fn


def reference(n: int, replica: int):
    """One process, whole chain: outputs, losses, per-layer (weight grad, bias grad)."""
    layers = make_layers()
    xs, ts = make_data(n, replica)
    loss_fn = make_loss_fn(ts)
    with torch.no_grad():
        outs = [run_layers(layers, x) for x in xs]
    losses = []
    for i, x in enumerate(xs):
        loss = loss_fn(run_layers(layers, x), i)
        loss.backward()
        losses.append(loss.detach())
    grads = [(layer.weight.grad, layer.bias.grad) for layer in layers]
    return outs, losses, grads


def expected_1f1b(pp_size: int, pp_rank: int, n: int) -> List[str]:
    warmup = min(pp_size - pp_rank - 1, n)
    order = [f"F{i}" for i in range(warmup)]
    for k in range(n - warmup):
        order += [f"F{warmup + k}", f"B{k}"]
    return order + [f"B{i}" for i in range(n - warmup, n)]


def max_diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def run_case(grid: ParallelGrid, mode: str, n: int) -> dict:
    """Run one pipelined case on this rank; report errors against the reference."""
    lo, hi = stage_bounds(grid.pp_size, grid.pp_rank)
    layers = make_layers()
    mine = layers[lo:hi]
    xs, ts = make_data(n, grid.dp_rank)
    order: List[str] = []

    def stage_fn(x, i):
        order.append(f"F{i}")
        if x is None:
            x = xs[i]
        out = run_layers(mine, x)
        if out.requires_grad:
            out.register_hook(lambda g, i=i: order.append(f"B{i}"))
        return out

    ref_outs, ref_losses, ref_grads = reference(n, grid.dp_rank)
    res: Dict[str, object] = {}
    if mode == "forward":
        outs = forward_only(stage_fn, n, grid, act_shape, DTYPE, CPU)
        res["returned"] = outs is not None
        if outs is not None:
            res["err"] = max_diff(outs, ref_outs)
            res["requires_grad"] = any(o.requires_grad for o in outs)
    else:
        losses = train_1f1b(stage_fn, n, grid, act_shape, DTYPE, CPU, make_loss_fn(ts))
        res["returned"] = losses is not None
        if losses is not None:
            res["err"] = max_diff(losses, ref_losses)
            res["losses"] = [x.item() for x in losses]
        got = [g for layer in mine for g in (layer.weight.grad, layer.bias.grad)]
        want = [g for pair in ref_grads[lo:hi] for g in pair]
        res["grad_err"] = max_diff(got, want)
        res["grads_missing"] = sum(g is None for g in got)
        # Layers of other stages must stay untouched.
        res["foreign_grads"] = sum(
            p.grad is not None
            for j, layer in enumerate(layers)
            if not lo <= j < hi
            for p in layer.parameters()
        )
    res["order"] = order
    res["pp"] = [grid.pp_rank, grid.pp_size, grid.dp_rank]
    return res


def check_case(results: List[dict], key: str, mode: str, n: int, layout: ParallelismConfig):
    """Every grid rank of ``layout`` reported ``key``; all match the reference."""
    seen = [r[key] for r in results if key in r]
    assert len(seen) == layout.world_size, (key, results)
    for res in seen:
        pp_rank, pp_size, _ = res["pp"]
        last = pp_rank == pp_size - 1
        assert res["returned"] == last, (key, res)
        if last:
            assert res["err"] <= TOL, (key, res)
        if mode == "forward":
            assert res["order"] == [f"F{i}" for i in range(n)], (key, res)
            if last:
                assert not res["requires_grad"], (key, res)
        else:
            assert res["grad_err"] <= TOL and res["grads_missing"] == 0, (key, res)
            assert res["foreign_grads"] == 0, (key, res)
            assert res["order"] == expected_1f1b(pp_size, pp_rank, n), (key, res)
            # At most pp_size - pp_rank micro-batches in flight.
            inflight = peak = 0
            for ev in res["order"]:
                inflight += 1 if ev[0] == "F" else -1
                peak = max(peak, inflight)
            assert peak <= pp_size - pp_rank, (key, res)


# ---- in-process: one stage ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5])
def test_single_stage_forward_and_train(n):
    grid = ParallelGrid.single()
    for mode in ("forward", "train"):
        res = run_case(grid, mode, n)
        assert res["returned"] and res["err"] <= TOL, res
        if mode == "train":
            assert res["grad_err"] <= TOL and res["grads_missing"] == 0, res
            assert res["order"] == expected_1f1b(1, 0, n), res
        else:
            assert not res["requires_grad"]


@pytest.mark.parametrize("n", [0, -1, 1.5, True, None])
def test_bad_n_micro(n):
    grid = ParallelGrid.single()
    with pytest.raises(ValueError, match="n_micro"):
        forward_only(lambda x, i: torch.zeros(1), n, grid, act_shape, DTYPE, CPU)
    with pytest.raises(ValueError, match="n_micro"):
        train_1f1b(
            lambda x, i: torch.zeros(1), n, grid, act_shape, DTYPE, CPU, lambda o, i: o.sum()
        )


def test_loss_must_be_a_scalar():
    grid = ParallelGrid.single()
    w = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="scalar"):
        train_1f1b(lambda x, i: w * 2, 2, grid, act_shape, DTYPE, CPU, lambda o, i: o)


def test_losses_are_backwarded_as_is():
    """No 1/n_micro scaling inside: the grad is the plain sum of the micro-batch grads."""
    w = torch.tensor(1.0, requires_grad=True)
    losses = train_1f1b(
        lambda x, i: w * (i + 1), 3, ParallelGrid.single(), act_shape, DTYPE, CPU, lambda o, i: o
    )
    assert [x.item() for x in losses] == [1.0, 2.0, 3.0]
    assert not any(x.requires_grad for x in losses)
    assert w.grad.item() == 6.0


# ---- multi-process: pipelines over gloo ---------------------------------------------------

# One launch per world size; every grid is built by every rank (ParallelGrid.create).
# (name, layout, ranks) per world size, and the cases each grid runs.
GRIDS = {
    2: [("p2", ParallelismConfig(pipe=2), None)],
    4: [
        ("p4", ParallelismConfig(pipe=4), None),
        ("d2p2", ParallelismConfig(data=2, pipe=2), None),
        # A two-stage pipeline on a subset of the world: peers are world ranks 1 and 3,
        # which are ranks 0 and 1 of the pipe group.
        ("p2sub", ParallelismConfig(pipe=2), (1, 3)),
    ],
}
CASES = [(mode, n) for mode in ("forward", "train") for n in (1, 2, 5)]


def _bad_output_cases(grid: ParallelGrid, out: dict) -> None:
    """The first stage returns an activation of the wrong shape or dtype: a ValueError on
    that rank, raised before anything is sent (so its peer takes no part)."""
    if not grid.is_first_stage:
        return
    bad_outputs = {
        "shape": torch.zeros(act_shape(0)[0] + 1, H, dtype=DTYPE),
        "dtype": torch.zeros(act_shape(0), dtype=torch.float32),
    }
    for what, bad in bad_outputs.items():
        w = torch.ones((), dtype=bad.dtype, requires_grad=True)

        def stage_fn(x, i, bad=bad, w=w):
            return bad * w

        for mode in ("forward", "train"):
            try:
                if mode == "forward":
                    forward_only(stage_fn, 3, grid, act_shape, DTYPE, CPU)
                else:
                    train_1f1b(stage_fn, 3, grid, act_shape, DTYPE, CPU, lambda o, i: o.sum())
                out[f"bad_{what}_{mode}"] = "no error"
            except ValueError as e:
                out[f"bad_{what}_{mode}"] = str(e)


def _run_rank(args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=30)
    )
    out: Dict[str, object] = {}
    try:
        for name, layout, ranks in GRIDS[args.world]:
            grid = ParallelGrid.create(layout, ranks)
            if grid is None:
                continue
            if name == "p2":
                _bad_output_cases(grid, out)
            for rep in range(args.repeat):  # --repeat: a stress run by hand
                for mode, n in CASES:
                    key = f"{name}/{mode}/{n}" + (f"#{rep}" if rep else "")
                    out[key] = run_case(grid, mode, n)
    finally:
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
        shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)


def _launch(tmp_path, world: int, repeat: int = 1) -> List[dict]:
    return run_ranks(
        __file__,
        world,
        lambda r: ["--store", str(tmp_path / "store"), "--repeat", str(repeat)],
        str(tmp_path),
        timeout=90,
    )


def _check_world(results: List[dict], world: int) -> None:
    for name, layout, _ in GRIDS[world]:
        for mode, n in CASES:
            check_case(results, f"{name}/{mode}/{n}", mode, n, layout)


@pytest.mark.slow
def test_two_stages(tmp_path, no_leftover_processes):
    """pp=2: outputs, losses, grads and the 1F1B order match; n_micro < pp_size included;
    a stage output of the wrong shape or dtype is reported by the sending stage."""
    results = _launch(tmp_path, 2)
    _check_world(results, 2)
    first = results[0]
    for what in ("shape", "dtype"):
        for mode in ("forward", "train"):
            msg = first[f"bad_{what}_{mode}"]
            assert "pipeline stage 0" in msg and "act_shape(0) = (3, 8)" in msg, msg
    assert "(4, 8)" in first["bad_shape_forward"]
    assert "torch.float32" in first["bad_dtype_train"]


@pytest.mark.slow
def test_four_ranks(tmp_path, no_leftover_processes):
    """pp=4, d2p2 (each data replica its own pipeline on
    its own inputs) and a pp=2 grid on two of the four ranks."""
    results = _launch(tmp_path, 4)
    _check_world(results, 4)
    # d2p2: world ranks 0-1 are replica 0, 2-3 replica 1; the replicas saw different data.
    d2p2 = [r["d2p2/train/5"] for r in results]
    assert [tuple(r["pp"]) for r in d2p2] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert d2p2[1]["losses"] != d2p2[3]["losses"]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--store", "--out-dir"):
        p.add_argument(a, required=True)
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    p.add_argument("--repeat", type=int, default=1)
    _run_rank(p.parse_args())
