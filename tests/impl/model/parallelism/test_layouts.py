"""Every parallel layout of ReaLModel equals the single-device model.

The multi-rank tests run this file as a script once per rank (gloo, a FileStore); each rank
loads the same HuggingFace checkpoints into its layout (``load_model``), runs the whole model
(``run_stages``), log-probs and a critic through the inference engine (pipelined when p > 1),
greedy and seeded sampled generation and one optimizer step, and saves what it computed.
The test process computes the same on one device and compares: logits, log-probs and values
to 1e-5, generated tokens exactly, gradients and the stepped weights (shards put back
together) to 1e-5, and ``save_hf`` and the flat weight file of ``weight_sync=shm`` from the
layout to the single-device save. Layouts
marked ``z`` train with ZeRO-1 (each replica steps its shard of the optimizer state); their
``.grad`` is not averaged as a whole, so only their stepped weights are compared.

The optimizer is AdamW with ``eps=1``: on a first step its update is ``lr·g / (|g| + 1)``,
nearly linear in g, so the 1e-9 noise that sums over ranks leave in a (near-)zero gradient
stays 1e-9 (with a small eps it would become a full ``lr``-sized step of either sign).
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
from tiny_models import make_tiny_hf_model

from realhf.api.cli_args import LoraConfig, OptimizerConfig
from realhf.api.core.allocation import parse_parallelism
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.base import shutdown
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.conversion.flat_file import load_flat, write_model
from realhf.impl.model.interface.offline_generation import generate_offline
from realhf.impl.model.nn.lora import add_lora, load_peft
from realhf.impl.model.nn.model_config import ReaLModelConfig
from realhf.impl.model.parallelism import ParallelGrid, load_model
from realhf.impl.model.parallelism.tensor_parallel import unshard_tensor
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs

SEQLENS = [5, 9, 3, 12, 7, 4, 10, 6]
VOCAB = 128
TOL = 1e-5


def _batch() -> SequenceSample:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (sum(SEQLENS),), generator=g)
    return SequenceSample.from_default(
        ids=[f"s{i}" for i in range(len(SEQLENS))],
        seqlens=list(SEQLENS),
        data={"packed_input_ids": ids},
    )


def _prompts() -> SequenceSample:
    lens = [3, 6, 2, 5]
    g = torch.Generator().manual_seed(11)
    return SequenceSample.from_default(
        ids=[f"p{i}" for i in range(len(lens))],
        seqlens=lens,
        data={"packed_prompts": torch.randint(0, VOCAB, (sum(lens),), generator=g)},
    )


def _replica_items(dp_rank: int, dp_size: int) -> list:
    n = len(SEQLENS) // dp_size
    return list(range(dp_rank * n, (dp_rank + 1) * n))


def _optimizer(zero_stage: int = 0) -> OptimizerConfig:
    return OptimizerConfig(
        lr=1e-2, weight_decay=0.1, eps=1.0, gradient_clipping=0.0, zero_stage=zero_stage
    )


def _parse(layout_str: str):
    """``(layout, zero_stage)``: a trailing ``z`` (test-only) trains with ZeRO-1."""
    return parse_parallelism(layout_str.rstrip("z")), int(layout_str.endswith("z"))


MB_SPEC = MicroBatchSpec(max_tokens_per_mb=24)


def _lm_loss(tp):
    def loss(logits, mb):
        ids = mb.data["packed_input_ids"]
        logp = gather_packed_shifted_log_probs(
            logits, mb.cu_seqlens("packed_input_ids"), ids, tp=tp
        )
        return -logp.mean(), {"mean_logp": logp.mean().detach()}

    return loss


def _lm_weight(mb: SequenceSample) -> int:
    return sum(l - 1 for l in mb.flat_seqlens("packed_input_ids"))


def _compute(model: ReaLModel, critic: ReaLModel, grid, items, zero_stage: int = 0) -> dict:
    """What every layout is compared on (the whole batch for forward; ``items`` to train).
    Everything runs through what model workers use: the hooks and the engines."""
    tp = model.tp
    full = _batch()
    ids, cu = full.data["packed_input_ids"], full.cu_seqlens("packed_input_ids")
    lens = [[n - 1 for n in item] for item in full.seqlens["packed_input_ids"]]
    out = {}

    def logp_hook(logits, mb):
        mb_ids = mb.data["packed_input_ids"]
        return gather_packed_shifted_log_probs(
            logits, mb.cu_seqlens("packed_input_ids"), mb_ids, tp=tp
        )

    with torch.no_grad():
        out["logits"] = tp.gather_logits(tp.run_stages(model, ids, cu))
        out["logp"] = InferenceEngine(model, grid).forward(full, MB_SPEC, logp_hook, lens)
        out["values"] = InferenceEngine(critic, grid).forward(full, MB_SPEC)
        # Greedy answers and a sampled pair per prompt (seeds derive from the prompt ids).
        prompts = _prompts()
        for key, gconfig in (
            ("greedy", GenerationHyperparameters(n=1, max_new_tokens=6, greedy=True)),
            ("sampled", GenerationHyperparameters(n=2, max_new_tokens=6, temperature=1.0)),
        ):
            gen = generate_offline(model, prompts, gconfig, seed=5)
            out[key] = gen.data["packed_input_ids"]
    engine = TrainEngine(model, _optimizer(zero_stage), grid=grid)
    stats = engine.train_batch(full.select_items(items), MB_SPEC, _lm_loss(tp), _lm_weight)
    out["stats"] = {k: stats[k] for k in ("loss", "grad_norm", "n_tokens", "mean_logp")}
    trained = model.trained_parameters()  # (with LoRA: the adapters)
    if not zero_stage:  # ZeRO-1 averages each rank's shard only, not the whole .grad
        out["grads"] = {n: p.grad.detach().clone() for n, p in trained}
    out["weights"] = {n: p.detach().clone() for n, p in trained}
    return out


#: the adapters of the "-lora" models (every projection; dropout off: layouts compare exactly)
LORA = LoraConfig(rank=4, alpha=8.0)


def _whole_lora(path: str) -> ReaLModel:
    """The single-device "-lora" model: fresh adapters (seed 5), then B drawn non-zero."""
    m = ReaLModel.from_hf(path)
    add_lora(m, LORA, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for n, p in m.lora.params.items():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1, generator=g)
    return m


def _model(path: str, name: str, grid=None) -> ReaLModel:
    """Model ``name`` on ``grid``'s layout (None: one device); a "-lora" name adds the
    adapters of :func:`_whole_lora`, cut to this rank's part."""
    if not name.endswith("-lora"):
        return ReaLModel.from_hf(path) if grid is None else load_model(path, grid)
    whole = _whole_lora(path)
    if grid is None:
        return whole
    model = load_model(path, grid)
    add_lora(model, LORA, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for n, p in model.lora.params.items():
            part = model.tp.shard_param(n, whole.lora.params[n], model.config)
            if n.endswith("lora_A"):  # a layout draws what one device draws
                assert torch.equal(p, part), n
            p.copy_(part)
    return model


# ---- rank process ---------------------------------------------------------------------


def _rank_main(args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    results = {}
    try:
        for layout_str in args.layouts.split(","):
            layout, zero_stage = _parse(layout_str)
            grid = ParallelGrid.create(layout)
            for name, path in json.loads(args.models).items():
                model = _model(path, name, grid)
                critic = load_model(args.critic, grid, is_critic=True)
                items = _replica_items(grid.dp_rank, grid.dp_size)
                out = _compute(model, critic, grid, items, zero_stage)
                if grid.dp_rank == 0:  # replicas are identical; one writes
                    saved = os.path.join(args.out_dir, f"{layout_str}-{name}-saved")
                    if model.lora is not None:
                        model.save_trained(saved)  # the adapters, gathered
                    else:
                        model.save_hf(saved)
                        write_model(model, saved + ".flat", version=3)  # weight_sync=shm
                out["coord"] = tuple(grid.coord)
                results[f"{layout_str}/{name}"] = out
    finally:
        torch.save(results, os.path.join(args.out_dir, f"rank{args.rank}.pt"))
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(sorted(results), f)
        dist.destroy_process_group()
        shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)


# ---- tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_models")
    models = {
        # tied embedding, attention biases, GQA 4/2
        "qwen2": make_tiny_hf_model("qwen2", d / "qwen2"),
        # untied LM head, per-head q/k norms
        "qwen3": make_tiny_hf_model("qwen3", d / "qwen3", seed=1),
    }
    torch.manual_seed(3)
    critic = ReaLModel.from_hf(models["qwen2"], is_critic=True)
    with torch.no_grad():
        critic.head.weight.normal_(0, 0.5)
        critic.head.bias.fill_(0.25)
    critic.save_hf(d / "critic")
    return models, str(d / "critic")


def _reference(models, critic_path):
    # One device trains on the whole batch; a dp2 layout's replicas on halves of it, which
    # the engine's global token-mean scaling makes the same gradient.
    critic = ReaLModel.from_hf(critic_path, is_critic=True)
    everything = list(range(len(SEQLENS)))
    return {n: _compute(_model(p, n), critic, None, everything) for n, p in models.items()}


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3g} > {TOL}"


