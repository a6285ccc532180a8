"""openai-agent: an episode written against ``openai.AsyncOpenAI`` runs against a real
generation server; the recorded logprobs match the trainer's recomputation, and the
trajectory trains one PPO step."""

from __future__ import annotations

import asyncio
import os

import pytest
import requests
import torch
from tiny_models import make_tiny_hf_model

import realhf.impl.agent.openai_agent  # noqa: F401  (registers openai-agent)
import realhf.impl.model.interface  # noqa: F401  (registers the interfaces)
from realhf.api.cli_args import OptimizerConfig
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.gen_api import parse_sglang_output
from realhf.api.core.model_api import FinetuneSpec, Model
from realhf.api.core.registry import AgentAbstraction, make_agent
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration
from realhf.base.net.http_server import ServerThread
from realhf.impl.model import ReaLModel
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.conversion.hf import save_tokenizer
from realhf.impl.model.gen import EngineConfig
from realhf.impl.model.gen.http_app import create_app
from realhf.impl.model.gen.loading import load_engine
from realhf.impl.model.interface import PPOActorInterface

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "realhf", "assets", "tiny")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("openai") / "m")
    make_tiny_hf_model(
        "qwen2", path, seed=0, perturb=0.3, vocab_size=268, eos_token_id=0, pad_token_id=1
    )
    save_tokenizer(TINY, path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    engine = load_engine(model_dir, EngineConfig(context_length=256, num_threads=1)).start()
    srv = ServerThread(create_app(engine)).start()
    yield srv
    srv.stop()
    engine.close()


def _prompt(tokenizer):
    ids = tokenizer.encode("Compute 2+3.", add_special_tokens=False)
    return SequenceSample.from_default(
        ids=["add-2-3"],
        seqlens=[len(ids)],
        data={"packed_prompts": torch.tensor(ids, dtype=torch.long)},
        metadata={"query_id": ["add-2-3"], "prompt": ["Compute 2+3."], "solutions": [["5"]]},
    )


async def _serve(server, agent, prompt):
    """Play the rollout worker: generate every request on the real server."""
    obs_q, act_q = asyncio.Queue(), asyncio.Queue()
    task = asyncio.create_task(agent.collect_trajectory(prompt, None, obs_q, act_q))
    n = 0
    while True:
        get = asyncio.create_task(obs_q.get())
        await asyncio.wait({task, get}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            return task.result(), n
        req = get.result()
        assert isinstance(req, GenerateGroupRequest) and req.gconfig.n == 1
        params = {
            "max_new_tokens": req.gconfig.max_new_tokens,
            "temperature": req.gconfig.temperature,
        }
        r = await asyncio.to_thread(
            requests.post,
            f"{server.url}/generate",
            json={
                "input_ids": list(req.prompt_ids),
                "sampling_params": params,
                "return_logprob": True,
            },
            timeout=60,
        )
        r.raise_for_status()
        out = parse_sglang_output(r.json())
        no_eos = out.finish_reason.type.value == "length"
        await act_q.put(
            GroupGeneration(
                req.qid,
                req.prompt_ids,
                (out.output_ids,),
                (out.output_logprobs,),
                (no_eos,),
                (0,),
                (0,),
            )
        )
        n += 1


def test_an_openai_client_episode_trains_one_step(server, model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    agent = make_agent(
        AgentAbstraction("openai-agent", {"episode": "openai_episodes:ask_twice", "group_size": 2}),
        tokenizer=tok,
    )
    (traj,), n_requests = asyncio.run(_serve(server, agent, _prompt(tok)))
    assert n_requests == 4  # two episodes, two completions each
    assert traj.metadata["unmatched_completions"] == [[0, 0]]  # both turns found in place
    assert set(traj.data["rewards"].tolist()) <= {1.0, -1.0}
    # the second request's prompt is the whole first exchange (chat template) + the follow-up
    ids = traj.data["packed_input_ids"]
    gen = ~traj.data["prompt_mask"]
    lens = traj.seqlens["packed_input_ids"][0]
    for seq_gen in gen.split(lens):
        runs = torch.diff(seq_gen.int(), prepend=torch.zeros(1, dtype=torch.int)).eq(1).sum()
        assert int(runs) == 2  # two generated spans: the first and the second answer
    # the recorded logprobs are the trainer's: recompute them with the same weights
    inf = Model("actor", InferenceEngine(ReaLModel.from_hf(model_dir)), tok, device="cpu")
    actor = PPOActorInterface(
        group_size=2, disable_value=True, kl_ctl=0.0, adv_estimator="grpo", ppo_n_minibatches=1
    )
    again = actor.inference(inf, traj, MicroBatchSpec())
    # shifted: entry t of a sequence is token t+1's logprob
    shifted = torch.cat([g[1:] for g in gen.split(lens)])
    got, want = traj.data["packed_logprobs"][shifted], again.data["logprobs"][shifted]
    assert shifted.sum() > 4 and torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
    assert traj.data["packed_logprobs"][~shifted].abs().max() == 0.0
    # one PPO step on it
    net = ReaLModel.from_hf(model_dir)
    train = Model(
        "actor",
        TrainEngine(
            net,
            OptimizerConfig(lr=1e-3, weight_decay=0.0),
            FinetuneSpec(total_train_epochs=1, dataset_size=4, train_batch_size=1),
        ),
        tok,
        device="cpu",
    )
    before = net.flat_params.clone()
    stats = actor.train_step(train, traj, MicroBatchSpec())
    assert torch.isfinite(torch.tensor(stats["ppo_actor/loss"]))
    if traj.data["rewards"].unique().numel() > 1:  # a group that disagrees has a gradient
        assert not torch.equal(before, net.flat_params)
    assert ids.numel() == sum(lens)


def test_a_bad_episode_name_fails_with_the_fix():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    with pytest.raises(ValueError, match="cannot load episode 'nope:x'.*PYTHONPATH"):
        make_agent(AgentAbstraction("openai-agent", {"episode": "nope:x"}), tokenizer=tok)
    with pytest.raises(ValueError, match="must be an async function"):
        make_agent(
            AgentAbstraction("openai-agent", {"episode": "openai_episodes:not_async"}),
            tokenizer=tok,
        )
