"""A vision-language ReaLModel on tensor- and pipeline-parallel layouts equals one device.

The vision tower is replicated under tensor parallelism and lives on the first pipeline
stage; the multimodal positions are computed on every stage.  Each rank (this file run as a
script, gloo) computes the logits of a packed batch with images, greedy answers to prompts
with images, and one optimizer step's gradients; the test process compares them with one
device's: logits and gradients (shards put back together) to 1e-5, answers exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks
from tiny_models import VL_TOKENS, make_tiny_vl_model

from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.allocation import parse_parallelism
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, image_sample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base import shutdown
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.interface.offline_generation import generate_offline
from realhf.impl.model.parallelism import ParallelGrid, load_model
from realhf.impl.model.parallelism.tensor_parallel import unshard_tensor
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

TOL = 1e-5
IMG, VS, VE = (VL_TOKENS[k] for k in ("image_token_id", "vision_start_token_id",
                                      "vision_end_token_id"))  # fmt: skip
# per item: image grids, text lengths around them
ITEMS = [([[1, 4, 6], [1, 2, 2]], [3, 2, 4]), ([], [6]), ([[1, 6, 4]], [2, 3])]


def _item(i, grids, lens, g, n_answers):
    ids = []
    for grid, n in zip(grids + [None], lens):
        ids += torch.randint(2, 100, (n,), generator=g).tolist()
        if grid is not None:
            ids += [VS] + [IMG] * (grid[0] * grid[1] * grid[2] // 4) + [VE]
    pix = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14, generator=g)
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    return ids, pix, grid


def _samples():
    """(a training batch: each item twice as long sequences, its prompts)"""
    g = torch.Generator().manual_seed(0)
    train, prompts = [], []
    for i, (grids, lens) in enumerate(ITEMS):
        ids, pix, grid = _item(i, grids, lens, g, 2)
        answers = [torch.randint(2, 100, (3,), generator=g).tolist() for _ in range(2)]
        seqs = [ids + a for a in answers]
        it = SequenceSample.from_default(
            ids=[f"q{i}"], seqlens=[[len(s) for s in seqs]],
            data={"packed_input_ids": torch.tensor([t for s in seqs for t in s])},
        )  # fmt: skip
        images = image_sample([f"q{i}"], pix, grid, [pix.shape[0]], [grid.shape[0]])
        it.update_(images)
        train.append(it)
        p = SequenceSample.from_default(
            ids=[f"q{i}"], seqlens=[[len(ids)]], data={"packed_prompts": torch.tensor(ids)}
        )
        p.update_(images)
        prompts.append(p)
    return SequenceSample.gather(train), SequenceSample.gather(prompts)


def _compute(model: ReaLModel, grid) -> dict:
    tp = model.tp
    batch, prompts = _samples()
    from realhf.api.core.data_api import vision_inputs_of

    ids, cu = batch.data["packed_input_ids"], batch.cu_seqlens("packed_input_ids")
    out = {}
    with torch.no_grad():
        logits = tp.run_stages(model, ids, cu, images=vision_inputs_of(batch))
        out["logits"] = tp.gather_logits(logits)
        gen = generate_offline(
            model, prompts, GenerationHyperparameters(n=1, max_new_tokens=5, greedy=True)
        )
        out["greedy"] = gen.data["packed_input_ids"]

    def loss_fn(logits, mb):
        lp = gather_packed_shifted_log_probs(
            logits, mb.cu_seqlens("packed_input_ids"), mb.data["packed_input_ids"], tp=tp
        )
        return -lp.float().sum() / lp.numel(), {}

    engine = TrainEngine(
        model, OptimizerConfig(lr=1e-3, weight_decay=0.0, eps=1.0, gradient_clipping=0.0),
        grid=grid,
    )  # fmt: skip
    stats = engine.train_batch(batch, MicroBatchSpec(n_mbs=2), loss_fn, lambda mb: 1.0)
    out["loss"] = stats["loss"]
    out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out


def _rank_main(args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    results, code = {}, 0
    try:
        for layout_str in args.layouts.split(","):
            grid = ParallelGrid.create(parse_parallelism(layout_str))
            out = _compute(load_model(args.model, grid), grid)
            out["coord"] = tuple(grid.coord)
            results[layout_str] = out
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        torch.save(results, os.path.join(args.out_dir, f"rank{args.rank}.pt"))
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(sorted(results), f)
        dist.destroy_process_group()
        shutdown.hard_exit(code)


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


@pytest.mark.slow
def test_vision_layouts_equal_the_single_device_model(tmp_path, no_leftover_processes):
    path = make_tiny_vl_model(tmp_path / "vl", perturb=0.1)
    ref = _compute(ReaLModel.from_hf(path), None)
    layouts = "d1p1m2,d1p2m1"
    run_ranks(
        __file__, 2,
        lambda r: ["--store", str(tmp_path / "store"), "--layouts", layouts, "--model", path],
        str(tmp_path), timeout=240,
    )  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    cfg = ReaLModel.from_hf(path).config
    for layout_str in layouts.split(","):
        layout = parse_parallelism(layout_str)
        outs = [r[layout_str] for r in ranks]
        for r, out in enumerate(outs):
            _close(out["logits"], ref["logits"], f"{layout_str} rank {r} logits")
            assert torch.equal(out["greedy"], ref["greedy"]), (layout_str, r)
            assert abs(out["loss"] - ref["loss"]) <= TOL
        seen = set()
        for stage in range(layout.pipe):
            shards = [next(o for o in outs if o["coord"] == (0, stage, t))
                      for t in range(layout.tensor)]  # fmt: skip
            for name in shards[0]["grads"]:
                got = unshard_tensor(name, [s["grads"][name] for s in shards], cfg)
                _close(got, ref["grads"][name], f"{layout_str} grad {name}")
                seen.add(name)
        vision = {n for n in ref["grads"] if ".visual." in n}
        assert vision and vision <= seen, layout_str
        assert ref["grads"]["0.visual.patch_embed.weight"].abs().sum() > 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    for a in ("--store", "--layouts", "--model", "--out-dir"):
        p.add_argument(a, required=True)
    _rank_main(p.parse_args())