def _check_layout(
    layout_str, name, ranks, ref, cfg: ReaLModelConfig, saved_dir, base_path=None
) -> None:
    layout, zero_stage = _parse(layout_str)
    m = layout.tensor
    for r, res in enumerate(ranks):
        out = res[f"{layout_str}/{name}"]
        what = f"{layout_str} {name} rank {r}"
        _close(out["logits"], ref["logits"], f"{what} logits")
        _close(out["logp"], ref["logp"], f"{what} log-probs")
        _close(out["values"], ref["values"], f"{what} values")
        for key in ("greedy", "sampled"):
            assert torch.equal(out[key], ref[key]), (what, key, out[key], ref[key])
        for k, v in ref["stats"].items():
            assert abs(out["stats"][k] - v) <= TOL * max(1.0, abs(v)), (what, k, out["stats"], v)
    # Shards of every tensor rank of each stage of replica 0 put together equal the
    # reference; a last stage's copy of a tied embedding equals the embedding.
    outs = [res[f"{layout_str}/{name}"] for res in ranks]
    head_w = f"{cfg.head_layer_idx}.weight"
    seen = set()
    for stage in range(layout.pipe):
        shards = [next(o for o in outs if o["coord"] == (0, stage, t)) for t in range(m)]
        for key in ("weights",) if zero_stage else ("grads", "weights"):
            for pname in shards[0][key]:
                got = unshard_tensor(pname, [o[key][pname] for o in shards], cfg)
                ref_name = pname if pname in ref[key] else "0.wte.weight"
                assert pname in ref[key] or pname == head_w, pname
                _close(got, ref[key][ref_name], f"{layout_str} {name} {key[:-1]} {pname}")
                seen.add(ref_name)
    assert seen == set(ref["weights"]), sorted(set(ref["weights"]) - seen)
    if name.endswith("-lora"):  # the adapters a layout saves load on one device
        saved = ReaLModel.from_hf(base_path)
        add_lora(saved, LORA, init=False)
        load_peft(saved, saved_dir)
        for pname, p in saved.lora.params.items():
            _close(p.detach(), ref["weights"][pname], f"{layout_str} {name} saved {pname}")
        return
    saved = ReaLModel.from_hf(saved_dir)
    for pname, p in saved.named_parameters():
        _close(p.detach(), ref["weights"][pname], f"{layout_str} {name} save_hf {pname}")
    # What a generation server maps with weight_sync=shm: the same weights, bit for bit.
    assert load_flat(saved.flat_params.zero_(), saved.param_spec, saved_dir + ".flat", 3) == 3
    assert torch.equal(saved.flat_params, ReaLModel.from_hf(saved_dir).flat_params), layout_str


