"""Agent and environment base classes: async contract, registration, step result shape."""

import asyncio

import pytest

from realhf.api.core.agent_api import Agent, EnvironmentService, StepResult
from realhf.api.core.registry import (
    AgentAbstraction,
    EnvAbstraction,
    make_agent,
    make_env,
    register_agent,
    register_env,
)


class GuessEnv(EnvironmentService):
    """Rewards +1 when the action equals the target."""

    def __init__(self, target: int):
        self.target = target

    async def reset(self, seed=None, options=None):
        return "guess a number", {"seed": seed}

    async def step(self, action):
        ok = action == self.target
        return StepResult(None, 1.0 if ok else -1.0, True, False, {"correct": ok})


class EchoAgent(Agent):
    """Asks the 'model' (the other end of the queues) for an action and grades it."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        obs, _ = await env.reset(seed=0)
        await obs_queue.put((prompt, obs))
        action = await asyncio.wait_for(act_queue.get(), timeout=5)
        _, reward, terminated, truncated, info = await env.step(action)
        return [
            {"prompt": prompt, "action": action, "reward": reward, "done": terminated, "info": info}
        ]


def test_agent_and_env_run_through_queues():
    register_agent("tests.echo", EchoAgent)
    register_env("tests.guess", GuessEnv)
    agent = make_agent(AgentAbstraction("tests.echo"))
    env = make_env(EnvAbstraction("tests.guess", {"target": 7}))

    async def run():
        obs_q, act_q = asyncio.Queue(), asyncio.Queue()

        async def model():
            prompt, obs = await obs_q.get()
            assert obs == "guess a number"
            await act_q.put(7)

        traj, _ = await asyncio.gather(agent.collect_trajectory("p0", env, obs_q, act_q), model())
        return traj

    traj = asyncio.run(run())
    assert traj == [
        {"prompt": "p0", "action": 7, "reward": 1.0, "done": True, "info": {"correct": True}}
    ]


def test_base_classes_name_what_is_missing():
    res = StepResult("o", 0.5, False, True, {})
    obs, reward, terminated, truncated, info = res
    assert (obs, reward, terminated, truncated, info) == (
        "o",
        0.5,
        False,
        True,
        {},
    ) and res.truncated
    assert asyncio.run(EnvironmentService().reset()) == (None, {})
    with pytest.raises(
        NotImplementedError, match=r"environment EnvironmentService does not implement step\(\)"
    ):
        asyncio.run(EnvironmentService().step(1))
    with pytest.raises(
        NotImplementedError, match=r"agent Agent does not implement collect_trajectory\(\)"
    ):
        asyncio.run(Agent().collect_trajectory(None, None, asyncio.Queue(), asyncio.Queue()))
