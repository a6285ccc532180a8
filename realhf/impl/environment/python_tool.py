"""``math-python-tool``: grade answers, and run the model's python tool calls in the sandbox.

Two kinds of action:

* :class:`PythonToolCall` — ``code`` runs as ``python -I tool.py`` in the project's code
  sandbox (:func:`functioncall.code.sandbox.run_python`: an unprivileged uid, rlimits,
  bubblewrap where available, no network).  The observation is the text to append to the
  model's context: ``<output>STDOUT</output>`` (at most ``max_output_chars`` characters; the
  last line of stderr instead when the program failed; ``timeout`` when it overstayed
  ``wall_timeout_s``).  Reward 0, the episode goes on.
* :class:`~realhf.impl.environment.math_code_single_step.MathCodeAction` — graded as in
  ``math-code-single-step`` (+1 / −1, the episode ends).

:func:`extract_tool_call` finds a call in an answer: the code between ``<python>`` and
``</python>`` (the last such block).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Optional

from realhf.api.core.agent_api import StepResult
from realhf.api.core.registry import register_env
from realhf.impl.environment.math_code_single_step import MathCodeAction, MathCodeSingleStepEnv

__all__ = ["PythonToolCall", "MathPythonToolEnv", "extract_tool_call"]

_CALL = re.compile(r"<python>(.*?)</python>", re.DOTALL)


def extract_tool_call(text: str) -> Optional[str]:
    """The code of the last ``<python>...</python>`` block of ``text``, or None."""
    calls = _CALL.findall(text)
    return calls[-1].strip() if calls else None


@dataclasses.dataclass(frozen=True)
class PythonToolCall:
    """Run ``code`` (a python program; what it prints is the result)."""

    code: str


class MathPythonToolEnv(MathCodeSingleStepEnv):
    """See the module docstring.  Grading options as :class:`MathCodeSingleStepEnv`, plus:

    Args:
        wall_timeout_s: seconds one tool call may run.
        max_output_chars: the longest observation body (longer output is cut, marked ``...``).
    """

    def __init__(self, wall_timeout_s: float = 5.0, max_output_chars: int = 200, **kw):
        super().__init__(**kw)
        if not wall_timeout_s > 0:
            raise ValueError(f"math-python-tool: wall_timeout_s={wall_timeout_s!r} must be > 0")
        if not isinstance(max_output_chars, int) or max_output_chars < 1:
            raise ValueError(
                f"math-python-tool: max_output_chars={max_output_chars!r} must be an integer >= 1"
            )
        self.wall_timeout_s = float(wall_timeout_s)
        self.max_output_chars = max_output_chars

    async def step(self, action) -> StepResult:
        if isinstance(action, MathCodeAction):
            return await super().step(action)
        if not isinstance(action, PythonToolCall):
            raise TypeError(
                "math-python-tool expects a PythonToolCall or a MathCodeAction, got "
                f"{type(action).__name__}"
            )
        text = await asyncio.to_thread(self._run, action.code)
        return StepResult(f"<output>{text}</output>", 0.0, False, False, {"tool": "python"})

    def _run(self, code: str) -> str:
        from functioncall.code.sandbox import SandboxLimits, run_python

        res = run_python(
            ["{code}/tool.py"],
            {"tool.py": code},
            limits=SandboxLimits(wall_timeout_s=self.wall_timeout_s, max_processes=4),
        )
        if res.timed_out:
            return "timeout"
        out = res.stdout.strip() if res.ok else (res.stderr.strip().splitlines() or ["error"])[-1]
        if len(out) > self.max_output_chars:
            out = out[: self.max_output_chars] + "..."
        return out


register_env("math-python-tool", MathPythonToolEnv)
