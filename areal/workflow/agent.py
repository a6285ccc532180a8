"""Workflows that run the worker system's agents: one agent, two front doors.

:class:`AgentWorkflow` runs any registered realhf agent (``math-single-step``,
``math-multi-turn``, ``math-tool-use``, ``openai-agent``, your own) as a
:class:`~areal.api.workflow_api.RolloutWorkflow`: the agent's generation requests on its
``obs_queue`` are answered by the inference engine, exactly as the rollout worker answers
them, so an episode (its rewards, masks, filters, trajectory) is the same in both front doors.

    workflow = rlvr_workflow(tokenizer, gconfig, group_size=8)          # single turn
    workflow = multi_turn_workflow(tokenizer, gconfig, group_size=8, max_turns=3)
    workflow = tool_workflow(tokenizer, gconfig, group_size=8, max_turns=3)

A dataset row is a one-item ``SequenceSample`` with ``packed_prompts`` and the row's metadata
(``solutions``, ...): what :func:`math_rows` loads from a math jsonl.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from areal.api.engine_api import InferenceEngine
from areal.api.workflow_api import RolloutWorkflow
from realhf.api.core.agent_api import run_agent
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import AgentAbstraction, EnvAbstraction, make_agent, make_env

__all__ = [
    "AgentWorkflow",
    "rlvr_workflow",
    "multi_turn_workflow",
    "tool_workflow",
    "math_rows",
]


class AgentWorkflow(RolloutWorkflow):
    """Run ``agent`` in ``env`` for each row (see the module docstring)."""

    def __init__(self, agent, env):
        self.agent, self.env = agent, env

    async def arun_episode(self, engine: InferenceEngine, data: Any) -> Optional[SequenceSample]:
        trajs = await run_agent(self.agent, data, self.env, engine.agenerate)
        return trajs[0] if trajs else None


def _workflow(agent: str, env: str, tokenizer, gconfig, **args) -> AgentWorkflow:
    import realhf.impl.agent.math_multi_turn  # noqa: F401  (registers the agents)
    import realhf.impl.agent.math_single_step  # noqa: F401
    import realhf.impl.environment.math_code_single_step  # noqa: F401  (and the envs)
    import realhf.impl.environment.python_tool  # noqa: F401

    a = make_agent(AgentAbstraction(agent, {"gconfig": gconfig, **args}), tokenizer=tokenizer)
    return AgentWorkflow(a, make_env(EnvAbstraction(env)))


def rlvr_workflow(tokenizer, gconfig, group_size: int, **args) -> AgentWorkflow:
    """Single-turn RLVR: ``math-single-step`` (group of answers, verifier reward ±5)."""
    return _workflow(
        "math-single-step",
        "math-code-single-step",
        tokenizer,
        gconfig,
        group_size=group_size,
        **args,
    )


def multi_turn_workflow(tokenizer, gconfig, group_size: int, max_turns: int = 3, **args):
    """``math-multi-turn``: feedback on a wrong answer and another try, up to ``max_turns``."""
    return _workflow(
        "math-multi-turn",
        "math-code-single-step",
        tokenizer,
        gconfig,
        group_size=group_size,
        max_turns=max_turns,
        **args,
    )


def tool_workflow(tokenizer, gconfig, group_size: int, max_turns: int = 3, **args):
    """``math-tool-use``: python tool calls run in the code sandbox."""
    return _workflow(
        "math-tool-use",
        "math-python-tool",
        tokenizer,
        gconfig,
        group_size=group_size,
        max_turns=max_turns,
        **args,
    )


def math_rows(path: str, tokenizer) -> List[SequenceSample]:
    """The rows of a math jsonl (``{query_id, prompt, solutions, task?}``) as one-item
    samples, through realhf's math dataset (same checks, same tokenization)."""
    from realhf.impl.dataset.math_dataset import MathPromptDataset

    ds = MathPromptDataset(path, tokenizer)
    rows = [ds[i] for i in range(len(ds))]
    for r in rows:
        if r.data["packed_prompts"].dtype != torch.long:
            raise TypeError(f"{path}: prompts must be token ids")
    return rows
