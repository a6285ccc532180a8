"""Transfer plans, and plan execution over real gloo processes.

The multi-process tests run this file as a script (``python test_data_transfer.py
--scenario S --rank R ...``), one process per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import pytest
import torch
from rank_processes import run_ranks

from realhf.base import shutdown
from realhf.base.net import network
from realhf.system.dag.dp_split import partition_for_dp
from realhf.system.dag.local_store import LocalStore
from realhf.system.dag.transfer import (
    DataTransferError,
    TransferStep,
    build_transfer_plan,
    execute_plan,
)

# ---- build_transfer_plan -----------------------------------------------------------


def _plan(partitions, holders, keys=("k",), lens=None):
    lens = lens or {}
    return build_transfer_plan(
        partitions,
        list(keys),
        holders,
        seqlens=lambda i, k: [lens.get(i, 2)],
        dtypes={k: torch.long for k in keys},
        trailing_shapes={k: () for k in keys},
    )


def test_plan_skips_data_already_in_place_and_groups_by_src_dst():
    holders = {("a", "k"): [0], ("b", "k"): [1], ("c", "k"): [1], ("d", "k"): [0, 2]}
    plan = _plan([["a", "b", "c"], ["d"], ["d"]], holders, lens={"a": 3})
    # rank 0 needs b, c from 1; rank 1 needs d from min(holders) = 0; rank 2 holds d.
    assert [(s.src, s.dst, s.ids) for s in plan] == [(0, 1, ("d",)), (1, 0, ("b", "c"))]
    assert plan[1].n_rows == 4 and plan[1].seqlens == ((2,), (2,))


def test_plan_orders_by_key_then_ranks():
    holders = {(i, k): [r] for i, r in (("a", 1), ("b", 0)) for k in ("x", "y")}
    plan = _plan([["a"], ["b"]], holders, keys=("y", "x"))
    assert [(s.key, s.src, s.dst) for s in plan] == [
        ("y", 0, 1),
        ("y", 1, 0),
        ("x", 0, 1),
        ("x", 1, 0),
    ]


def test_plan_with_an_unheld_key_fails():
    with pytest.raises(ValueError, match="no rank holds key 'k' of item 'a'"):
        _plan([["a"]], {})


def test_transfer_step_validates():
    with pytest.raises(ValueError, match="src and dst are both rank 1"):
        TransferStep("k", 1, 1, ("a",), ((1,),), torch.long)
    with pytest.raises(ValueError, match="1 ids and 2 seqlens"):
        TransferStep("k", 0, 1, ("a",), ((1,), (2,)), torch.long)


def test_single_process_plan_moves_nothing():
    store = LocalStore()
    store.put("a", "k", torch.arange(3), [3])
    assert execute_plan([], 0, store).n_sent == 0


# ---- multi-process execution ---------------------------------------------------------

KEYS = {"ids": (torch.long, ()), "mask": (torch.bool, ()), "vec": (torch.float32, (3,))}
N_ITEMS = 9


def _item_data(i: int, key: str) -> torch.Tensor:
    """Deterministic data of item i, computable in every process."""
    g = torch.Generator().manual_seed(1000 + i)
    n = 1 + i % 4
    dtype, trailing = KEYS[key]
    if dtype == torch.bool:
        return torch.rand((n, *trailing), generator=g) > 0.5
    if dtype == torch.long:
        return torch.randint(0, 1000, (n, *trailing), generator=g)
    return torch.randn((n, *trailing), generator=g)


def _scenario_plan(world: int):
    """Items are loaded round-robin; each rank then needs a contiguous block of them."""
    ids = [f"item{i}" for i in range(N_ITEMS)]
    holders = {(f"item{i}", k): [i % world] for i in range(N_ITEMS) for k in KEYS}
    tokens = [1 + i % 4 for i in range(N_ITEMS)]
    parts = partition_for_dp(ids, tokens, world, by_count=False)
    plan = build_transfer_plan(
        parts,
        list(KEYS),
        holders,
        seqlens=lambda i, k: [1 + int(i[4:]) % 4],
        dtypes={k: v[0] for k, v in KEYS.items()},
        trailing_shapes={k: v[1] for k, v in KEYS.items()},
    )
    return parts, plan


def _run_rank(args) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    store = LocalStore(f"rank{args.rank}")
    out = {}
    try:
        if args.scenario == "exchange":
            for i in range(N_ITEMS):
                if i % args.world == args.rank:
                    for k in KEYS:
                        store.put(f"item{i}", k, _item_data(i, k), [1 + i % 4])
            parts, plan = _scenario_plan(args.world)
            stats = execute_plan(plan, args.rank, store)
            ok = all(
                torch.equal(store.get(i, k), _item_data(int(i[4:]), k))
                for i in parts[args.rank]
                for k in KEYS
            )
            out = {
                "ok": ok,
                "n_received": stats.n_received,
                "n_sent": stats.n_sent,
                "bytes": stats.bytes_received,
                "n_steps": len(plan),
            }
        elif args.scenario == "timeout":
            flag = os.path.join(args.out_dir, "done")
            if args.rank == 1:
                step = TransferStep("ids", 0, 1, ("item0",), ((4,),), torch.long)
                t0 = time.monotonic()
                try:
                    execute_plan([step], 1, store)
                    out = {"error": None}
                except DataTransferError as e:
                    out = {"error": str(e), "seconds": time.monotonic() - t0}
                open(flag, "w").close()
            else:  # never sends; stays alive until rank 1 gave up
                deadline = time.monotonic() + 60
                while not os.path.exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
    finally:
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(out, f)
        if args.scenario == "exchange":
            dist.destroy_process_group()
            shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)
        else:
            os._exit(0)  # gloo teardown would wait on the stuck pair


def _launch(tmp_path, scenario: str, world: int, timeout: float = 30.0):
    port = network.find_free_port(host="127.0.0.1")
    args = ["--scenario", scenario, "--port", str(port), "--timeout", str(timeout)]
    return run_ranks(__file__, world, lambda r: args, str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_execute_plan_moves_every_key_to_its_rank(tmp_path, world):
    results = _launch(tmp_path, "exchange", world)
    parts, plan = _scenario_plan(world)
    assert all(r["ok"] for r in results), results
    assert sum(r["n_received"] for r in results) == len(plan) == sum(r["n_sent"] for r in results)
    assert len(plan) > 0
    moved = sum(
        _item_data(int(i[4:]), k).numel()
        * (1 if KEYS[k][0] == torch.bool else _item_data(0, k).element_size())
        for s in plan
        for i in s.ids
        for k in [s.key]
    )
    assert sum(r["bytes"] for r in results) == moved


@pytest.mark.slow
def test_a_missing_sender_times_out_naming_the_step(tmp_path):
    results = _launch(tmp_path, "timeout", 2, timeout=3.0)
    err = results[1]["error"]
    assert err is not None
    assert (
        "data transfer step 1/1 (key 'ids': rank 0 -> 1, 1 items, 4 rows) failed on rank 1" in err
    )
    assert results[1]["seconds"] < 30


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--scenario", "--out-dir"):
        p.add_argument(a, required=True)
    for a in ("--rank", "--world", "--port"):
        p.add_argument(a, type=int, required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    _run_rank(p.parse_args())
