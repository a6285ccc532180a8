"""GRPO on the embedded arithmetic task with the light API (areal/), asynchronously.

    torchrun --nproc_per_node=1 examples/lite/grpo_tiny.py
    torchrun --nproc_per_node=2 examples/lite/grpo_tiny.py steps=20 max_turns=3
    torchrun --nproc_per_node=1 examples/lite/grpo_tiny.py max_turns=3 python_tool=true

Rank 0 starts a generation server (the built-in engine, its own process) and a background
rollout executor; every step it takes the next B trajectories (index order, each at most
η = rollout.max_head_offpolicyness versions old) and shares them out over the ranks; each
rank trains its part with realhf's ppo_actor (the quickstart's async GRPO settings); rank 0
saves the weights and the server loads them (``rollout.weight_sync=shm``: a flat file in
/dev/shm the server maps, removed at the end; ``broadcast``: the server pulls them from rank
0 over a process group). Metrics: {out_dir}/metrics.jsonl.
"""

import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from areal.api.cli_args import GRPOConfig, load_config
from areal.api.engine_api import TrainEngine
from areal.api.workflow_api import WorkflowExecutor
from areal.engine.local_server import LocalGenerationServer
from areal.engine.remote import RemoteInferenceEngine
from areal.workflow.agent import math_rows, multi_turn_workflow, rlvr_workflow, tool_workflow
from realhf.api.cli_parser import parse_config
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.experiments.async_ppo_math import AsyncPPOMathConfig
from realhf.experiments.building_blocks import TINY_EVAL, TINY_MODEL, TINY_TRAIN
from realhf.impl.model.interface import MathEvalInterface, PPOActorInterface


def evaluate(actor, rows, n):
    """Greedy accuracy on the first n held-out problems (rank 0; the others wait)."""
    acc = None
    if dist.get_rank() == 0:
        data = SequenceSample.gather(rows[:n])
        acc = MathEvalInterface(max_new_tokens=16).evaluate(actor.model, data, MicroBatchSpec())
    dist.barrier()
    return acc


def main():
    cfg = load_config(GRPOConfig, sys.argv[1:])
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * world)))
    path = cfg.actor.path or TINY_MODEL
    actor = TrainEngine(path, cfg.actor.optimizer, total_steps=cfg.steps, lora=cfg.actor.lora)
    # The quickstart's async GRPO settings (one place), with this run's group and sampling.
    hp = dataclasses.replace(
        parse_config(AsyncPPOMathConfig, []).ppo,
        group_size=cfg.group_size,
        gen=cfg.gen,
        seed=cfg.seed,
    )
    algo = PPOActorInterface(hp)
    B, eta = cfg.rollout.train_batch_size, cfg.rollout.max_head_offpolicyness
    if B % world:
        raise ValueError(f"rollout.train_batch_size={B} must divide over {world} ranks")
    eval_rows = math_rows(TINY_EVAL, actor.tokenizer) if cfg.eval_every else []
    os.makedirs(cfg.out_dir, exist_ok=True)
    log = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") if rank == 0 else None
    server = executor = engine = None
    # Where upload_weights saves: HF directories, or with weight_sync=shm flat files in memory
    shm = cfg.rollout.weight_sync == "shm"
    weights_root = os.path.join(cfg.out_dir, "weights")
    if shm:
        box = [tempfile.mkdtemp(prefix="realhf-lite-", dir="/dev/shm") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        weights_root = box[0]
    # The server starts from the model (with LoRA: the base and the fresh adapters).
    served = actor.serving_dir(os.path.join(cfg.out_dir, "adapters-v0"))
    if rank == 0:  # one generation server and one executor for the whole job
        server = LocalGenerationServer(
            served,
            num_threads=max(1, (os.cpu_count() or 2) // 2),
            weights_root=None if shm else weights_root,
            shm_root=weights_root if shm else None,
        )
        url = server.__enter__()
        engine = RemoteInferenceEngine.from_config([url], cfg.rollout, seed=cfg.seed)
        make = rlvr_workflow if cfg.max_turns == 1 else multi_turn_workflow
        make = tool_workflow if cfg.python_tool else make
        kw = {} if make is rlvr_workflow else {"max_turns": cfg.max_turns}
        workflow = make(actor.tokenizer, hp.gen, group_size=cfg.group_size, **kw)
        executor = WorkflowExecutor(engine, workflow, cfg.rollout)
        rows = math_rows(TINY_TRAIN, actor.tokenizer)
        random.Random(cfg.seed).shuffle(rows)
        executor.submit(rows)
    try:
        start = evaluate(actor, eval_rows, cfg.n_eval) if cfg.eval_every else None
        if log:
            log.write(json.dumps({"step": 0, **(start or {})}) + "\n")
            print(f"step 0: {start}", flush=True)
        t0 = time.monotonic()
        for step in range(cfg.steps):
            parts = [None] * world
            if rank == 0:
                batch = executor.wait()
                parts = [batch[r::world] for r in range(world)]
            dist.broadcast_object_list(parts, src=0)
            mine = SequenceSample.gather(parts[rank])
            # the bound, checked on every trajectory: trained at version `step`
            stale = max(step - int(v) for v in mine.data["version_start"].tolist())
            if stale > eta:
                raise RuntimeError(f"step {step}: a trajectory is {stale} versions old (eta={eta})")
            stats = algo.train_step(actor.model, mine, MicroBatchSpec())
            weights = os.path.join(weights_root, f"v{step + 1}" + (".flat" if shm else ""))
            if cfg.rollout.weight_sync != "broadcast":  # (pulled from rank 0: no files)
                os.makedirs(weights_root, exist_ok=True)
            if rank == 0:
                executor.pause()  # no new episode until the servers run version step + 1
            actor.upload_weights(engine, weights)  # rank 0 saves, the servers load
            if rank == 0:
                executor.set_version(step + 1)
                executor.resume()
            record = {
                "step": step + 1,
                "elapsed": time.monotonic() - t0,
                "staleness_max": stale,
                "reward": float(mine.data["rewards"].mean()),
                "solved": float((mine.data["rewards"] > 0).float().mean()),  # within max_turns
                "loss": stats.get("ppo_actor/loss"),
            }
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                record.update(evaluate(actor, eval_rows, cfg.n_eval) or {})
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(" ".join(f"{k}={v:.4g}" for k, v in record.items()), flush=True)
    finally:
        if executor is not None:
            executor.close()
        if engine is not None:
            engine.close()
        if server is not None:
            server.__exit__()
        actor.close()
        if shm and rank == 0:
            shutil.rmtree(weights_root, ignore_errors=True)
    # Together: a rank that tore its process group down while rank 0 was still stopping
    # the server and the executor aborted in gloo's teardown ("terminate called without an
    # active exception", SIGABRT; CI 2026-11-29).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
