"""Deciding when periodic things happen: saving, evaluating, logging.

:class:`FrequencyControl` fires every N epochs, every N steps, every N seconds,
or whenever any of those is due.  It is driven by the caller: call
``check(epochs=..., steps=...)`` once per step with how many epochs/steps just
passed.  Its ``state_dict`` holds the counters so a recovered run fires at
exactly the same steps as an uninterrupted one; the seconds elapsed since the
last firing are saved too, so a time criterion resumes where it left off
(downtime while the run was dead does not count).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, Optional

__all__ = ["FrequencyControl", "EpochStepTimeFreqCtl"]


def _check_freq(name: str, value) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if name != "freq_sec" and not isinstance(value, int):
        ok = False
    if not ok:
        kind = "a positive number" if name == "freq_sec" else "a positive int"
        raise ValueError(f"FrequencyControl.{name} must be {kind} or None, got {value!r}.")


@dataclasses.dataclass
class FrequencyControl:
    """Fires when ``freq_epoch`` epochs, ``freq_step`` steps or ``freq_sec`` seconds passed.

    Any combination may be set; None disables that criterion.  All None: never
    fires.  When one criterion fires, all counters restart (so "every 100
    steps or every hour" never fires twice in a row for the same step).

    Args:
        freq_epoch: fire every this many epochs.
        freq_step: fire every this many steps.
        freq_sec: fire when this many seconds passed since the last firing.
    """

    freq_epoch: Optional[int] = None
    freq_step: Optional[int] = None
    freq_sec: Optional[float] = None

    def __post_init__(self) -> None:
        _check_freq("freq_epoch", self.freq_epoch)
        _check_freq("freq_step", self.freq_step)
        _check_freq("freq_sec", self.freq_sec)
        self._epochs = 0  # since the last firing
        self._steps = 0
        # monotonic, not time.time(): an NTP step or a manual clock change must
        # neither fire a time criterion early nor hold it back for hours.
        self._last_time = time.monotonic()
        self._total_epochs = 0
        self._total_steps = 0
        self._n_fired = 0

    def check(self, epochs: int = 0, steps: int = 0) -> bool:
        """Account ``epochs`` and ``steps`` just completed; return whether to act now."""
        if epochs < 0 or steps < 0:
            raise ValueError(f"check() counts must be >= 0, got epochs={epochs}, steps={steps}.")
        self._epochs += epochs
        self._steps += steps
        self._total_epochs += epochs
        self._total_steps += steps
        now = time.monotonic()
        fire = (
            (self.freq_epoch is not None and self._epochs >= self.freq_epoch)
            or (self.freq_step is not None and self._steps >= self.freq_step)
            or (self.freq_sec is not None and now - self._last_time >= self.freq_sec)
        )
        if fire:
            self._epochs = 0
            self._steps = 0
            self._last_time = now
            self._n_fired += 1
        return fire

    @property
    def n_fired(self) -> int:
        """How many times :meth:`check` returned True (including before recovery)."""
        return self._n_fired

    def state_dict(self) -> Dict[str, Any]:
        """Counters needed to resume exactly (JSON-serializable)."""
        return {
            "freq_epoch": self.freq_epoch,
            "freq_step": self.freq_step,
            "freq_sec": self.freq_sec,
            "epochs": self._epochs,
            "steps": self._steps,
            "total_epochs": self._total_epochs,
            "total_steps": self._total_steps,
            "n_fired": self._n_fired,
            "elapsed_sec": time.monotonic() - self._last_time,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore counters saved by :meth:`state_dict`.

        The frequencies must match this object's (a changed config would make
        "resume exactly" meaningless); the seconds elapsed since the last
        firing are restored too, so a half-elapsed time budget stays half.
        """
        for k in ("freq_epoch", "freq_step", "freq_sec"):
            if state.get(k) != getattr(self, k):
                raise ValueError(
                    f"FrequencyControl state was saved with {k}={state.get(k)!r} but this "
                    f"one has {k}={getattr(self, k)!r}; build it with the saved frequencies."
                )
        self._epochs = int(state["epochs"])
        self._steps = int(state["steps"])
        self._total_epochs = int(state["total_epochs"])
        self._total_steps = int(state["total_steps"])
        self._n_fired = int(state["n_fired"])
        # Monotonic clocks of different processes share no epoch, so the saved
        # value is a duration; rebasing it on this process's clock keeps the
        # downtime out of it.
        self._last_time = time.monotonic() - float(state.get("elapsed_sec", 0.0))


# The name the original system used; kept so configs and call sites read alike.
EpochStepTimeFreqCtl = FrequencyControl