def _run_layouts(tmp_path, world: int, layouts: str, models: dict, critic: str) -> list:
    """Run this file's rank processes on ``layouts``; every rank's results, in rank order."""
    run_ranks(
        __file__,
        world,
        lambda r: [
            "--store",
            str(tmp_path / "store"),
            "--layouts",
            layouts,
            "--models",
            json.dumps(models),
            "--critic",
            critic,
        ],
        str(tmp_path),
        timeout=240,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, layouts",
    # "z": the same layout trained with ZeRO-1 (optimizer state sharded over the replicas)
    [(2, "d1p1m2,d2p1m1,d1p2m1,d2p1m1z"), (4, "d2p1m2,d1p2m2,d2p2m1,d1p1m4,d2p1m2z,d2p2m1z")],
)
def test_layouts_equal_the_single_device_model(
    tmp_path, checkpoints, world, layouts, no_leftover_processes
):
    models, critic = checkpoints
    ref = _reference(models, critic)
    ranks = _run_layouts(tmp_path, world, layouts, models, critic)
    for layout_str in layouts.split(","):
        for name in models:
            cfg = ReaLModel.from_hf(models[name]).config
            saved = str(tmp_path / f"{layout_str}-{name}-saved")
            _check_layout(layout_str, name, ranks, ref[name], cfg, saved, models[name])


@pytest.mark.slow
@pytest.mark.parametrize("world, layouts", [(2, "d1p1m2,d1p2m1,d2p1m1,d2p1m1z"), (4, "d1p2m2")])
def test_lora_layouts_equal_the_single_device_lora_model(
    tmp_path, checkpoints, world, layouts, no_leftover_processes
):
    """LoRA adapters on every kind of layout: the logits, log-probs, generations, the
    adapters' gradients and stepped values (shards put together) and the saved adapters
    equal one device's to 1e-5; the base never trains."""
    models, critic = checkpoints
    lora = {"qwen2-lora": models["qwen2"]}
    ref = _reference(lora, critic)
    assert all(n.endswith((".lora_A", ".lora_B")) for n in ref["qwen2-lora"]["weights"])
    ranks = _run_layouts(tmp_path, world, layouts, lora, critic)
    cfg = ReaLModel.from_hf(models["qwen2"]).config
    for layout_str in layouts.split(","):
        saved = str(tmp_path / f"{layout_str}-qwen2-lora-saved")
        _check_layout(
            layout_str, "qwen2-lora", ranks, ref["qwen2-lora"], cfg, saved, models["qwen2"]
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    for a in ("--store", "--layouts", "--models", "--critic", "--out-dir"):
        p.add_argument(a, required=True)
    _rank_main(p.parse_args())
