"""Asynchronous RL: the messages between rollout-side processes.

Processes and what travels between them::

    rollout_worker --HTTP--> gserver_manager   AllocateRequest/Reply, ScheduleRequest/Reply,
                                               FinishRequest/Reply, HeartbeatRequest/Reply,
                                               ServerFailureReport
    rollout_worker --HTTP--> generation_server SGLang's /generate (realhf.api.core.gen_api)
    gserver_manager --HTTP--> generation_server /pause_generation, /update_weights_from_disk,
                                               /continue_generation, /health, /metrics
    agent <--queues--> rollout_worker          GenerateGroupRequest -> GroupGeneration
    rollout_worker --ZMQ push--> trainer       Trajectory (one per accepted rollout)

HTTP messages are frozen pydantic dataclasses sent as JSON objects (:meth:`to_json`; servers
validate bodies through FastAPI, clients replies with :func:`parse_message`).  Validation is
complete: unknown and missing fields, types (strict: ``"5"`` is no integer, ``"abc"`` no
tuple), tuple items and ranges, each error naming the field (:func:`describe_errors`).
The configs of these workers are in :mod:`realhf.api.core.rollout_config`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Annotated, Any, Dict, Iterable, List, Mapping, Tuple, Type, TypeVar

import pydantic
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters

__all__ = [
    "FinishStatus",
    "MessageError",
    "parse_message",
    "describe_errors",
    "AllocateRequest",
    "AllocateReply",
    "AllocatedSlot",
    "MAX_ALLOCATE_COUNT",
    "ScheduleRequest",
    "ScheduleReply",
    "FinishRequest",
    "FinishReply",
    "HeartbeatRequest",
    "HeartbeatReply",
    "ServerFailureReport",
    "GenerateGroupRequest",
    "GroupGeneration",
    "Trajectory",
    "TRAJECTORY_KEYS",
]


class FinishStatus(enum.StrEnum):
    """The manager's answer to a finished rollout (:class:`FinishReply`)."""

    #: handed on: the trajectory has its index
    ACCEPTED = "accepted"
    #: released (the worker asked ``accepted=False``)
    REJECTED = "rejected"
    #: held past the request's ``wait_s``: ask again
    WAIT = "wait"


#: keys of every trajectory's SequenceSample (see :class:`Trajectory`)
TRAJECTORY_KEYS = (
    "packed_input_ids",
    "prompt_mask",
    "packed_logprobs",
    "seq_no_eos_mask",
    "packed_prompts",
    "version_start",
    "version_end",
    "rewards",
)


# ---------------------------------------------------------------- HTTP messages


class MessageError(ValueError):
    """A JSON message does not match its class (the message names every wrong field)."""


#: Unknown fields are errors: a misspelt optional field must not silently fall back to its
#: default.  (Strictness is per field type below, so Python callers may still pass a list
#: where a tuple is declared, and JSON arrays validate as tuples.)
_message = pydantic.dataclasses.dataclass(frozen=True, config=ConfigDict(extra="forbid"))

#: a non-empty identifier (worker names, incarnations, rollout ids, URLs)
_Name = Annotated[StrictStr, Field(min_length=1)]
#: a weight version or a step number
_Count = Annotated[StrictInt, Field(ge=0)]
#: the most slots one AllocateRequest may ask for
MAX_ALLOCATE_COUNT = 4096

M = TypeVar("M")


def describe_errors(name: str, errors: Iterable[Mapping[str, Any]]) -> str:
    """One line per pydantic error of message ``name``: ``Name.field[i]: problem (got value)``.

    Accepts ``ValidationError.errors()`` and FastAPI's ``RequestValidationError.errors()``
    (whose locations start with ``"body"``).
    """
    lines = []
    for e in errors:
        loc = list(e.get("loc", ()))
        if loc[:1] == ["body"]:
            loc = loc[1:]
        kind = e.get("type", "")
        if kind == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", e.get("msg", ""))
            lines.append(f"the request body is not valid JSON ({detail}); send a {name} object")
            continue
        if not loc and kind == "missing":
            lines.append(f"the request has no body; send a {name} JSON object")
            continue
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        msg = e.get("msg", "invalid")
        if kind == "unexpected_keyword_argument":
            accepted = (
                [f.name for f in dataclasses.fields(_MESSAGES[name])] if name in _MESSAGES else []
            )
            msg = f"unknown field; accepted: {accepted}"
        elif kind != "missing":
            msg += f" (got {e.get('input')!r})"
        lines.append(f"{name}{field}: {msg}")
    return "; ".join(lines) or f"{name}: invalid"


