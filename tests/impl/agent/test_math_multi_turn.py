"""math-multi-turn agent against the real math-code environment, with a scripted generator:
per-turn verdicts, discounted rewards, and masks that train on generated tokens only."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import transformers

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import AgentAbstraction, make_agent
from realhf.api.core.rollout_api import TRAJECTORY_KEYS, GenerateGroupRequest, GroupGeneration
from realhf.impl.agent.math_multi_turn import DEFAULT_FEEDBACK
from realhf.impl.environment.math_code_single_step import MathCodeSingleStepEnv

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "realhf", "assets", "tiny")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY)


def _prompt(tokenizer):
    ids = tokenizer.encode("Compute 66+26.", add_special_tokens=False)
    return SequenceSample.from_default(
        ids=["add-66-26"],
        seqlens=[len(ids)],
        data={"packed_prompts": torch.tensor(ids, dtype=torch.long)},
        metadata={"query_id": ["add-66-26"], "task": ["math"], "solutions": [["\\boxed{92}"]]},
    )


def _gen(tokenizer, req, answers, version):
    outs = tuple(
        tuple(tokenizer.encode(a, add_special_tokens=False)) + (tokenizer.eos_token_id,)
        for a in answers
    )
    return GroupGeneration(
        qid=req.qid,
        prompt_ids=req.prompt_ids,
        output_ids=outs,
        output_logprobs=tuple(tuple(-0.1 * (version + 1) for _ in o) for o in outs),
        no_eos=(False,) * len(outs),
        version_start=(version,) * len(outs),
        version_end=(version,) * len(outs),
    )


async def _run(agent, prompt, tokenizer, turns):
    """Serve the agent: ``turns[k]`` maps member -> answer text at turn k+1."""
    obs_q, act_q = asyncio.Queue(), asyncio.Queue()
    task = asyncio.create_task(
        agent.collect_trajectory(prompt, MathCodeSingleStepEnv(), obs_q, act_q)
    )
    seen = []
    first = await asyncio.wait_for(obs_q.get(), 10)
    assert isinstance(first, GenerateGroupRequest) and first.gconfig.n == len(turns[0])
    seen.append([first])
    await act_q.put(_gen(tokenizer, first, [turns[0][j] for j in sorted(turns[0])], 0))
    for k, answers in enumerate(turns[1:], start=1):
        reqs = await asyncio.wait_for(obs_q.get(), 10)
        assert isinstance(reqs, list) and all(r.gconfig.n == 1 for r in reqs)
        seen.append(reqs)
        members = sorted(answers)
        assert [r.qid for r in reqs] == [f"add-66-26/m{j}/t{k + 1}" for j in members]
        await act_q.put([_gen(tokenizer, r, [answers[j]], k) for r, j in zip(reqs, members)])
    return await asyncio.wait_for(task, 60), seen


def test_wrong_answers_get_feedback_and_another_turn(tokenizer):
    agent = make_agent(
        AgentAbstraction(
            "math-multi-turn",
            {"gconfig": {"max_new_tokens": 16}, "group_size": 3, "max_turns": 3},
        ),
        tokenizer=tokenizer,
    )
    prompt = _prompt(tokenizer)
    # member 0 right at once; member 1 right at turn 2; member 2 never
    turns = [
        {0: "\\boxed{92}", 1: "\\boxed{91}", 2: "\\boxed{1}"},
        {1: "\\boxed{92}", 2: "\\boxed{2}"},
        {2: "\\boxed{3}"},
    ]
    (traj,), seen = asyncio.run(_run(agent, prompt, tokenizer, turns))
    assert set(TRAJECTORY_KEYS) <= traj.keys and traj.ids == ["add-66-26"]
    assert traj.metadata["turn_verdicts"] == [[[1.0], [-1.0, 1.0], [-1.0, -1.0, -1.0]]]
    assert traj.metadata["n_turns"] == [[1, 2, 3]]
    # solved at turn 1: 5; at turn 2: 5 * 0.9; never: -5
    assert traj.data["rewards"].tolist() == pytest.approx([5.0, 4.5, -5.0])
    p = tokenizer.encode("Compute 66+26.", add_special_tokens=False)
    fb = tokenizer.encode(DEFAULT_FEEDBACK, add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    enc = lambda a: tokenizer.encode(a, add_special_tokens=False) + eos  # noqa: E731
    want = [
        p + enc(turns[0][0]),
        p + enc(turns[0][1]) + fb + enc(turns[1][1]),
        p + enc(turns[0][2]) + fb + enc(turns[1][2]) + fb + enc(turns[2][2]),
    ]
    # every continuation asked for exactly its member's conversation so far
    assert list(seen[1][0].prompt_ids) == p + enc(turns[0][1]) + fb
    assert list(seen[2][0].prompt_ids) == want[2][: len(want[2]) - len(enc(turns[2][2]))]
    lens = traj.seqlens["packed_input_ids"][0]
    assert lens == [len(w) for w in want]
    ids = traj.data["packed_input_ids"].tolist()
    mask = traj.data["prompt_mask"].tolist()
    lps = traj.data["packed_logprobs"].tolist()
    start = lstart = 0
    for j, w in enumerate(want):
        assert ids[start : start + len(w)] == w
        # generated (trained) tokens: the answers only, never the prompt or the feedback
        gen = [not m for m in mask[start : start + len(w)]]
        expect_gen = [False] * len(p)
        for k in range(len(traj.metadata["turn_verdicts"][0][j])):
            expect_gen += ([False] * len(fb) if k else []) + [True] * len(enc(turns[k][j]))
        assert gen == expect_gen
        # shifted logprobs: the server's value (-0.1 * turn) on generated tokens, 0 elsewhere
        seq_lps = lps[lstart : lstart + len(w) - 1]
        for t in range(1, len(w)):
            if expect_gen[t]:
                turn = sum(1 for x in range(1, t + 1) if expect_gen[x] and not expect_gen[x - 1])
                assert seq_lps[t - 1] == pytest.approx(-0.1 * turn)
            else:
                assert seq_lps[t - 1] == 0.0
        start += len(w)
        lstart += len(w) - 1
    assert traj.data["version_start"].tolist() == [0, 0, 0]
    assert traj.data["version_end"].tolist() == [0, 1, 2]


def test_group_solved_at_once_ends_after_one_turn_and_filters_apply(tokenizer):
    args = {"gconfig": {"max_new_tokens": 16}, "group_size": 2, "max_turns": 3}
    agent = make_agent(AgentAbstraction("math-multi-turn", args), tokenizer=tokenizer)
    (traj,), seen = asyncio.run(
        _run(agent, _prompt(tokenizer), tokenizer, [{0: "\\boxed{92}", 1: "\\boxed{92}"}])
    )
    assert len(seen) == 1 and traj.metadata["n_turns"] == [[1, 1]]
    strict = make_agent(
        AgentAbstraction("math-multi-turn", {**args, "success_rate_ub": 0.99}),
        tokenizer=tokenizer,
    )
    out, _ = asyncio.run(
        _run(strict, _prompt(tokenizer), tokenizer, [{0: "\\boxed{92}", 1: "\\boxed{92}"}])
    )
    assert out == []  # all solved: dropped like math-single-step's groups


def test_bad_options_are_refused(tokenizer):
    with pytest.raises(ValueError, match="max_turns=0 must be an integer >= 1"):
        make_agent(AgentAbstraction("math-multi-turn", {"max_turns": 0}), tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"turn_discount=1.5 must be in \(0, 1\]"):
        make_agent(AgentAbstraction("math-multi-turn", {"turn_discount": 1.5}), tokenizer=tokenizer)


def test_tool_calls_run_in_the_sandbox_and_their_output_joins_the_context(tokenizer):
    from realhf.impl.environment.python_tool import MathPythonToolEnv

    agent = make_agent(
        AgentAbstraction(
            "math-tool-use", {"gconfig": {"max_new_tokens": 16}, "group_size": 2, "max_turns": 3}
        ),
        tokenizer=tokenizer,
    )

    async def run():
        obs_q, act_q = asyncio.Queue(), asyncio.Queue()
        env = MathPythonToolEnv()
        task = asyncio.create_task(agent.collect_trajectory(_prompt(tokenizer), env, obs_q, act_q))
        first = await asyncio.wait_for(obs_q.get(), 10)
        # member 0 calls the tool, member 1 answers (wrong) at once
        await act_q.put(_gen(tokenizer, first, ["<python>print(66+26)</python>", "\\boxed{9}"], 0))
        (req,) = await asyncio.wait_for(obs_q.get(), 60)
        assert req.qid == "add-66-26/m0/t2"
        # the sandbox's output is the member's context now
        assert tokenizer.decode(list(req.prompt_ids)).endswith(
            "<python>print(66+26)</python><|endoftext|><output>92</output>"
        )
        await act_q.put([_gen(tokenizer, req, ["\\boxed{92}"], 1)])
        return await asyncio.wait_for(task, 60)

    (traj,) = asyncio.run(run())
    assert traj.metadata["turn_verdicts"] == [[[0.0, 1.0], [-1.0]]]
    assert traj.data["rewards"].tolist() == [5.0, -5.0]  # no cost per call by default
    # the tool's output is not trained on
    out_ids = tokenizer.encode("<output>92</output>", add_special_tokens=False)
    ids = traj.data["packed_input_ids"].tolist()
    mask = traj.data["prompt_mask"].tolist()
    n = traj.seqlens["packed_input_ids"][0][0]
    k = next(i for i in range(n) if ids[i : i + len(out_ids)] == out_ids)
    assert all(mask[k : k + len(out_ids)]) and not mask[k + len(out_ids)]
