"""HTTP messages of the rollout side: construction, JSON round trips, complete validation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from realhf.api.core.rollout_api import (
    AllocatedSlot,
    AllocateReply,
    AllocateRequest,
    FinishReply,
    FinishRequest,
    FinishStatus,
    HeartbeatReply,
    HeartbeatRequest,
    MessageError,
    ScheduleReply,
    ScheduleRequest,
    ServerFailureReport,
    describe_errors,
    parse_message,
)

EXAMPLES = [
    AllocateRequest("rollout_worker/0", "inc-1", "q7"),
    AllocateRequest("rollout_worker/0", "inc-1", "q7", 8),
    AllocateReply(True, "r1", 3, 4),
    AllocateReply(True, "r1", 3, 4, "staleness", (AllocatedSlot("r2", 3, 4),)),
    AllocateReply(False, reason="capacity"),
    ScheduleRequest("r1", 12, 100, "http://a:1", 2, ("http://b:2",)),
    ScheduleReply("http://a:1", 2),
    FinishRequest("r1", True, 2.5),
    FinishReply("accepted", 0),
    HeartbeatRequest("rollout_worker/0", "inc-1"),
    HeartbeatReply(3),
    ServerFailureReport("http://a:1", "connection refused"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_json_round_trip(msg):
    wire = json.loads(json.dumps(msg.to_json()))
    assert parse_message(type(msg), wire) == msg
    assert msg.to_json() == dataclasses.asdict(msg)


def test_finish_status_is_an_enum_on_python_and_the_same_string_on_the_wire():
    reply = FinishReply(FinishStatus.WAIT)
    assert json.loads(json.dumps(reply.to_json())) == {"status": "wait", "index": -1}
    parsed = parse_message(FinishReply, {"status": "accepted", "index": 4})
    assert parsed.status is FinishStatus.ACCEPTED
    assert FinishReply("rejected").status is FinishStatus.REJECTED  # a name validates too


def test_python_callers_keep_positional_construction_and_immutability():
    req = ScheduleRequest("r", 1, 0, exclude=["http://a"])  # a list is fine from Python
    assert req.exclude == ("http://a",) and req.previous_version == -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.prompt_len = 3
    assert FinishRequest("r", False).wait_s == 10.0
    assert FinishRequest("r", True, 1).wait_s == 1.0  # an integer is a valid float


def _error(cls, data) -> str:
    with pytest.raises(MessageError) as e:
        parse_message(cls, data)
    return str(e.value)


def test_a_string_is_not_a_tuple():
    # The old check turned "abc" into ('a', 'b', 'c'): three bogus URLs to exclude.
    msg = _error(
        ScheduleRequest,
        {"rollout_id": "r", "prompt_len": 1, "new_token_budget": 1, "exclude": "abc"},
    )
    assert msg.startswith("ScheduleRequest.exclude: ") and "tuple" in msg and "'abc'" in msg


def test_tuple_items_are_checked():
    msg = _error(
        ScheduleRequest,
        {"rollout_id": "r", "prompt_len": 1, "new_token_budget": 1, "exclude": ["http://a", 7, ""]},
    )
    assert "ScheduleRequest.exclude[1]: Input should be a valid string (got 7)" in msg
    assert "ScheduleRequest.exclude[2]:" in msg  # empty URL


@pytest.mark.parametrize(
    "cls, data, field",
    [
        (
            ScheduleRequest,
            {"rollout_id": "r", "prompt_len": 0, "new_token_budget": 1},
            "prompt_len",
        ),
        (
            ScheduleRequest,
            {"rollout_id": "r", "prompt_len": 1, "new_token_budget": -5},
            "new_token_budget",
        ),
        (
            ScheduleRequest,
            {"rollout_id": "r", "prompt_len": 1, "new_token_budget": 1, "previous_version": -2},
            "previous_version",
        ),
        (ScheduleRequest, {"rollout_id": "", "prompt_len": 1, "new_token_budget": 1}, "rollout_id"),
        (FinishRequest, {"rollout_id": "r", "accepted": True, "wait_s": -1}, "wait_s"),
        (FinishRequest, {"rollout_id": "r", "accepted": True, "wait_s": float("inf")}, "wait_s"),
        (AllocateRequest, {"worker": "", "incarnation": "i"}, "worker"),
        (AllocateRequest, {"worker": "w", "incarnation": "i", "count": 0}, "count"),
        (AllocateRequest, {"worker": "w", "incarnation": "i", "count": 10**6}, "count"),
        (HeartbeatReply, {"n_rollouts": -1}, "n_rollouts"),
        (FinishReply, {"status": "maybe"}, "status"),
    ],
)
def test_ranges_are_checked(cls, data, field):
    assert f"{cls.__name__}.{field}: " in _error(cls, data)


@pytest.mark.parametrize(
    "cls, data, field",
    [
        (
            ScheduleRequest,
            {"rollout_id": "r", "prompt_len": "12", "new_token_budget": 1},
            "prompt_len",
        ),
        (
            ScheduleRequest,
            {"rollout_id": "r", "prompt_len": 1.5, "new_token_budget": 1},
            "prompt_len",
        ),
        (ScheduleRequest, {"rollout_id": 3, "prompt_len": 1, "new_token_budget": 1}, "rollout_id"),
        (FinishRequest, {"rollout_id": "r", "accepted": 1}, "accepted"),
        (FinishRequest, {"rollout_id": "r", "accepted": "yes"}, "accepted"),
        (FinishRequest, {"rollout_id": "r", "accepted": True, "wait_s": "10"}, "wait_s"),
        (HeartbeatReply, {"n_rollouts": True}, "n_rollouts"),
    ],
)
def test_types_are_strict(cls, data, field):
    assert f"{cls.__name__}.{field}: " in _error(cls, data)


def test_unknown_and_missing_fields_are_named():
    msg = _error(AllocateRequest, {"worker": "w", "incarnaton": "i"})
    assert (
        "AllocateRequest.incarnaton: unknown field; "
        "accepted: ['worker', 'incarnation', 'qid', 'count']" in msg
    )
    assert "AllocateRequest.incarnation: Field required" in msg
    assert "HeartbeatReply: Input should be a dictionary" in _error(HeartbeatReply, [1])


def test_describe_errors_reads_fastapi_body_errors():
    errors = [
        {
            "type": "tuple_type",
            "loc": ("body", "exclude"),
            "msg": "Input should be a valid tuple",
            "input": "abc",
        },
        {
            "type": "json_invalid",
            "loc": ("body", 3),
            "msg": "JSON decode error",
            "ctx": {"error": "Expecting value"},
        },
        {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None},
    ]
    out = describe_errors("ScheduleRequest", errors)
    assert "ScheduleRequest.exclude: Input should be a valid tuple (got 'abc')" in out
    assert "not valid JSON (Expecting value)" in out
    assert "the request has no body; send a ScheduleRequest JSON object" in out
