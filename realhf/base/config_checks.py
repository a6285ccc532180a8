"""The checks config dataclasses run in ``__post_init__``, and the errors they raise.

A config builds one :class:`Checks` named after itself and checks each field with it; a
failure is a ``ValueError`` naming the config, the field, the bad value and the fix::

    ck = Checks("GserverManagerConfig", says_invalid=True)
    ck.integer(self, "n_servers", 1)
    ->  ValueError: GserverManagerConfig.n_servers=0 is invalid: use an integer >= 1

Two wordings exist because users and tests match on them: the DAG workers' configs say
``Owner.field=value: fix`` and the rollout-side configs ``Owner.field=value is invalid: fix``.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Type, TypeVar

__all__ = ["Checks", "is_int", "is_num"]

E = TypeVar("E", bound=enum.Enum)


def is_int(x: Any) -> bool:
    """Whether ``x`` is an integer (``True`` is not)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_num(x: Any) -> bool:
    """Whether ``x`` is a finite int or float (``True`` is not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Checks:
    """The checks of config class ``owner``; every error names ``owner.field=value``.

    Args:
        owner: the config's class name.
        says_invalid: word errors ``owner.field=value is invalid: fix`` instead of
            ``owner.field=value: fix``.
    """

    def __init__(self, owner: str, *, says_invalid: bool = False):
        self.owner = owner
        self._sep = " is invalid: " if says_invalid else ": "

    def bad(self, field: str, value: Any, fix: str) -> ValueError:
        """The error for ``field`` holding ``value``; ``fix`` says what to use instead."""
        return ValueError(f"{self.owner}.{field}={value!r}{self._sep}{fix}")

    def integer(self, obj: Any, field: str, lo: int, allow_none: bool = False) -> None:
        """``obj.field`` is an integer >= ``lo`` (or None when ``allow_none``)."""
        v = getattr(obj, field)
        if v is None and allow_none:
            return
        if not is_int(v) or v < lo:
            raise self.bad(field, v, f"use an integer >= {lo}" + (" or None" if allow_none else ""))

    def seconds(self, obj: Any, *fields: str, finite: bool = True) -> None:
        """Each ``obj.field`` is a number of seconds > 0 (finite unless ``finite=False``)."""
        fix = (
            "use a positive, finite number of seconds" if finite else "use a number of seconds > 0"
        )
        for f in fields:
            v = getattr(obj, f)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not number or not v > 0 or (finite and v == math.inf):
                raise self.bad(f, v, fix)

    def enum(self, field: str, value: Any, kind: Type[E]) -> E:
        """``value`` (a member of ``kind`` or its value, e.g. a name from YAML) as a member."""
        try:
            return kind(value)
        except (ValueError, TypeError):
            raise self.bad(field, value, f"use one of {tuple(m.value for m in kind)}") from None

    def bools(self, obj: Any, *fields: str) -> None:
        """Each ``obj.field`` is ``True`` or ``False``."""
        for f in fields:
            v = getattr(obj, f)
            if not isinstance(v, bool):
                raise self.bad(f, v, "use true or false")
