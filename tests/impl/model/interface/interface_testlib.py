"""Builders of PPO training batches for the interface tests."""

from __future__ import annotations

import os

import torch

import realhf
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample

MB = MicroBatchSpec(max_tokens_per_mb=64)
ASSETS = os.path.join(os.path.dirname(realhf.__file__), "assets", "tiny")


def prompt_answer_sample(
    tokenizer, pairs, *, group: int = 1, ids=None, solutions=None
) -> SequenceSample:
    """Items of ``group`` consecutive (prompt, answer) pairs each; answers end with EOS."""
    toks, pmask, lens = [], [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt).input_ids
        a = tokenizer(answer).input_ids + [tokenizer.eos_token_id]
        toks += p + a
        pmask += [True] * len(p) + [False] * len(a)
        lens.append(len(p) + len(a))
    n_items = len(pairs) // group
    per_item = [lens[i * group : (i + 1) * group] for i in range(n_items)]
    meta = {} if solutions is None else {"solutions": solutions}
    return SequenceSample.from_default(
        ids=ids or [f"q{i}" for i in range(n_items)],
        seqlens=per_item,
        data={
            "packed_input_ids": torch.tensor(toks, dtype=torch.long),
            "prompt_mask": torch.tensor(pmask, dtype=torch.bool),
        },
        metadata=meta,
    )


def with_keys(data: SequenceSample, **tensors) -> SequenceSample:
    """``data`` plus standard keys (default lengths from packed_input_ids)."""
    extra = SequenceSample.from_default(
        ids=data.ids, seqlens=data.seqlens["packed_input_ids"], data=tensors
    )
    out = data.select(data.keys)
    out.update_(extra)
    return out


def on_policy(actor, model, data: SequenceSample, rewards, no_eos=None) -> SequenceSample:
    """Behaviour log-probs recomputed by ``actor`` (so the PPO ratio starts at 1)."""
    lp = actor.inference(model, data, MB).data["logprobs"]
    n = len(data.flat_seqlens("packed_input_ids"))
    no_eos = torch.zeros(n, dtype=torch.bool) if no_eos is None else torch.tensor(no_eos)
    return with_keys(
        data,
        packed_logprobs=lp,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        seq_no_eos_mask=no_eos,
    )


def answer_logprob_sums(actor, model, data: SequenceSample) -> torch.Tensor:
    """Per sequence, the summed log-prob of its answer tokens under ``model``."""
    from realhf.impl.model.utils.functional import shift_one_indices

    lp = actor.inference(model, data, MB).data["logprobs"]
    cu = data.cu_seqlens("packed_input_ids")
    answer = ~data.data["prompt_mask"][shift_one_indices(cu) + 1]
    lens = [l - 1 for l in data.flat_seqlens("packed_input_ids")]
    return torch.stack([(x * m).sum() for x, m in zip(lp.split(lens), answer.split(lens))])


PAIRS_BY_RANK = [
    [
        ("Compute 2+3.", "\\boxed{5}"),
        ("Compute 2+3.", "\\boxed{7}"),
        ("Compute 9-1.", "\\boxed{8}"),
        ("Compute 9-1.", "\\boxed{80}"),
    ],
    [
        ("Compute 12*3.", "\\boxed{36}"),
        ("Compute 12*3.", "no"),
        ("Compute 1+1.", "\\boxed{2}"),
        ("Compute 1+1.", "\\boxed{11}"),
        ("Compute 40-4.", "\\boxed{36}"),
        ("Compute 40-4.", "\\boxed{4}"),
    ],
]


def dp_rank_main(rank: int, world: int, init_file: str, out_file: str, hf_dir: str, assets: str):
    """One data-parallel rank of the sync-PPO + SFT collective test: every collective
    inside the interfaces must line up, and the replicas must stay identical."""
    import datetime

    import torch.distributed as dist
    import transformers

    from realhf.api.cli_args import OptimizerConfig
    from realhf.api.core.model_api import FinetuneSpec, Model
    from realhf.impl.model import ReaLModel
    from realhf.impl.model.backend import InferenceEngine, TrainEngine
    from realhf.impl.model.interface import PPOActorInterface, PPOCriticInterface, SFTInterface

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        torch.set_num_threads(1)
        tok = transformers.AutoTokenizer.from_pretrained(assets)
        ft = FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4)

        def model(role, critic=False, train=True):
            torch.manual_seed(0)
            net = ReaLModel.from_hf(hf_dir, is_critic=critic)
            eng = TrainEngine(net, OptimizerConfig(lr=1e-3), ft) if train else InferenceEngine(net)
            return Model(role, eng, tok, "cpu")

        actor_m, ref_m, critic_m = (
            model("actor"),
            model("ref", train=False),
            model("critic", critic=True),
        )
        hp = dict(group_size=2, ppo_n_minibatches=2, kl_ctl=0.1)
        actor, critic = PPOActorInterface(**hp), PPOCriticInterface(**hp)
        data = prompt_answer_sample(
            tok,
            PAIRS_BY_RANK[rank],
            group=2,
            ids=[f"r{rank}q{i}" for i in range(len(PAIRS_BY_RANK[rank]) // 2)],
        )
        data = on_policy(
            actor, actor_m, data, rewards=[5.0, -5.0] * (len(PAIRS_BY_RANK[rank]) // 2)
        )
        ref = actor.inference(ref_m, data, MB)
        ref.remap_keys_({"logprobs": "packed_ref_logprobs"})
        data.update_(ref)
        data.update_(critic.inference(critic_m, data, MB))
        a_stats = actor.train_step(actor_m, data, MicroBatchSpec(max_tokens_per_mb=40))
        c_stats = critic.train_step(critic_m, data, MicroBatchSpec(max_tokens_per_mb=40))
        sft_m = model("sft")
        s_stats = SFTInterface().train_step(
            sft_m,
            data.select(["packed_input_ids", "prompt_mask"]),
            MicroBatchSpec(max_tokens_per_mb=60),
        )
        torch.save(
            {
                "actor": actor_m.module.model.flat_params.clone(),
                "critic": critic_m.module.model.flat_params.clone(),
                "sft": sft_m.module.model.flat_params.clone(),
                "stats": (a_stats, c_stats, s_stats),
            },
            out_file,
        )
    finally:
        dist.destroy_process_group()
    from realhf.base import shutdown

    shutdown.hard_exit(0)  # a plain return could abort in teardown (see base/shutdown.py)
