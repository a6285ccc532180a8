"""Reallocation plans between layouts and their compiled execution.

For every pair among d1, d2, m2, p2, d2m2, p2m2 and m4: the source ranks' flat buffers are cut
from one random single-device model by the sharding rules; running the plan's copies must give
exactly the destination ranks' buffers cut the same way, with every destination element
written exactly once (counted).  The ranks' compiled plans (:class:`RankPlan`) must do the
same, with one-to-many messages as broadcasts and without, first in one process (messages
and broadcasts handed over by packing and unpacking), then over gloo."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks

from realhf.api.core.allocation import parse_parallelism
from realhf.base import shutdown
from realhf.impl.kernels import set_intervals, slice_intervals
from realhf.impl.model import ReaLModel
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.parallelism import ParallelGrid
from realhf.impl.model.parallelism.model import GridHooks
from realhf.impl.model.parallelism.realloc import plan_reallocation, rank_model, source_name
from realhf.impl.model.parallelism.realloc_exec import RankPlan, compile_plan, reallocate
from realhf.impl.model.parallelism.tensor_parallel import shard_tensor

LAYOUTS = ["d1p1m1", "d2p1m1", "d1p1m2", "d1p2m1", "d2p1m2", "d1p2m2", "d1p1m4"]

CONFIGS = {
    # tied embedding (a p2 last stage keeps a copy), attention biases, 4 q / 2 kv heads
    "tied": dict(use_attention_bias=True, tied_embedding=True),
    # untied head, per-head q/k norms, one kv head (copied on every tensor rank)
    "untied": dict(family="qwen3", qk_layernorm=True, n_kv_heads=1),
}


def _config(kind: str) -> ReaLModelConfig:
    base = dict(
        family="qwen2",
        n_layers=2,
        hidden_dim=32,
        n_q_heads=4,
        n_kv_heads=2,
        head_dim=8,
        intermediate_dim=64,
        vocab_size=64,
        n_positions=64,
    )
    base.update(CONFIGS[kind])
    return ReaLModelConfig(**base)


def _buffers(full: ReaLModel, layout) -> list:
    """Every grid rank's flat buffer in ``layout``, cut from the whole model ``full``."""
    src = dict(full.named_parameters())
    out = []
    for r in range(layout.world_size):
        model, t = rank_model(full.config, layout, r, device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                whole = src[source_name(model, name)].detach()
                p.copy_(shard_tensor(name, whole, full.config, layout.tensor, t))
        out.append(model.flat_params.detach().clone())
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def full(request):
    torch.manual_seed(0)
    return ReaLModel(_config(request.param))


@pytest.mark.parametrize("src, dst", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_plan_rebuilds_the_destination_layout_moving_each_element_once(full, src, dst):
    src_l, dst_l = parse_parallelism(src), parse_parallelism(dst)
    have = _buffers(full, src_l)
    want = _buffers(full, dst_l)
    got = [torch.full_like(w, float("nan")) for w in want]
    written = [torch.zeros(w.numel(), dtype=torch.int32) for w in want]
    plan = plan_reallocation(full.config, src_l, dst_l)
    for c in plan:
        got[c.dst][c.dst_offset : c.dst_offset + c.length] = have[c.src][
            c.src_offset : c.src_offset + c.length
        ]
        written[c.dst][c.dst_offset : c.dst_offset + c.length] += 1
    for d in range(dst_l.world_size):
        assert torch.equal(written[d], torch.ones_like(written[d])), (src, dst, d)
        assert torch.equal(got[d], want[d]), (src, dst, d)
    # Bytes moved = what the destinations hold, exactly.
    assert sum(c.length for c in plan) == sum(w.numel() for w in want)


def test_same_layout_is_local_copies_only(full):
    layout = parse_parallelism("d2p1m2")
    plan = plan_reallocation(full.config, layout, layout)
    assert all(c.src == c.dst for c in plan)
    # one merged copy per rank: the whole buffer
    assert len(plan) == layout.world_size


def test_senders_are_spread_over_replicas(full):
    # d2 -> d1p1m2 on other world ranks: both source replicas send.
    plan = plan_reallocation(
        full.config,
        parse_parallelism("d2p1m1"),
        parse_parallelism("d2p1m2"),
        src_ranks=[0, 1],
        dst_ranks=[2, 3, 4, 5],
    )
    assert {c.src for c in plan} == {0, 1}
    assert {c.dst for c in plan} == {2, 3, 4, 5}


def test_rank_counts_must_match_the_layouts(full):
    with pytest.raises(ValueError, match="needs 2 ranks"):
        plan_reallocation(
            full.config, parse_parallelism("d2p1m1"), parse_parallelism("d1p1m1"), src_ranks=[0]
        )


def _plan_counts(plan, rank, broadcasts=()) -> dict:
    """The elements world ``rank`` sends, receives and copies locally in ``plan``; a
    broadcast among ``broadcasts`` that ``rank`` roots is sent once, not once per receiver."""
    shared = sum((len(b.ranks) - 2) * b.side.length for b in broadcasts if b.root == rank)
    return {
        "sent": sum(c.length for c in plan if c.src == rank != c.dst) - shared,
        "received": sum(c.length for c in plan if c.dst == rank != c.src),
        "local": sum(c.length for c in plan if c.src == rank == c.dst),
    }


def _staging_ptrs(rp: RankPlan) -> list:
    """The addresses of a RankPlan's staging buffers (to see that runs reuse them)."""
    return [
        None if b is None else b.data_ptr()
        for bufs in rp._buffers.values()
        for b in [*bufs.send, *bufs.recv, *bufs.bcast, bufs.local]
    ]


def _run_in_process(plan, have: list, got: list, broadcast: bool = True) -> dict:
    """Every rank's compiled plan carried out in one process: the local copies by
    ``RankPlan.run`` of the rank's local-only part of the plan, each message and each
    broadcast by packing the sender's intervals and unpacking the packed elements at each
    receiver's (the pairing of the message orders that ``run`` relies on).  Checks that
    every rank of a broadcast knows it, and that any two ranks go through the broadcasts
    they share in the same order (what keeps ``run`` from deadlocking)."""
    ranks = sorted({c.src for c in plan} | {c.dst for c in plan})
    compiled = {r: compile_plan(plan, r, broadcast) for r in ranks}
    order = {r: [(b.root, b.ranks) for b in rp.broadcasts] for r, rp in compiled.items()}
    for a, b in itertools.combinations(ranks, 2):
        assert [k for k in order[a] if b in k[1]] == [k for k in order[b] if a in k[1]]
    for r, rp in compiled.items():
        local = compile_plan([c for c in plan if c.src == r == c.dst], r)
        assert not local.sends and not local.recvs and not local.broadcasts
        local.run(have[r] if r < len(have) else None, got[r] if r < len(got) else None)
        for m in rp.sends:
            (inbox,) = [x for x in compiled[m.peer].recvs if x.peer == r]
            packed = slice_intervals(have[r], m.side.intervals)
            set_intervals(packed, got[m.peer], inbox.side.intervals)
        for b in rp.broadcasts:
            assert r in b.ranks and len(b.ranks) >= 3  # a root and two receivers at least
            if b.root != r:
                continue
            packed = slice_intervals(have[r], b.side.intervals)
            for q in b.ranks:
                if q != r:
                    (inbox,) = [x for x in compiled[q].broadcasts if x.root == r]
                    assert inbox.ranks == b.ranks and inbox.side.length == b.side.length
                    set_intervals(packed, got[q], inbox.side.intervals)
    return compiled


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "p2p"])
@pytest.mark.parametrize("src, dst", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_compiled_plans_rebuild_the_destination_layout(full, src, dst, broadcast):
    src_l, dst_l = parse_parallelism(src), parse_parallelism(dst)
    have, want = _buffers(full, src_l), _buffers(full, dst_l)
    got = [torch.full_like(w, float("nan")) for w in want]  # an unwritten element stays NaN
    plan = plan_reallocation(full.config, src_l, dst_l)
    compiled = _run_in_process(plan, have, got, broadcast)
    for d in range(dst_l.world_size):
        assert torch.equal(got[d], want[d]), (src, dst, d)
    for r, rp in compiled.items():
        assert rp.counts == _plan_counts(plan, r, rp.broadcasts), (src, dst, r)
        assert broadcast or not rp.broadcasts


# One sender, several receivers of the same elements: d1 -> d2m2 sends tensor shard 1 to
# both replicas' tensor rank 1 and the rest of replica 1 (shard 0) to its rank 2 alone;
# p2m2 -> d2, each second-stage rank (2, 3) sends its shard of stage 2 to both replicas.
ONE_TO_MANY = {
    ("d1p1m1", "d2p1m2"): [(0, (0, 1, 3))],
    ("d1p2m2", "d2p1m1"): [(2, (0, 1, 2)), (3, (0, 1, 3))],
}


def test_one_to_many_messages_become_broadcasts(full):
    for (src, dst), expected in ONE_TO_MANY.items():
        plan = plan_reallocation(full.config, parse_parallelism(src), parse_parallelism(dst))
        for r in range(4):
            got = [(b.root, b.ranks) for b in compile_plan(plan, r).broadcasts]
            assert got == [k for k in expected if r in k[1]], (src, dst, r)
    # Messages that differ (each tensor rank its own shard) stay point-to-point.
    plan = plan_reallocation(full.config, parse_parallelism("d1p1m1"), parse_parallelism("d1p1m4"))
    assert not compile_plan(plan, 0).broadcasts and len(compile_plan(plan, 0).sends) == 3


def test_a_rank_plan_runs_again_in_the_same_buffers(full):
    # m4 -> p2m2, rank 1's local copies: neither side is one piece (through the scratch).
    src_l, dst_l = parse_parallelism("d1p1m4"), parse_parallelism("d1p2m2")
    have, want = _buffers(full, src_l)[1], _buffers(full, dst_l)[1]
    plan = [c for c in plan_reallocation(full.config, src_l, dst_l) if c.src == 1 == c.dst]
    rp = compile_plan(plan, 1)
    assert rp.local.src.whole is None and rp.local.dst.whole is None
    expected = torch.zeros_like(want)
    for c in plan:
        expected[c.dst_offset : c.dst_offset + c.length] = have[
            c.src_offset : c.src_offset + c.length
        ]
    first, second = torch.zeros_like(want), torch.zeros_like(want)
    assert rp.run(have, first) == _plan_counts(plan, 1)
    ptrs = _staging_ptrs(rp)
    assert rp.run(have, second) == _plan_counts(plan, 1)
    assert _staging_ptrs(rp) == ptrs and any(ptrs)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    # Another dtype gets its own staging buffers.
    assert rp.run(have.double(), torch.zeros_like(want, dtype=torch.float64))["local"] > 0
    assert len(rp._buffers) == 2


def test_a_rank_plan_names_the_missing_buffer(full):
    src_l, dst_l = parse_parallelism("d1p1m2"), parse_parallelism("d2p1m1")
    rp = compile_plan(plan_reallocation(full.config, src_l, dst_l), 0)
    have = _buffers(full, src_l)[0]
    with pytest.raises(ValueError, match="dst_flat is None"):
        rp.run(have, None)
    with pytest.raises(ValueError, match="at least"):
        rp.run(have[:-1], torch.empty(_buffers(full, dst_l)[0].numel()))
    with pytest.raises(ValueError, match="does not cast"):
        rp.run(have, torch.empty(_buffers(full, dst_l)[0].numel(), dtype=torch.float64))


# ---- over processes ---------------------------------------------------------------------

# Every ordered pair of distinct layouts among d1, d2, m2, p2, d2m2, p2m2, m4.
PAIRS = [(a, b) for a in LAYOUTS for b in LAYOUTS if a != b]


def _rank_main(args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    # nccl between GPU buffers where there is one CUDA device per rank (nccl ranks cannot
    # share a device), gloo between host buffers otherwise; the layouts' own collectives
    # (the logits check) run on host tensors over gloo groups.
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= args.world
    dev = torch.device("cuda", args.rank) if cuda else "cpu"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=60),
    )
    out = {}
    try:
        torch.manual_seed(0)
        full = ReaLModel(_config("tied"))  # the same weights in every process
        ids = torch.randint(
            0, full.config.vocab_size, (20,), generator=torch.Generator().manual_seed(1)
        )
        cu = torch.tensor([0, 7, 20], dtype=torch.int32)
        with torch.no_grad():
            reference = full(ids, cu)
        for src, dst in PAIRS:
            src_l, dst_l = parse_parallelism(src), parse_parallelism(dst)
            grid = ParallelGrid.create(dst_l, backend="gloo")  # every rank takes part
            r = args.rank
            have = _buffers(full, src_l)[r].to(dev) if r < src_l.world_size else None
            want = _buffers(full, dst_l)[r].to(dev) if r < dst_l.world_size else None
            got = None if want is None else torch.full_like(want, float("nan"))
            plan = plan_reallocation(full.config, src_l, dst_l)
            moved = reallocate(plan, r, have, got)
            # The compiled plan, run twice as a cached one is: same buffers, same result.
            rp = compile_plan(plan, r)
            again = [None if want is None else torch.full_like(want, float("nan")) for _ in "ab"]
            counts = [rp.run(have, again[0])]
            ptrs = _staging_ptrs(rp)
            counts.append(rp.run(have, again[1]))
            # Point-to-point only: the same buffers as with broadcasts.
            p2p = None if want is None else torch.full_like(want, float("nan"))
            moved_p2p = compile_plan(plan, r, broadcast=False).run(have, p2p)
            expected = _plan_counts(plan, r, rp.broadcasts)
            res = {
                "moved": moved,
                "moved_p2p": moved_p2p,
                "broadcasts": [[b.root, list(b.ranks)] for b in rp.broadcasts],
                "counts_match_plan": all(c == expected for c in counts)
                and moved_p2p == _plan_counts(plan, r),
                "buffers_reused": _staging_ptrs(rp) == ptrs,
            }
            if grid is not None:
                res["exact"] = bool(torch.equal(got, want))
                res["compiled_exact"] = all(bool(torch.equal(a, want)) for a in again)
                res["p2p_same"] = bool(torch.equal(p2p, got))
                # The reallocated buffer serves as the destination layout's model.
                hooks = GridHooks(grid)
                model, _ = rank_model(full.config, dst_l, r, device="cpu")
                model = ReaLModel(
                    full.config, init_weights=False, tp=hooks, layers=model.layer_range
                )
                model.load_flat(got.cpu())
                with torch.no_grad():
                    logits = hooks.gather_logits(hooks.run_stages(model, ids, cu))
                res["logits_err"] = float((logits - reference).abs().max())
            out[f"{src}->{dst}"] = res
    finally:
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
        shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)


