"""math-single-step agent against the real math-code environment, with a scripted generator."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import transformers

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import AgentAbstraction, make_agent
from realhf.api.core.rollout_api import (
    TRAJECTORY_KEYS,
    GenerateGroupRequest,
    GroupGeneration,
    Trajectory,
)
from realhf.impl.agent.math_single_step import MathSingleStepAgent
from realhf.impl.environment.math_code_single_step import MathCodeSingleStepEnv

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "realhf", "assets", "tiny")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def _prompt(tokenizer, qid="add-66-26", text="Compute 66+26.", solutions=("\\boxed{92}",)):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return SequenceSample.from_default(
        ids=[qid],
        seqlens=[len(ids)],
        data={"packed_prompts": torch.tensor(ids, dtype=torch.long)},
        metadata={
            "query_id": [qid],
            "task": ["math"],
            "solutions": [list(solutions)],
            "input_output": [None],
        },
    )


async def _run(agent, prompt, answers, tokenizer, versions=((0, 1),)):
    """Serve the agent's single generation request with ``answers`` (texts)."""
    obs_q, act_q = asyncio.Queue(), asyncio.Queue()
    task = asyncio.create_task(
        agent.collect_trajectory(prompt, MathCodeSingleStepEnv(), obs_q, act_q)
    )
    req = await asyncio.wait_for(obs_q.get(), 10)
    assert isinstance(req, GenerateGroupRequest) and req.gconfig.n == len(answers)
    outs = [
        tuple(tokenizer.encode(a, add_special_tokens=False)) + (tokenizer.eos_token_id,)
        for a in answers
    ]
    outs[-1] = outs[-1][:-1]  # the last answer ran out of budget: no EOS
    vs = [versions[j % len(versions)] for j in range(len(answers))]
    await act_q.put(
        GroupGeneration(
            qid=req.qid,
            prompt_ids=req.prompt_ids,
            output_ids=tuple(outs),
            output_logprobs=tuple(tuple(-0.5 - 0.01 * i for i in range(len(o))) for o in outs),
            no_eos=tuple(j == len(answers) - 1 for j in range(len(answers))),
            version_start=tuple(v[0] for v in vs),
            version_end=tuple(v[1] for v in vs),
        )
    )
    return await asyncio.wait_for(task, 60), req, outs


def test_trajectory_keys_shapes_and_rewards(tokenizer):
    agent = make_agent(
        AgentAbstraction("math-single-step", {"gconfig": {"max_new_tokens": 16}, "group_size": 3}),
        tokenizer=tokenizer,
    )
    prompt = _prompt(tokenizer)
    answers = ["66+26 = \\boxed{92}", "\\boxed{91}", "so \\boxed{92}"]
    (traj,), req, outs = asyncio.run(
        _run(agent, prompt, answers, tokenizer, versions=((2, 3), (1, 1)))
    )
    assert traj.keys == set(TRAJECTORY_KEYS) and traj.ids == ["add-66-26"]
    plen = len(req.prompt_ids)
    lens = [plen + len(o) for o in outs]
    assert traj.seqlens["packed_input_ids"] == [lens] and traj.seqlens["prompt_mask"] == [lens]
    assert traj.seqlens["packed_logprobs"] == [[L - 1 for L in lens]]
    assert traj.seqlens["packed_prompts"] == [[plen]] and traj.data[
        "packed_prompts"
    ].tolist() == list(req.prompt_ids)
    for key in ("rewards", "seq_no_eos_mask", "version_start", "version_end"):
        assert traj.seqlens[key] == [[1, 1, 1]]
    assert traj.data["rewards"].tolist() == [5.0, -5.0, 5.0]
    assert traj.data["seq_no_eos_mask"].tolist() == [False, False, True]
    assert traj.data["version_start"].tolist() == [2, 1, 2] and traj.data[
        "version_end"
    ].tolist() == [3, 1, 3]
    # per sequence: prompt then answer; logprobs zero over the prompt, then the server's
    ids, mask, lps = (
        traj.data["packed_input_ids"],
        traj.data["prompt_mask"],
        traj.data["packed_logprobs"],
    )
    o_ids = o_lp = 0
    for o in outs:
        L = plen + len(o)
        assert ids[o_ids : o_ids + L].tolist() == list(req.prompt_ids) + list(o)
        assert mask[o_ids : o_ids + L].tolist() == [True] * plen + [False] * len(o)
        seq_lp = lps[o_lp : o_lp + L - 1]
        assert (seq_lp[: plen - 1] == 0).all()
        assert torch.allclose(
            seq_lp[plen - 1 :], torch.tensor([-0.5 - 0.01 * i for i in range(len(o))])
        )
        o_ids, o_lp = o_ids + L, o_lp + L - 1
    assert traj.metadata["solutions"] == [["\\boxed{92}"]]
    t = Trajectory(index=7, sample=traj, rollout_id="r", worker="rollout_worker/0")
    assert t.version_start == 1 and t.version_end == 3
    assert t.to_sequence_sample().metadata["index"] == [7]


