"""``math-single-step``: answer a prompt ``group_size`` times, grade every answer, emit one
trajectory.

One episode::

    obs_queue <- GenerateGroupRequest(qid, prompt, gconfig)      the worker generates
    act_queue -> GroupGeneration (answers, logprobs, versions)
    env.step(MathCodeAction(answer, ...)) for every answer        +1 correct / -1 wrong
    reward = (verdict - reward_bias) * reward_scaling

A group whose success rate (share of correct answers) lies outside
``[success_rate_lb, success_rate_ub]`` is dropped (an empty list): e.g. ``ub = 0.99``
drops groups that every answer solved, which carry no learning signal under group-
normalised advantages.  The rollout worker then releases the group's staleness slot.

The trajectory is a one-item :class:`SequenceSample` with ``group_size`` sequences; see
:func:`build_trajectory` for its keys.

A dataset row that cannot be graded (a math row without a readable reference answer,
checked before generating; or one whose grading raises) is skipped like a filtered group
(an empty list), named in a warning and counted; more than ``max_bad_row_fraction`` of
the rows failing fails the rollout worker, naming them (:mod:`realhf.impl.dataset.bad_rows`).
"""

from __future__ import annotations

import asyncio
from typing import List, Optional, Sequence, Union

from realhf.api.core.agent_api import Agent
from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.registry import register_agent
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration
from realhf.impl.agent.trajectory import Conversation, build_conversation_trajectory
from realhf.impl.dataset.bad_rows import DEFAULT_MAX_FRACTION, BadRowBudget
from realhf.impl.environment.math_code_single_step import MathCodeAction
from realhf.impl.reward.math_reward import UngradableRow, reference_answers

__all__ = ["MathSingleStepAgent", "build_trajectory"]


def build_trajectory(
    prompt: SequenceSample,
    gen: GroupGeneration,
    rewards: Sequence[float],
    extra_metadata: Optional[dict] = None,
) -> SequenceSample:
    """Pack one prompt's group of answers into a one-item SequenceSample: one single-answer
    conversation per member (keys: :mod:`realhf.impl.agent.trajectory`).  Metadata: the
    prompt's, plus ``extra_metadata``."""
    convs = []
    for j, (out, lp) in enumerate(zip(gen.output_ids, gen.output_logprobs)):
        c = Conversation(gen.prompt_ids)
        c.answer(out, lp, gen.version_start[j], gen.version_end[j], gen.no_eos[j])
        convs.append(c)
    return build_conversation_trajectory(
        prompt, gen.qid, convs, rewards, extra_metadata, turns=False
    )