@functools.lru_cache(maxsize=None)
def _adapter(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def parse_message(cls: Type[M], data: Any) -> M:
    """Validate decoded JSON ``data`` as message ``cls``; :class:`MessageError` names the fields."""
    try:
        return _adapter(cls).validate_python(data)
    except pydantic.ValidationError as e:
        raise MessageError(describe_errors(cls.__name__, e.errors(include_url=False))) from None


class _Message:
    def to_json(self) -> Dict[str, Any]:
        """The JSON object of this message."""
        return dataclasses.asdict(self)


@_message
class AllocateRequest(_Message):
    """Rollout worker -> manager: may I start ``count`` rollouts, the first for prompt ``qid``?

    ``worker`` names the rollout worker and ``incarnation`` its process (a fresh id per
    start): the slot is leased to that process and released if its heartbeats stop or a new
    incarnation of the same worker shows up.  Asking for several slots at once saves a
    round trip per rollout when a whole batch becomes admissible together (a new weight
    version under a tight staleness bound).
    """

    worker: _Name
    incarnation: _Name
    qid: StrictStr = ""
    count: Annotated[StrictInt, Field(ge=1, le=MAX_ALLOCATE_COUNT)] = 1


@_message
class AllocatedSlot(_Message):
    """One admitted rollout of an :class:`AllocateReply`."""

    rollout_id: _Name
    version: _Count
    deadline: _Count


@_message
class AllocateReply(_Message):
    """``success``: a slot ``rollout_id`` started at ``version`` (train it by step ``deadline``).

    Otherwise ``reason`` is ``capacity`` (too many running) or ``staleness`` (wait for the
    trainer).  For a request of ``count`` > 1, ``more`` holds the slots after the first
    (admitted in order until the first refusal, so ``1 + len(more) <= count``) and
    ``reason`` says why fewer than ``count`` were granted.
    """

    success: StrictBool
    rollout_id: StrictStr = ""
    version: _Count = 0
    deadline: _Count = 0
    reason: StrictStr = ""
    more: Tuple[AllocatedSlot, ...] = ()

    def slots(self) -> List[AllocatedSlot]:
        """Every granted slot, the first one included (empty when refused)."""
        if not self.success:
            return []
        return [AllocatedSlot(self.rollout_id, self.version, self.deadline), *self.more]


@_message
class ScheduleRequest(_Message):
    """Rollout worker -> manager: which server should run the next chunk of ``rollout_id``?

    The chunk is one ``/generate`` call for ``n_sequences`` sequences of the rollout (a
    group's members go together).  ``prompt_len`` counts the tokens the server gets (prompts
    plus the answers so far, summed over the sequences) and ``new_token_budget`` the tokens
    they may still generate (summed).  A continuation names the server and version of its
    previous chunk (``""`` / ``-1`` for none); it goes back to that server when its version is
    unchanged (cached prefix).  ``exclude`` lists servers that just failed this rollout.
    """

    rollout_id: _Name
    prompt_len: Annotated[StrictInt, Field(ge=1)]
    new_token_budget: _Count
    previous_server_url: StrictStr = ""
    previous_version: Annotated[StrictInt, Field(ge=-1)] = -1
    exclude: Tuple[_Name, ...] = ()
    n_sequences: Annotated[StrictInt, Field(ge=1)] = 1


@_message
class ScheduleReply(_Message):
    """The server to use and the weight version it runs."""

    url: _Name
    version: _Count


@_message
class FinishRequest(_Message):
    """Rollout worker -> manager: ``rollout_id`` is done.

    ``accepted=False`` releases the slot (filtered group or failure).  ``accepted=True`` asks
    for the trajectory's index; the manager may hold the answer up to ``wait_s`` seconds (it
    caps the wait at its own limit) and then reply ``wait`` (ask again).
    """

    rollout_id: _Name
    accepted: StrictBool
    wait_s: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 10.0


@_message
class FinishReply(_Message):
    """``status``: ``accepted`` (with ``index``), ``rejected`` or ``wait``."""

    status: FinishStatus
    index: Annotated[StrictInt, Field(ge=-1)] = -1


@_message
class HeartbeatRequest(_Message):
    """Rollout worker -> manager: renew every lease of this worker incarnation."""

    worker: _Name
    incarnation: _Name


@_message
class HeartbeatReply(_Message):
    """How many rollouts the manager holds for this incarnation."""

    n_rollouts: _Count


@_message
class ServerFailureReport(_Message):
    """Rollout worker -> manager: a call to ``url`` failed with ``error`` (connection, 5xx)."""

    url: _Name
    error: StrictStr = ""


_MESSAGES: Dict[str, type] = {
    c.__name__: c
    for c in (
        AllocateRequest,
        AllocateReply,
        ScheduleRequest,
        ScheduleReply,
        FinishRequest,
        FinishReply,
        HeartbeatRequest,
        HeartbeatReply,
        ServerFailureReport,
    )
}


# ---------------------------------------------------------------- agent <-> worker


@dataclasses.dataclass(frozen=True)
class GenerateGroupRequest:
    """Agent -> rollout worker (``obs_queue``): generate ``gconfig.n`` answers to ``prompt_ids``
    (with ``image_data``, the prompt's images as data URLs, for a vision-language model)."""

    qid: str
    prompt_ids: Tuple[int, ...]
    gconfig: GenerationHyperparameters
    image_data: Tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError(f"GenerateGroupRequest {self.qid!r}: prompt_ids is empty")


@dataclasses.dataclass(frozen=True)
class GroupGeneration:
    """Rollout worker -> agent (``act_queue``): the answers, one entry per group member.

    ``output_logprobs[j]`` has one logprob per token of ``output_ids[j]`` (chunks of a
    resubmitted sequence concatenated); ``no_eos[j]`` is True when member j hit the token
    budget; ``version_start[j]`` / ``version_end[j]`` are the weight versions of its first
    and last chunk.
    """

    qid: str
    prompt_ids: Tuple[int, ...]
    output_ids: Tuple[Tuple[int, ...], ...]
    output_logprobs: Tuple[Tuple[float, ...], ...]
    no_eos: Tuple[bool, ...]
    version_start: Tuple[int, ...]
    version_end: Tuple[int, ...]

    def __post_init__(self):
        n = len(self.output_ids)
        for f in ("output_logprobs", "no_eos", "version_start", "version_end"):
            if len(getattr(self, f)) != n:
                raise ValueError(
                    f"GroupGeneration {self.qid!r}: {f} has {len(getattr(self, f))} entries "
                    f"for {n} members"
                )
        for j, (ids, lps) in enumerate(zip(self.output_ids, self.output_logprobs)):
            if len(ids) != len(lps):
                raise ValueError(
                    f"GroupGeneration {self.qid!r}: member {j} has {len(ids)} tokens and "
                    f"{len(lps)} logprobs"
                )

    @property
    def group_size(self) -> int:
        return len(self.output_ids)


# ---------------------------------------------------------------- rollout worker -> trainer


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A finished rollout on its way to the trainer (one prompt and its group of answers).

    Attributes:
        index: position in the manager's acceptance order.  The trainer must train index k in
            step ``k // train_batch_size`` (consume in index order, never skip one; see
            :class:`realhf.system.rollout.staleness.IndexOrderBatcher`), which makes the staleness
            bound exact.
        sample: one item with ``group_size`` sequences and keys :data:`TRAJECTORY_KEYS`
            (``packed_input_ids`` [L], ``prompt_mask`` [L] bool, ``packed_logprobs`` [L-1]
            float32 zero over the prompt, ``seq_no_eos_mask`` [1] bool, ``packed_prompts``
            [prompt_len] once per item, ``version_start``/``version_end`` [1] int64,
            ``rewards`` [1] float32), metadata from the prompt.
        rollout_id, worker: who produced it.
        birth_time: wall-clock seconds when it was accepted.
        data_epoch: the producing worker's dataset epoch of the prompt; the trainer keeps
            each worker's trained prompts per epoch in its checkpoint, so a resumed rollout
            worker skips the prompts already trained.
    """

    index: int
    sample: SequenceSample
    rollout_id: str
    worker: str
    birth_time: float = dataclasses.field(default_factory=time.time)
    data_epoch: int = 0

    def __post_init__(self):
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"Trajectory.index={self.index!r} must be an integer >= 0")
        if not isinstance(self.sample, SequenceSample) or len(self.sample) != 1:
            raise ValueError(
                "Trajectory.sample must be a one-item SequenceSample (one prompt and its answers)"
            )
        missing = sorted(set(TRAJECTORY_KEYS) - self.sample.keys)
        if missing:
            raise ValueError(f"Trajectory {self.sample.ids[0]!r} lacks keys {missing}")

    @property
    def qid(self) -> str:
        return self.sample.ids[0]

    @property
    def version_start(self) -> int:
        """Oldest weight version any answer started with."""
        return int(self.sample.data["version_start"].min())

    @property
    def version_end(self) -> int:
        """Newest weight version any answer ended with."""
        return int(self.sample.data["version_end"].max())

    def to_sequence_sample(self) -> SequenceSample:
        """The sample with ``index`` and ``birth_time`` added to its metadata."""
        meta = {k: list(v) for k, v in self.sample.metadata.items()}
        meta["index"] = [self.index]
        meta["birth_time"] = [self.birth_time]
        return dataclasses.replace(self.sample, metadata=meta)
