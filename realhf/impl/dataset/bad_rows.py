"""Dataset rows that load but fail when used: skip them, say which, stop when too many.

A row can pass the loader's checks and still fail mid-run: its reference answer is one the
verifier cannot read, or grading it raises.  One such row in a dataset of thousands should
not end a run that took hours to get there (and with ``recover_mode=auto`` the resumed run
would meet the same row again, and fail again); a dataset where many rows fail is
broken, and training on the rest would hide that.  So the user of a row (the reward
interface in synchronous PPO, the agent in asynchronous PPO) reports each row to a
:class:`BadRowBudget`:

* a bad row is skipped (no learning signal from it) with a warning naming its id and
  why, once per row, and counted (``bad_rows`` in the caller's stats);
* when more than ``max_fraction`` of the rows seen so far were bad (and more than
  ``min_tolerated``, so that an early bad row out of three does not count as a third of
  the dataset), :class:`BadRowsError` fails the run, naming the rows.

Counts are per process (each model worker or rollout worker keeps its own).
"""

from __future__ import annotations

import math
from typing import Dict

from realhf.base import logging

logger = logging.getLogger("bad_rows")

__all__ = ["BadRowBudget", "BadRowsError", "DEFAULT_MAX_FRACTION"]

#: default share of rows that may fail before the run does
DEFAULT_MAX_FRACTION = 0.05


class BadRowsError(RuntimeError):
    """Too many dataset rows failed when used (the message names them and why)."""


class BadRowBudget:
    """Counts rows used and rows that failed; see the module docstring.

    Args:
        who: names the user of the rows in messages (``"math_reward"``).
        max_fraction: share of rows seen that may fail (0: none may; 1: all may).
        min_tolerated: bad rows tolerated whatever the share.
    """

    def __init__(
        self, who: str, max_fraction: float = DEFAULT_MAX_FRACTION, min_tolerated: int = 4
    ):
        if (
            not isinstance(max_fraction, (int, float))
            or isinstance(max_fraction, bool)
            or not 0.0 <= max_fraction <= 1.0
        ):
            raise ValueError(
                f"{who}: max_bad_row_fraction={max_fraction!r} must be a number in [0, 1] "
                "(the share of dataset rows that may fail when used)"
            )
        if not isinstance(min_tolerated, int) or min_tolerated < 0:
            raise ValueError(f"{who}: min_tolerated={min_tolerated!r} must be an integer >= 0")
        self.who = who
        self.max_fraction = float(max_fraction)
        self.min_tolerated = min_tolerated if max_fraction > 0 else 0
        self.n_rows = 0
        self.n_bad = 0
        #: row id -> why it failed (first time), in order
        self.bad: Dict[str, str] = {}

    def good(self, n: int = 1) -> None:
        """``n`` rows were used without a problem."""
        self.n_rows += n

    def bad_row(self, row_id: str, reason: str) -> None:
        """Row ``row_id`` failed (``reason`` says how): warn, count, and raise
        :class:`BadRowsError` when the budget is spent."""
        self.n_rows += 1
        self.n_bad += 1
        if row_id not in self.bad:
            self.bad[row_id] = reason
            logger.warning(
                f"{self.who}: skipping dataset row {row_id!r} ({self.n_bad} of {self.n_rows} "
                f"rows failed so far): {reason}"
            )
        if self.n_bad > max(self.min_tolerated, math.floor(self.max_fraction * self.n_rows)):
            shown = list(self.bad.items())[:10]
            more = len(self.bad) - len(shown)
            raise BadRowsError(
                f"{self.who}: {self.n_bad} of {self.n_rows} dataset rows failed when used, more "
                f"than max_bad_row_fraction={self.max_fraction:g} allows; fix or remove them:\n"
                + "\n".join(f"  row {rid!r}: {why}" for rid, why in shown)
                + (f"\n  ... and {more} more" if more else "")
            )
