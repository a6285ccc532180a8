"""Agents and the environments they act in: how a rollout turns a prompt into trajectories.

A rollout worker runs one coroutine per prompt::

    trajectories = await agent.collect_trajectory(prompt, env, obs_queue, act_queue)

The agent puts observations (token ids to continue from, with sampling settings: a
:class:`~realhf.api.core.rollout_api.GenerateGroupRequest`, or a list of them to generate
together) on ``obs_queue``; the rollout worker answers each with the generation server's
output (a ``GroupGeneration``, or a list in the same order) on ``act_queue``.  Keeping the
model behind two queues lets one agent be tested without any server and lets the worker
batch, pause and route requests freely.

The environment (e.g. a math verifier that grades an answer) is an asyncio service so that
many rollouts share one instance without threads; a slow step (a sandboxed program, a remote
verifier) does not block the others.

Implementations subclass :class:`Agent` / :class:`EnvironmentService` and register a name with
:func:`~realhf.api.core.registry.register_agent` / :func:`~realhf.api.core.registry.register_env`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, NamedTuple, Optional, Tuple

if TYPE_CHECKING:
    from realhf.api.core.data_api import SequenceSample
    from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration

__all__ = ["StepResult", "EnvironmentService", "Agent", "run_agent"]


class StepResult(NamedTuple):
    """What :meth:`EnvironmentService.step` returns (gymnasium's order; unpacks as a 5-tuple).

    Attributes:
        obs: the next observation (None when the episode ended).
        reward: the reward of the action just taken.
        terminated: the episode reached a terminal state (e.g. the answer was graded).
        truncated: the episode was cut short (time or length limit).
        info: anything else worth logging.
    """

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: Dict[str, Any]


class EnvironmentService:
    """Base class of environments.  Both methods are coroutines.

    ``reset`` starts an episode and returns ``(obs, info)``; ``step`` applies an action and
    returns a :class:`StepResult` ``(obs, reward, terminated, truncated, info)``.
    """

    async def reset(
        self, seed: Optional[int] = None, options: Optional[Dict[str, Any]] = None
    ) -> Tuple[Any, Dict[str, Any]]:
        """Start an episode; the default has no observation and no info."""
        return None, {}

    async def step(self, action: Any) -> StepResult:
        """Apply ``action``; subclasses must implement it."""
        raise NotImplementedError(f"environment {type(self).__name__} does not implement step()")


class Agent:
    """Base class of agents (e.g. single-step math: sample a group of answers, grade them)."""

    async def collect_trajectory(
        self,
        prompt: "SequenceSample",
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> List["SequenceSample"]:
        """Run one prompt to completion; returns finished trajectories for the trainer.

        Returns an empty list when the trajectories are to be dropped (e.g. a group whose
        answers all got the same reward).
        """
        raise NotImplementedError(
            f"agent {type(self).__name__} does not implement collect_trajectory()"
        )


async def run_agent(
    agent: Agent,
    prompt: "SequenceSample",
    env: EnvironmentService,
    generate: Callable[["GenerateGroupRequest"], Awaitable["GroupGeneration"]],
) -> List["SequenceSample"]:
    """Run one ``collect_trajectory`` of ``agent``, answering every request it puts on its
    ``obs_queue`` with ``generate`` (a list of requests concurrently, answered as a list in
    order).  Both front doors drive agents with this: the rollout worker and the light API's
    workflow."""
    from realhf.api.core.rollout_api import GenerateGroupRequest

    obs_queue: asyncio.Queue = asyncio.Queue()
    act_queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(agent.collect_trajectory(prompt, env, obs_queue, act_queue))
    try:
        while True:
            get = asyncio.create_task(obs_queue.get())
            await asyncio.wait({task, get}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                return task.result()
            req = get.result()
            reqs = req if isinstance(req, list) else [req]
            if not reqs or not all(isinstance(r, GenerateGroupRequest) for r in reqs):
                raise TypeError(
                    f"agent {type(agent).__name__} put {req!r:.200} on obs_queue; put a "
                    "GenerateGroupRequest or a non-empty list of them"
                )
            gens = await asyncio.gather(*(generate(r) for r in reqs))
            await act_queue.put(list(gens) if isinstance(req, list) else gens[0])
    finally:
        if not task.done():
            task.cancel()
