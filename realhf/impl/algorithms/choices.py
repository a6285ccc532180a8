"""`Choice`: the base of every closed set of string options (``adv_estimator=grpo``).

A choice is a :class:`enum.StrEnum`, so a member *is* its string: configs, YAML files and
the command line keep taking and showing plain strings (``ppo.loss_agg_mode=constant``),
while code dispatches on the member, never on a bare string. Its ``repr`` is the value's,
so dataclass reprs and error messages read ``loss_agg_mode='constant'`` as before.
"""

from __future__ import annotations

import enum
from typing import List, TypeVar

__all__ = ["Choice"]

_C = TypeVar("_C", bound="Choice")


class Choice(enum.StrEnum):
    """A string option with a closed set of values (subclass it with the members)."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def values(cls) -> List[str]:
        """Every value, in declaration order."""
        return [m.value for m in cls]

    @classmethod
    def parse(cls: type[_C], value: object, field: str) -> _C:
        """The member whose value is ``value``; a ValueError naming ``field``, the value and
        the valid ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{field}={value!r}: use one of {cls.values()}") from None
