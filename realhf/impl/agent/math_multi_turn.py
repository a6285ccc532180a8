"""``math-multi-turn``: answer, hear whether it was right, try again — up to ``max_turns``.

One episode for a prompt and its ``group_size`` answers::

    turn 1   obs_queue <- GenerateGroupRequest(qid, prompt, n = group_size)
    grade    env.step(MathCodeAction(answer)) for every answer still trying
    turn k   every member whose last answer was wrong and that has turns left continues
             from its own context + its answer + the feedback message:
             obs_queue <- [GenerateGroupRequest(qid/m<j>/t<k>, context_j, n = 1), ...]
             (one list per turn: the rollout worker generates them together)

Member j's trajectory sequence is the whole conversation, ``prompt a_1 f_1 a_2 f_2 ... a_T``
(``a`` generated answers, each ending with the EOS the model emitted, ``f`` the feedback
tokens).  ``prompt_mask`` is True on every token the model did not generate (the prompt and
each feedback), so the loss trains on the answers only; ``packed_logprobs`` holds the
server's logprob of each generated token and 0 elsewhere.  The reward of a member solved at
turn k is ``(1 − reward_bias) · reward_scaling · turn_discount^(k−1)``; a member never solved
gets ``(−1 − reward_bias) · reward_scaling``.  Per-turn verdicts (+1 / −1) are kept in the
item metadata ``turn_verdicts`` (one list per member) and the turn counts in ``n_turns``.

Groups are filtered by success within the turns (``success_rate_lb/ub``) as in
``math-single-step``, and ungradable rows are skipped the same way.

``math-tool-use`` (:class:`MathToolAgent`) runs the same loop with another rule for what
follows an answer: a python tool call is run in the code sandbox and its output appended.
"""

from __future__ import annotations

import asyncio
from typing import List, Optional, Tuple, Union

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.registry import register_agent
from realhf.api.core.rollout_api import GenerateGroupRequest, GroupGeneration
from realhf.impl.agent.math_single_step import MathSingleStepAgent
from realhf.impl.agent.trajectory import Conversation, build_conversation_trajectory
from realhf.impl.environment.python_tool import PythonToolCall, extract_tool_call

__all__ = ["MathMultiTurnAgent", "MathToolAgent"]

#: what the environment says after a wrong answer (a user turn of the chat template)
DEFAULT_FEEDBACK = "Wrong. Try again: "


