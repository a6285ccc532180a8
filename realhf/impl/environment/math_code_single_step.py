"""``math-code-single-step``: grade one answer to a math or code problem.

The episode is a single step: the action is one generated answer together with what the
grader needs (:class:`MathCodeAction`), the reward is +1 when it is correct and −1 when
not, and the episode ends.  Math answers go through the math verifier
(:func:`realhf.impl.reward.math_reward.verify_batch`), code answers through the sandbox
(:func:`functioncall.code.verify`).  Both are blocking, so they run in a thread and many
rollouts can share one environment.  The environment keeps no per-episode state.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from realhf.api.core.agent_api import EnvironmentService, StepResult
from realhf.api.core.registry import register_env

__all__ = ["MathCodeAction", "MathCodeSingleStepEnv"]

_MATH_TASKS = ("math", "stem")


@dataclasses.dataclass(frozen=True)
class MathCodeAction:
    """One answer to grade.

    Attributes:
        text: the generated answer (decoded).
        task: ``math``, ``stem`` or ``code``.
        solutions: reference solutions (math/stem).
        input_output: JSON test cases ``{"inputs", "outputs", "fn_name"?}`` (code).
    """

    text: str
    task: str = "math"
    solutions: Tuple[str, ...] = ()
    input_output: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise TypeError(
                "MathCodeAction.text must be the decoded answer (str), got "
                f"{type(self.text).__name__}"
            )
        if self.task not in _MATH_TASKS + ("code",):
            raise ValueError(
                f"MathCodeAction.task={self.task!r}: use one of {_MATH_TASKS + ('code',)}"
            )
        sols = self.solutions
        if isinstance(sols, str):
            sols = (sols,)
        object.__setattr__(self, "solutions", tuple(sols or ()))
        if self.task in _MATH_TASKS and not self.solutions:
            raise ValueError(
                f"MathCodeAction: a {self.task} answer needs reference solutions to be graded"
            )
        if self.task == "code" and not self.input_output:
            raise ValueError(
                "MathCodeAction: a code answer needs input_output test cases to be graded"
            )


class MathCodeSingleStepEnv(EnvironmentService):
    """Grades :class:`MathCodeAction` s; reward +1 (correct) or −1 (wrong).

    Args:
        math_timeout_s: seconds the math verifier may spend on one answer.
        code_case_timeout_s: seconds per code test case.
        code_total_timeout_s: seconds for all test cases of one answer.
    """

    def __init__(
        self,
        math_timeout_s: float = 15.0,
        code_case_timeout_s: float = 6.0,
        code_total_timeout_s: float = 200.0,
    ):
        for name, v in (
            ("math_timeout_s", math_timeout_s),
            ("code_case_timeout_s", code_case_timeout_s),
            ("code_total_timeout_s", code_total_timeout_s),
        ):
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(
                    f"MathCodeSingleStepEnv: {name}={v!r} must be a positive number of seconds"
                )
        self.math_timeout_s = float(math_timeout_s)
        self.code_case_timeout_s = float(code_case_timeout_s)
        self.code_total_timeout_s = float(code_total_timeout_s)

    async def reset(self, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None):
        """Nothing to set up: the action carries what grading needs."""
        return None, {}

    async def step(self, action: MathCodeAction) -> StepResult:
        """Grade ``action``: ``(None, ±1.0, True, False, {"correct": bool, "task": task})``."""
        if not isinstance(action, MathCodeAction):
            raise TypeError(
                f"math-code-single-step expects a MathCodeAction, got {type(action).__name__}"
            )
        correct = await asyncio.to_thread(self._grade, action)
        return StepResult(
            None, 1.0 if correct else -1.0, True, False, {"correct": correct, "task": action.task}
        )

    async def grade_group(self, actions: Sequence[MathCodeAction]) -> Tuple[bool, ...]:
        """Grade many answers concurrently; True where correct."""
        results = await asyncio.gather(*(self.step(a) for a in actions))
        return tuple(r.info["correct"] for r in results)

    def _grade(self, action: MathCodeAction) -> bool:
        # Imported on first use: a math-only run never loads the code sandbox, and the
        # verifier's sympy stack only where grading happens.
        if action.task == "code":
            from functioncall.code import verify as verify_code

            return bool(
                verify_code(
                    action.text,
                    action.input_output,
                    case_timeout=self.code_case_timeout_s,
                    total_timeout=self.code_total_timeout_s,
                )
            )
        from realhf.impl.reward.math_reward import verify_batch

        return bool(
            verify_batch([action.text], [list(action.solutions)], timeout=self.math_timeout_s)[0]
        )


register_env("math-code-single-step", MathCodeSingleStepEnv)