@pytest.mark.slow
def test_reallocation_over_processes_gives_the_destination_layout(tmp_path, no_leftover_processes):
    """Four ranks carry out plans between every pair of layouts (over gloo here, nccl
    where there are four CUDA devices); the destination ranks end with exactly
    their shards, and the destination layout's logits equal the single-device model's.  A
    compiled plan run twice gives the same shards in the same staging buffers, and counts
    what the plan says; one-to-many pairs run broadcasts, and the point-to-point-only plan
    gives the same buffers."""
    world = 4
    results = run_ranks(
        __file__, world, lambda r: ["--store", str(tmp_path / "store")], str(tmp_path)
    )
    for src, dst in PAIRS:
        key = f"{src}->{dst}"
        n_dst = parse_parallelism(dst).world_size
        for r, res in enumerate(results):
            assert res[key]["counts_match_plan"] and res[key]["buffers_reused"], (key, r)
            if r < n_dst:
                assert res[key]["exact"] and res[key]["compiled_exact"], (key, r)
                assert res[key]["p2p_same"], (key, r)
                assert res[key]["logits_err"] <= 1e-6, (key, r, res[key])
        # Every element a destination holds came from a send or a local copy; a broadcast
        # is sent once for all its receivers.
        sent = sum(res[key]["moved_p2p"]["sent"] for res in results)
        received = sum(res[key]["moved_p2p"]["received"] for res in results)
        assert sent == received == sum(res[key]["moved"]["received"] for res in results)
        if (src, dst) in ONE_TO_MANY:
            for r, res in enumerate(results):
                want = [[s, list(ranks)] for s, ranks in ONE_TO_MANY[src, dst] if r in ranks]
                assert res[key]["broadcasts"] == want, (key, r)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    for a in ("--store", "--out-dir"):
        p.add_argument(a, required=True)
    _rank_main(p.parse_args())