class MathMultiTurnAgent(MathSingleStepAgent):
    """See the module docstring.  Arguments as :class:`MathSingleStepAgent`, plus:

    Args:
        max_turns: most answers per member (1 = single-step).
        turn_discount: a member solved at turn k gets the correct reward times this^(k−1).
        feedback: the text appended after a wrong answer (tokenized once).
    """

    name = "math-multi-turn"

    def __init__(
        self,
        tokenizer,
        gconfig: Union[GenerationHyperparameters, dict, None] = None,
        group_size: Optional[int] = None,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        feedback: str = DEFAULT_FEEDBACK,
        **kw,
    ):
        super().__init__(tokenizer, gconfig, group_size, **kw)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"{self.name}: max_turns={max_turns!r} must be an integer >= 1")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"{self.name}: turn_discount={turn_discount!r} must be in (0, 1]")
        self.max_turns = max_turns
        self.turn_discount = float(turn_discount)
        self.feedback_ids = list(tokenizer(feedback, add_special_tokens=False)["input_ids"])
        if not self.feedback_ids:
            raise ValueError(f"{self.name}: the feedback text tokenizes to nothing")

    async def collect_trajectory(
        self, prompt, env, obs_queue: asyncio.Queue, act_queue: asyncio.Queue
    ) -> List[SequenceSample]:
        """One prompt -> [trajectory], or [] when the group is filtered out."""
        self._check_prompt(prompt)
        qid = prompt.ids[0]
        meta = {k: v[0] for k, v in prompt.metadata.items()}
        if not self._gradable(qid, meta):
            return []
        prompt_ids = tuple(prompt.data["packed_prompts"].tolist())
        convs = [Conversation(prompt_ids) for _ in range(self.gconfig.n)]
        await obs_queue.put(GenerateGroupRequest(qid, prompt_ids, self.gconfig))
        gen = self._expect(await act_queue.get(), GroupGeneration)
        active = list(range(len(convs)))
        outputs = [(j, gen, j) for j in active]  # (member, generation, index in it)
        one = self.gconfig.new(n=1)
        for turn in range(1, self.max_turns + 1):
            for j, g, m in outputs:
                convs[j].answer(
                    g.output_ids[m],
                    g.output_logprobs[m],
                    g.version_start[m],
                    g.version_end[m],
                    g.no_eos[m],
                )
            last = turn == self.max_turns
            res = await self._turn(qid, meta, [g.output_ids[m] for _, g, m in outputs], env, last)
            if res is None:
                return []
            active = []
            for (j, _, _), (v, obs) in zip(outputs, res):
                convs[j].verdicts.append(v)
                if obs is not None and not last:
                    convs[j].feedback(obs)
                    active.append(j)
            if not active:
                break
            reqs = [
                GenerateGroupRequest(f"{qid}/m{j}/t{turn + 1}", convs[j].ids, one) for j in active
            ]
            await obs_queue.put(reqs)
            gens = self._expect(await act_queue.get(), list)
            outputs = [(j, self._expect(g, GroupGeneration), 0) for j, g in zip(active, gens)]
        self.bad_rows.good()
        rewards = []
        for c in convs:
            k = c.solved_at
            verdict = 1.0 if k else -1.0
            r = (verdict - self.reward_bias) * self.reward_scaling
            rewards.append(r * self.turn_discount ** (k - 1) if k else r)
        success = sum(c.solved_at is not None for c in convs) / len(convs)
        if not self.success_rate_lb <= success <= self.success_rate_ub:
            return []
        return [build_conversation_trajectory(prompt, qid, convs, rewards)]

    async def _turn(
        self, qid: str, meta: dict, outputs, env, last: bool
    ) -> Optional[List[Tuple[float, Optional[List[int]]]]]:
        """Per answer of this turn: its verdict (+1 / −1; 0 = not graded) and the tokens to
        append before the member's next answer (None: the member is done); None when the
        row's grading failed."""
        verdicts = await self._grade(qid, meta, outputs, env)
        if verdicts is None:
            return None
        return [(v, None if v > 0 else self.feedback_ids) for v in verdicts]


register_agent("math-multi-turn", MathMultiTurnAgent)


class MathToolAgent(MathMultiTurnAgent):
    """``math-tool-use``: an answer may call a python tool (``<python>CODE</python>``, e.g.
    ``print(66+26)``) instead of answering; the environment (``math-python-tool``) runs it in
    the code sandbox and its ``<output>...</output>`` is appended to the member's context,
    from which it answers again.  An answer without a call (or one at the last turn) is
    graded.  Arguments as :class:`MathMultiTurnAgent`; ``max_turns`` bounds the answers
    (calls + the final one) and ``turn_discount`` (default 1: no cost per call) discounts
    each extra one.  Per-turn verdicts are 0 for the tool calls."""

    name = "math-tool-use"

    def __init__(self, tokenizer, *args, turn_discount: float = 1.0, **kw):
        super().__init__(tokenizer, *args, turn_discount=turn_discount, **kw)

    async def _turn(self, qid, meta, outputs, env, last):
        texts = [self.tokenizer.decode(list(ids), skip_special_tokens=True) for ids in outputs]
        calls = [None if last else extract_tool_call(t) for t in texts]
        graded = [ids for ids, c in zip(outputs, calls) if c is None]
        verdicts = await self._grade(qid, meta, graded, env) if graded else []
        if verdicts is None:
            return None
        try:
            results = await asyncio.gather(
                *(env.step(PythonToolCall(c)) for c in calls if c is not None)
            )
        except Exception as e:  # noqa: BLE001 — the tool could not run; the budget decides
            self.bad_rows.bad_row(qid, f"its tool call raised {type(e).__name__}: {e}")
            return None
        v_iter, r_iter = iter(verdicts), iter(results)
        out = []
        for c in calls:
            if c is None:
                out.append((next(v_iter), None))
            else:
                obs = next(r_iter).obs
                out.append((0.0, self.tokenizer(obs, add_special_tokens=False)["input_ids"]))
        return out


register_agent("math-tool-use", MathToolAgent)