class MathSingleStepAgent(Agent):
    """See the module docstring.

    Attributes:
        name: the registered name (in messages and the bad-row budget).

    Args:
        tokenizer: decodes answers for grading (supplied by the rollout worker).
        gconfig: sampling settings (a GenerationHyperparameters or its fields as a dict).
        group_size: answers per prompt; overrides ``gconfig.n`` when given.
        reward_scaling, reward_bias: reward = (±1 − bias) · scaling.
        success_rate_lb, success_rate_ub: keep groups whose success rate lies in this range.
        max_bad_row_fraction: share of rows that may fail grading before the worker does.
    """

    name = "math-single-step"

    def __init__(
        self,
        tokenizer,
        gconfig: Union[GenerationHyperparameters, dict, None] = None,
        group_size: Optional[int] = None,
        reward_scaling: float = 5.0,
        reward_bias: float = 0.0,
        success_rate_lb: float = 0.0,
        success_rate_ub: float = 1.0,
        max_bad_row_fraction: float = DEFAULT_MAX_FRACTION,
    ):
        if gconfig is None:
            gconfig = GenerationHyperparameters()
        elif isinstance(gconfig, dict):
            gconfig = GenerationHyperparameters(**gconfig)
        elif not isinstance(gconfig, GenerationHyperparameters):
            raise TypeError(
                f"{self.name}: gconfig must be a GenerationHyperparameters or a dict, got "
                f"{gconfig!r}"
            )
        if group_size is not None:
            if not isinstance(group_size, int) or group_size < 1:
                raise ValueError(f"{self.name}: group_size={group_size!r} must be an integer >= 1")
            if gconfig.n not in (1, group_size):
                raise ValueError(
                    f"{self.name}: group_size={group_size} contradicts gconfig.n={gconfig.n}; "
                    "set one of them"
                )
            gconfig = gconfig.new(n=group_size)
        if not (0.0 <= success_rate_lb <= success_rate_ub <= 1.0):
            raise ValueError(
                f"{self.name}: need 0 <= success_rate_lb <= success_rate_ub <= 1, got "
                f"[{success_rate_lb}, {success_rate_ub}]"
            )
        if tokenizer is None:
            raise ValueError(f"{self.name} needs a tokenizer to decode answers for grading")
        self.tokenizer = tokenizer
        self.gconfig = gconfig
        self.reward_scaling = float(reward_scaling)
        self.reward_bias = float(reward_bias)
        self.success_rate_lb = float(success_rate_lb)
        self.success_rate_ub = float(success_rate_ub)
        self.bad_rows = BadRowBudget(self.name, max_bad_row_fraction)

    async def collect_trajectory(
        self, prompt, env, obs_queue: asyncio.Queue, act_queue: asyncio.Queue
    ) -> List[SequenceSample]:
        """One prompt -> [trajectory], or [] when the group is filtered out."""
        self._check_prompt(prompt)
        qid = prompt.ids[0]
        meta = {k: v[0] for k, v in prompt.metadata.items()}
        if not self._gradable(qid, meta):
            return []
        await obs_queue.put(
            GenerateGroupRequest(
                qid,
                tuple(prompt.data["packed_prompts"].tolist()),
                self.gconfig,
                image_data=tuple(meta.get("image_data") or ()),
            )
        )
        gen = self._expect(await act_queue.get(), GroupGeneration)
        verdicts = await self._grade(qid, meta, gen.output_ids, env)
        if verdicts is None:
            return []
        self.bad_rows.good()
        success = sum(v > 0 for v in verdicts) / len(verdicts)
        # Dropped here rather than masked as in the sync pipeline (ppo_data): an async
        # rollout can just not send a trajectory, while sync ranks must keep batch shapes.
        if not self.success_rate_lb <= success <= self.success_rate_ub:
            return []
        rewards = [(v - self.reward_bias) * self.reward_scaling for v in verdicts]
        return [build_trajectory(prompt, gen, rewards)]

    # ---- shared with math-multi-turn ------------------------------------------------

    def _check_prompt(self, prompt) -> None:
        if (
            not isinstance(prompt, SequenceSample)
            or len(prompt) != 1
            or "packed_prompts" not in prompt.keys
        ):
            raise ValueError(
                f"{self.name}: the prompt must be a one-item SequenceSample with key "
                "'packed_prompts'"
            )

    def _gradable(self, qid: str, meta: dict) -> bool:
        """Whether the row can be graded (checked before generating: a row that cannot be
        graded costs nothing); an ungradable one is counted."""
        if (meta.get("task") or "math") == "code":
            return True
        try:
            reference_answers(meta.get("solutions") or ())
        except UngradableRow as e:
            self.bad_rows.bad_row(qid, str(e))
            return False
        return True

    def _expect(self, x, cls):
        if not isinstance(x, cls):
            raise TypeError(
                f"{self.name}: expected a {cls.__name__} on act_queue, got {type(x).__name__}"
            )
        return x

    async def _grade(self, qid: str, meta: dict, outputs, env) -> Optional[List[float]]:
        """+1 / −1 per answer (token ids), or None when the row's grading failed (counted
        against the bad-row budget)."""
        texts = [self.tokenizer.decode(list(ids), skip_special_tokens=True) for ids in outputs]
        try:
            actions = [
                MathCodeAction(
                    t,
                    task=meta.get("task") or "math",
                    solutions=tuple(meta.get("solutions") or ()),
                    input_output=meta.get("input_output"),
                )
                for t in texts
            ]
            results = await asyncio.gather(*(env.step(a) for a in actions))
        except Exception as e:  # noqa: BLE001 — the row's grading failed; the budget decides
            self.bad_rows.bad_row(qid, f"grading it raised {type(e).__name__}: {e}")
            return None
        return [float(r.reward) for r in results]


register_agent("math-single-step", MathSingleStepAgent)
