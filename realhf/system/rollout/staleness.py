"""Exact per-sample staleness: which rollouts may start, and when a finished one may be handed on.

The trainer and the generation servers run at the same time, so a trajectory is generated
with older weights than the ones that train on it.  With ``max_head_offpolicyness = η`` no
trajectory may be trained by a step more than η versions newer than the version that started
generating it.  This module decides admission and hand-off so that the bound holds for every
single trajectory, not on average.

Model
-----
* ``B = train_batch_size`` trajectories per train step; weights version ``v`` = number of
  finished train steps, so step ``s`` trains at version ``s``.
* A rollout admitted while the servers run version ``v`` gets the *deadline*
  ``d = v + η``: the last step that may train it.  (Versions only grow, so a later
  admission never has an earlier deadline.)
* An accepted trajectory gets the next *index* ``k = A`` where ``A`` = number of
  trajectories accepted so far (trained ones included).  **Trainer contract:** index ``k``
  is trained by step ``k // B`` — i.e. the trainer consumes trajectories in index order,
  ``B`` per step, waiting for a missing index rather than skipping it
  (:class:`IndexOrderBatcher` does this).  Every index below ``A`` is pushed exactly once.
* ``R`` = running rollouts (admitted, not yet accepted or rejected; a finished rollout whose
  hand-off is held still counts), ``R(≤d)`` those with deadline ``≤ d``.

Rules
-----
1. **Admit** a new rollout at version ``v`` iff ``R < max_concurrent_rollouts`` and
   ``(A + R) // B ≤ v + η``  (``A = samples_trained + accepted_pending``).
2. **Accept** a finished rollout ``Y`` (give it index ``A``) iff for every running ``j`` with
   ``d_j < d_Y``: ``A + 1 + R(≤d_j) ≤ B·(d_j + 1)``.  Otherwise hold ``Y`` (it stays in ``R``)
   until rollouts with earlier deadlines are accepted or rejected.
3. **Reject** (filtered group, failed rollout, dead worker, expired lease): drop it from
   ``R``; its slot is free at once.
4. **Reissue** an index ``k < A`` whose trajectory will never arrive (its rollout worker died
   between taking the index and delivering the trajectory): ``k`` becomes a *hole*, and the
   next acceptance takes the smallest hole instead of ``A``.

Holes generalise the counts: with ``H`` the set of holes, the indices still free for
deadline ``d`` are ``F(d) = |{h ∈ H: h < B(d+1)}| + max(0, B(d+1) − A)`` (for ``H = ∅`` the
rules below read exactly as rules 1 and 2 above).  Admission at ``v`` needs
``R + 1 ≤ F(v + η)``; acceptance of ``Y`` takes ``f = min(H ∪ {A})`` and needs, for every
running ``j`` with ``d_j < d_Y``, ``R(≤d_j) ≤ F(d_j) − [f < B(d_j+1)]``; the invariant is
``R(≤d_j) ≤ F(d_j)``.  Reissue only grows ``F``.  Exactness: ``Y ∈ R(≤d_Y) ≤ F(d_Y)`` means
some free index lies below ``B(d_Y+1)``, so the smallest one does.  The trainer waits for a
hole like for any missing index; a late copy of the original trajectory is dropped by
:class:`IndexOrderBatcher` (first arrival wins), so nothing is trained twice.

Invariant ``I``: for every running ``j``, ``A + R(≤d_j) ≤ B·(d_j + 1)``.

Proof sketch
------------
*Admission keeps I.*  The new rollout ``X`` has the largest deadline ``d_X = v + η``, so after
admitting it ``R(≤d_X) = R + 1`` and ``I(d_X)`` reads ``A + R + 1 ≤ B(v+η+1)``, i.e.
``A + R < B(v+η+1)``, i.e. rule 1.  ``R(≤d)`` for smaller deadlines does not change.

*Acceptance keeps I.*  Accepting ``Y`` moves one unit from ``R`` to ``A``: ``A + R(≤d)`` is
unchanged for ``d ≥ d_Y`` and grows by one for ``d < d_Y`` — exactly what rule 2 checks.
Rejection only shrinks ``R``; training moves samples from pending to trained and leaves ``A``
unchanged; a new version only relaxes rule 1.  So I holds at all times.

*Exactness.*  When ``Y`` is accepted, ``I(d_Y)`` with ``Y ∈ R(≤d_Y)`` gives ``A + 1 ≤ B(d_Y+1)``,
so its index ``k = A`` satisfies ``k // B ≤ d_Y``: by the trainer contract it is trained at
version ``k // B ≤ v_start + η``.  (``version_start`` recorded in the trajectory is the version
of the server that ran its first chunk, never below the admission version, so
``trained_version − version_start ≤ η`` as well.)

*Liveness.*  The running rollout with the smallest deadline is always acceptable (rule 2 has
nothing to check), so a held rollout waits only for rollouts with strictly earlier
deadlines, which finish, fail or lose their lease in finite time.

*Tightness (nothing is blocked needlessly).*  If rule 1 refuses, ``A + R ≥ B(v+η+1)``: should
every running rollout finish first, the new one would get an index ``≥ B(d_X+1)`` and be
trained too late.  If rule 2 holds ``Y``, some ``j`` with ``A + 1 + R(≤d_j) > B(d_j+1)``
exists: accepting ``Y`` now and then the ``R(≤d_j)`` rollouts would give the last of them an
index ``≥ B(d_j+1)``.  So neither rule can be relaxed without allowing a violation.

Why not the original's formula
------------------------------
The original admits iff ``(training_samples + running) // B ≤ v + η`` and hands trajectories
on in arrival order.  ``training_samples`` misses trajectories accepted but not yet consumed,
arrival order lets a late-admitted rollout take a slot an earlier one needed (e.g. ``B=2,
η=1``: two version-0 rollouts overtaken by two version-1 rollouts end up trained at version
2), a dropped trajectory keeps no slot accounting, and after a restart
``training_samples = B·step`` while rollouts of the old run may still be counted.  Here ``A``
is the manager's own count, hand-off is gated by rule 2, rejection frees the slot, and
:meth:`StalenessController.load_state_dict` resets ``A`` to the trainer's count and drops
every rollout of the old run.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import threading
import uuid
from collections.abc import Hashable
from typing import Any, Dict, Generic, List, Optional, Protocol, TypeVar, runtime_checkable

from realhf.base import logging, name_resolve, names

logger = logging.getLogger("staleness")

__all__ = [
    "TrainerProgress",
    "NameResolveProgress",
    "Admission",
    "RolloutNotRunning",
    "StalenessController",
    "IndexOrderBatcher",
]


@runtime_checkable
class TrainerProgress(Protocol):
    """Where the trainer stands: the latest published weight version and trained samples."""

    def version(self) -> int:
        """Latest weight version the trainer published (number of finished train steps)."""

    def trained_samples(self) -> int:
        """Trajectories the trainer has consumed so far."""

    def missing(self) -> List[int]:
        """Indices the trainer has waited for a while (of its next batch); may be empty."""


class NameResolveProgress:
    """:class:`TrainerProgress` read from name_resolve.

    ``names.model_version(exp, trial, role)`` (set by the trainer after publishing weights),
    ``names.training_samples(exp, trial)`` (set by the master after each step) and
    ``names.stream_missing`` (set by the trainer while it waits); a missing key reads as 0
    (nothing published yet) or as no missing index.
    """

    def __init__(self, experiment_name: str, trial_name: str, role: str, stream: str = "rollout"):
        self._version_key = names.model_version(experiment_name, trial_name, role)
        self._samples_key = names.training_samples(experiment_name, trial_name)
        self._missing_key = names.stream_missing(experiment_name, trial_name, stream)

    @staticmethod
    def _read_int(key: str) -> int:
        try:
            text = name_resolve.get(key)
        except name_resolve.NameEntryNotFoundError:
            return 0
        try:
            return int(text)
        except ValueError:
            raise ValueError(
                f"name-resolve key {key!r} holds {text!r}, not an integer; the trainer must "
                "publish counts as decimal text"
            ) from None

    def version(self) -> int:
        return self._read_int(self._version_key)

    def trained_samples(self) -> int:
        return self._read_int(self._samples_key)

    def missing(self) -> List[int]:
        try:
            return [int(i) for i in json.loads(name_resolve.get(self._missing_key))]
        except name_resolve.NameEntryNotFoundError:
            return []


@dataclasses.dataclass(frozen=True)
class Admission:
    """A granted rollout slot.

    ``version`` is the servers' version at admission and ``deadline = version + η`` the last
    train step that may consume its trajectory.
    """

    rollout_id: str
    version: int
    deadline: int
    #: who holds the slot; opaque here (the manager uses a ``RolloutOwner``)
    owner: Hashable


class RolloutNotRunning(KeyError):
    """The rollout id is not (or no longer) running: released, expired, or from an old run."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "rollout is not running"


