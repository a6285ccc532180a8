"""math-code-single-step environment: real math verifier and real code sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest

from realhf.api.core.registry import EnvAbstraction, make_env
from realhf.impl.environment.math_code_single_step import MathCodeAction, MathCodeSingleStepEnv


def test_math_answers_are_graded_plus_minus_one():
    env = make_env(EnvAbstraction("math-code-single-step", {"math_timeout_s": 10}))

    async def go():
        assert await env.reset() == (None, {})
        good = await env.step(
            MathCodeAction("It is \\boxed{\\frac{1}{2}}.", "math", ("\\boxed{0.5}",))
        )
        bad = await env.step(MathCodeAction("It is \\boxed{3}.", "math", ("\\boxed{0.5}",)))
        group = await env.grade_group(
            [MathCodeAction(f"\\boxed{{{x}}}", "math", ("\\boxed{4}",)) for x in (4, 5, 4)]
        )
        return good, bad, group

    good, bad, group = asyncio.run(go())
    obs, reward, terminated, truncated, info = good
    assert (obs, reward, terminated, truncated) == (None, 1.0, True, False) and info[
        "correct"
    ] is True
    assert bad.reward == -1.0 and bad.info == {"correct": False, "task": "math"}
    assert group == (True, False, True)


def test_code_answer_runs_in_the_sandbox():
    io = json.dumps({"inputs": ["3 4\n", "10 -2\n"], "outputs": ["7\n", "8\n"]})
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    env = MathCodeSingleStepEnv(code_case_timeout_s=10)

    async def go():
        return await env.grade_group(
            [
                MathCodeAction(right, "code", input_output=io),
                MathCodeAction(wrong, "code", input_output=io),
            ]
        )

    assert asyncio.run(go()) == (True, False)


def test_bad_actions_are_named():
    with pytest.raises(ValueError, match="needs reference solutions"):
        MathCodeAction("x", "math")
    with pytest.raises(ValueError, match="input_output"):
        MathCodeAction("x", "code")
    with pytest.raises(ValueError, match="task='poetry'"):
        MathCodeAction("x", "poetry", ("1",))
    with pytest.raises(TypeError, match="expects a MathCodeAction"):
        asyncio.run(MathCodeSingleStepEnv().step("just text"))
    with pytest.raises(ValueError, match="math_timeout_s=0"):
        MathCodeSingleStepEnv(math_timeout_s=0)