def test_reward_bias_and_scaling(tokenizer):
    agent = MathSingleStepAgent(
        tokenizer, {"n": 2, "max_new_tokens": 8}, reward_scaling=2.0, reward_bias=0.5
    )
    (traj,), _, _ = asyncio.run(
        _run(agent, _prompt(tokenizer), ["\\boxed{92}", "\\boxed{7}"], tokenizer)
    )
    assert traj.data["rewards"].tolist() == [1.0, -3.0]


@pytest.mark.parametrize(
    "answers, lb, ub, kept",
    [
        (["\\boxed{92}"] * 2, 0.0, 1.0, True),
        (["\\boxed{92}"] * 2, 0.0, 0.99, False),  # solved by all: no signal
        (["\\boxed{1}"] * 2, 0.01, 1.0, False),  # solved by none
        (["\\boxed{92}", "\\boxed{1}"], 0.01, 0.99, True),
    ],
)
def test_success_rate_filtering(tokenizer, answers, lb, ub, kept):
    agent = MathSingleStepAgent(
        tokenizer, {"max_new_tokens": 8}, group_size=2, success_rate_lb=lb, success_rate_ub=ub
    )
    out, _, _ = asyncio.run(_run(agent, _prompt(tokenizer), answers, tokenizer))
    assert (len(out) == 1) == kept


def test_bad_configuration_is_named(tokenizer):
    with pytest.raises(ValueError, match="group_size=4 contradicts gconfig.n=2"):
        MathSingleStepAgent(tokenizer, {"n": 2}, group_size=4)
    with pytest.raises(ValueError, match="success_rate_lb"):
        MathSingleStepAgent(tokenizer, success_rate_lb=0.8, success_rate_ub=0.2)
    with pytest.raises(ValueError, match="tokenizer"):
        MathSingleStepAgent(None)


def test_an_ungradable_row_is_skipped_before_generating(tokenizer, caplog):
    agent = MathSingleStepAgent(tokenizer, {"max_new_tokens": 8}, group_size=2)
    obs_q, act_q = asyncio.Queue(), asyncio.Queue()
    prompt = _prompt(tokenizer, qid="bad-1", solutions=("\\boxed{}",))
    with caplog.at_level("WARNING"):
        out = asyncio.run(agent.collect_trajectory(prompt, MathCodeSingleStepEnv(), obs_q, act_q))
    assert out == [] and obs_q.empty()  # nothing was generated for it
    assert "skipping dataset row 'bad-1'" in caplog.text
    assert (agent.bad_rows.n_bad, agent.bad_rows.n_rows) == (1, 1)


class _RaisingEnv(MathCodeSingleStepEnv):
    async def step(self, action):
        raise RuntimeError("grader bug on this row")


def test_a_row_whose_grading_raises_is_skipped_until_too_many(tokenizer):
    from realhf.impl.dataset.bad_rows import BadRowsError

    agent = MathSingleStepAgent(tokenizer, {"max_new_tokens": 8}, group_size=2)

    async def one(qid):
        obs_q, act_q = asyncio.Queue(), asyncio.Queue()
        task = asyncio.create_task(
            agent.collect_trajectory(_prompt(tokenizer, qid=qid), _RaisingEnv(), obs_q, act_q)
        )
        req = await asyncio.wait_for(obs_q.get(), 10)
        out = (tuple(tokenizer.encode("\\boxed{92}", add_special_tokens=False)),) * 2
        await act_q.put(
            GroupGeneration(
                req.qid,
                req.prompt_ids,
                out,
                ((-0.5,) * len(out[0]),) * 2,
                (False, False),
                (0, 0),
                (1, 1),
            )
        )
        return await asyncio.wait_for(task, 30)

    for i in range(4):  # min_tolerated
        assert asyncio.run(one(f"q{i}")) == []
    with pytest.raises(BadRowsError, match="row 'q0': grading it raised RuntimeError: grader bug"):
        asyncio.run(one("q4"))