class StalenessController:
    """Admission, hand-off and slot accounting; see the module docstring for the rules.

    Thread-safe (one lock): the manager's event loop mutates it, the worker thread saves it.

    Args:
        train_batch_size: ``B``, trajectories per train step.
        max_head_offpolicyness: ``η``, versions a trajectory may lag the step training it.
        max_concurrent_rollouts: most running rollouts at once.
    """

    def __init__(
        self, train_batch_size: int, max_head_offpolicyness: int, max_concurrent_rollouts: int
    ):
        for name, v, lo in (
            ("train_batch_size", train_batch_size, 1),
            ("max_head_offpolicyness", max_head_offpolicyness, 0),
            ("max_concurrent_rollouts", max_concurrent_rollouts, 1),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"StalenessController: {name}={v!r} must be an integer >= {lo}")
        self.batch_size = train_batch_size
        self.eta = max_head_offpolicyness
        self.max_concurrent = max_concurrent_rollouts
        self._lock = threading.Lock()
        self.accepted_total = 0  # A: the next new index
        self._holes: List[int] = []  # H: reissued indices below A, sorted
        self._running: Dict[str, Admission] = {}
        self._by_deadline: collections.Counter = collections.Counter()
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:6]  # ids of another run never match
        self.stats = collections.Counter()

    # ---- queries ------------------------------------------------------------

    @property
    def running(self) -> int:
        """``R``: admitted rollouts not yet accepted or rejected."""
        return len(self._running)

    @property
    def holes(self) -> List[int]:
        """Reissued indices (below ``A``) waiting for a trajectory, smallest first."""
        with self._lock:
            return list(self._holes)

    def _free(self, deadline: int) -> int:
        """``F(d)``: indices still free that step ``d`` or an earlier one trains."""
        limit = self.batch_size * (deadline + 1)
        return bisect.bisect_left(self._holes, limit) + max(0, limit - self.accepted_total)

    def is_running(self, rollout_id: str) -> bool:
        return rollout_id in self._running

    def get(self, rollout_id: str) -> Admission:
        """The admission of a running rollout; raises :class:`RolloutNotRunning`."""
        try:
            return self._running[rollout_id]
        except KeyError:
            raise RolloutNotRunning(
                f"rollout {rollout_id!r} is not running (it was released — lease expired, "
                "worker restarted — or it belongs to an earlier run)"
            ) from None

    def refusal(self, version: int) -> Optional[str]:
        """Why a rollout cannot be admitted at ``version`` now, or None.

        ``capacity`` or ``staleness``: the manager sends it as ``AllocateReply.reason``.
        """
        with self._lock:
            return self._refusal(version)

    def _refusal(self, version: int) -> Optional[str]:
        if len(self._running) >= self.max_concurrent:
            return "capacity"
        if len(self._running) + 1 > self._free(version + self.eta):
            return "staleness"
        return None

    def capacity(self, version: int) -> int:
        """How many rollouts rule 1 and the concurrency cap would admit right now."""
        with self._lock:
            by_staleness = self._free(version + self.eta) - len(self._running)
            return max(0, min(self.max_concurrent - len(self._running), by_staleness))

    def owned_by(self, owner: Hashable) -> List[str]:
        """Running rollout ids of ``owner``."""
        with self._lock:
            return [r for r, a in self._running.items() if a.owner == owner]

    # ---- transitions --------------------------------------------------------

    def admit(self, version: int, owner: Hashable) -> Optional[Admission]:
        """Rule 1: a new slot at ``version`` for ``owner``, or None when refused."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"admit: version={version!r} must be an integer >= 0")
        with self._lock:
            reason = self._refusal(version)
            if reason is not None:
                self.stats[f"refused_{reason}"] += 1
                return None
            adm = Admission(f"{self._run}-{next(self._ids)}", version, version + self.eta, owner)
            self._running[adm.rollout_id] = adm
            self._by_deadline[adm.deadline] += 1
            self.stats["admitted"] += 1
            return adm

    def can_accept(self, rollout_id: str) -> bool:
        """Rule 2: whether the finished ``rollout_id`` may take the next index now."""
        with self._lock:
            return self._blocking_deadline(self.get(rollout_id)) is None

    def _next_index(self) -> int:
        return self._holes[0] if self._holes else self.accepted_total

    def _blocking_deadline(self, adm: Admission) -> Optional[int]:
        f, cum = self._next_index(), 0
        for d in sorted(self._by_deadline):
            if d >= adm.deadline:
                return None
            cum += self._by_deadline[d]
            if cum > self._free(d) - (f < self.batch_size * (d + 1)):
                return d
        return None

    def accept(self, rollout_id: str) -> Optional[int]:
        """Hand ``rollout_id`` on: its index, or None when rule 2 says to hold it."""
        with self._lock:
            adm = self.get(rollout_id)
            if self._blocking_deadline(adm) is not None:
                self.stats["held"] += 1
                return None
            self._drop(adm)
            if self._holes:
                index = self._holes.pop(0)
                self.stats["filled_holes"] += 1
            else:
                index = self.accepted_total
                self.accepted_total += 1
            self.stats["accepted"] += 1
            return index

    def reissue(self, index: int) -> bool:
        """Rule 4: hand ``index`` out again (its trajectory is lost); False if it is not
        an index given out and not already reissued."""
        with self._lock:
            if not 0 <= index < self.accepted_total or index in self._holes:
                return False
            bisect.insort(self._holes, index)
            self.stats["reissued"] += 1
            return True

    def reject(self, rollout_id: str, why: str = "rejected") -> Admission:
        """Rule 3: free the slot of ``rollout_id`` (filtered, failed or released)."""
        with self._lock:
            adm = self.get(rollout_id)
            self._drop(adm)
            self.stats[why] += 1
            return adm

    def release_owner(self, owner: Hashable, why: str = "released") -> List[str]:
        """Reject every running rollout of ``owner`` (a dead or restarted worker)."""
        with self._lock:
            ids = [r for r, a in self._running.items() if a.owner == owner]
            for r in ids:
                self._drop(self._running[r])
                self.stats[why] += 1
            return ids

    def _drop(self, adm: Admission) -> None:
        del self._running[adm.rollout_id]
        self._by_deadline[adm.deadline] -= 1
        if not self._by_deadline[adm.deadline]:
            del self._by_deadline[adm.deadline]

    # ---- recovery -----------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """JSON-serialisable counters (running rollouts do not survive a restart)."""
        with self._lock:
            return {
                "train_batch_size": self.batch_size,
                "max_head_offpolicyness": self.eta,
                "accepted_total": self.accepted_total,
                "stats": dict(self.stats),
            }

    def load_state_dict(self, state: Dict[str, Any], trained_samples: int) -> None:
        """Resume after a restart at the trainer's ``trained_samples``.

        Every rollout of the old run is dropped and ``A`` becomes ``trained_samples``: the
        trajectories accepted but not trained before the restart were lost with the trainer's
        buffer, so their indices are handed out again.
        """
        if state.get("train_batch_size") != self.batch_size:
            raise ValueError(
                f"StalenessController.load_state_dict: the saved state is for train_batch_size="
                f"{state.get('train_batch_size')!r}, this run uses {self.batch_size}; resume with "
                "the same train_batch_size (indices map to steps through it)"
            )
        if not isinstance(trained_samples, int) or trained_samples < 0:
            raise ValueError(
                f"load_state_dict: trained_samples={trained_samples!r} must be an int >= 0"
            )
        with self._lock:
            lost = int(state.get("accepted_total", 0)) - trained_samples
            if lost > 0:
                logger.warning(
                    f"resuming at {trained_samples} trained samples: {lost} accepted trajectories "
                    "were not trained before the restart and are regenerated"
                )
            self._running.clear()
            self._by_deadline.clear()
            self._holes.clear()
            self._run = uuid.uuid4().hex[:6]
            self.accepted_total = trained_samples
            self.stats = collections.Counter(state.get("stats", {}))
            if self.eta != state.get("max_head_offpolicyness", self.eta):
                logger.info(
                    "max_head_offpolicyness changed from "
                    f"{state['max_head_offpolicyness']} to {self.eta}"
                )


T = TypeVar("T")


class IndexOrderBatcher(Generic[T]):
    """Trainer side of the contract: release trajectories in index order, ``B`` per step.

    ``add(index, item)`` in any arrival order; :meth:`pop_batch` returns the items of indices
    ``[next, next + B)`` once all of them arrived, else None.

    Args:
        batch_size: ``B``.
        start_index: first index expected (``samples_trained`` after a restart).
    """

    def __init__(self, batch_size: int, start_index: int = 0):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"IndexOrderBatcher: batch_size={batch_size!r} must be an integer >= 1"
            )
        self.batch_size = batch_size
        self.next_index = start_index
        self.duplicates = 0
        self._items: Dict[int, T] = {}

    def add(self, index: int, item: T) -> bool:
        """Keep ``item`` under ``index``; False (and nothing kept) for an index that already
        arrived or was consumed: the first arrival wins.

        A second copy of an index is legitimate once: the manager reissued an index whose
        producer died (rule 4), and the original still arrived.  Duplicates are counted.
        """
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"IndexOrderBatcher: index {index!r} must be an integer >= 0")
        if index < self.next_index or index in self._items:
            self.duplicates += 1
            return False
        self._items[index] = item
        return True

    @property
    def pending(self) -> int:
        return len(self._items)

    def missing(self) -> List[int]:
        """Indices of the next batch that have not arrived."""
        return [
            i
            for i in range(self.next_index, self.next_index + self.batch_size)
            if i not in self._items
        ]

    def pop_batch(self) -> Optional[List[T]]:
        if self.missing():
            return None
        batch = [
            self._items.pop(i) for i in range(self.next_index, self.next_index + self.batch_size)
        ]
        self.next_index += self.batch_size
        return batch
