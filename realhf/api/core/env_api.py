"""Environments that agents act in (e.g. a math verifier that grades an answer).

An environment is an asyncio service so that many rollouts share one instance without
threads; a slow step (a sandboxed program, a remote verifier) does not block the others.
Implementations subclass :class:`EnvironmentService` and register a name with
:func:`realhf.api.core.registry.register_env`.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

__all__ = ["StepResult", "EnvironmentService"]


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
