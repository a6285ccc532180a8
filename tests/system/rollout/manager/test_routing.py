"""Routing: the policies, continuations, exclusions, and reading servers' load metrics."""

from __future__ import annotations

import pytest

from realhf.api.core.rollout_api import ScheduleRequest
from realhf.api.core.rollout_config import SchedulePolicy
from realhf.system.rollout.manager.routing import (
    NoServerAvailable,
    choose_server,
    load_from_metrics,
    parse_metrics,
    route,
)
from realhf.system.rollout.manager.server_pool import ServerState


def test_choose_server_policies():
    a, b, c = ServerState("a"), ServerState("b"), ServerState("c")
    assert [choose_server([a, b, c], "round_robin", i).url for i in range(4)] == list("abca")
    a.metric_requests, b.metric_requests, c.assigned_requests = 3, 1, 2
    assert choose_server([a, b, c], "least_requests", 0).url == "b"
    a.metric_tokens, b.metric_tokens, c.assigned_tokens = 50, 900, 10.5
    assert choose_server([a, b, c], "least_token_usage", 0).url == "c"
    with pytest.raises(NoServerAvailable):
        choose_server([], "round_robin", 0)
    # The enum and its name (what a config or the CLI gives) pick alike.
    assert choose_server([a, b, c], SchedulePolicy.LEAST_TOKEN_USAGE, 0).url == "c"
    assert choose_server([a, b, c], SchedulePolicy.ROUND_ROBIN, 4).url == "b"
    with pytest.raises(ValueError, match="unknown schedule_policy 'fastest'"):
        choose_server([a, b, c], "fastest", 0)


def test_parse_metrics_reads_sglang_gauges():
    text = (
        "# HELP sglang:num_used_tokens x\n# TYPE sglang:num_used_tokens gauge\n"
        'sglang:num_used_tokens{model_name="m"} 123.0\nsglang:num_running_reqs{model_name="m"} 2\n'
    )
    assert parse_metrics(text) == {"sglang:num_used_tokens": 123.0, "sglang:num_running_reqs": 2.0}


def test_parse_metrics_is_prometheus_text_and_agrees_with_the_vllm_adapter():
    """One parser (prometheus_client's) for the manager and the vLLM adapter: label sets of a
    name are summed by both (the manager kept the last one, the adapter summed), a sample's
    timestamp is not its value, and what is not Prometheus text is an error naming it."""
    from realhf.system.rollout import vllm_backend

    vllm = (
        'vllm:num_requests_running{engine="0",model_name="p"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="p"} 2.0 1732250000000\n'
        'vllm:num_requests_waiting{engine="0",model_name="p"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="p"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="p"} 0.25\n'
        'vllm:cache_config_info{engine="0",kv_cache_size_tokens="1000",x="a b}"} 1.0\n'
        'vllm:cache_config_info{engine="1",kv_cache_size_tokens="400"} 1.0\n'
    )
    m = parse_metrics(vllm)
    assert m["vllm:num_requests_running"] == 5.0 and m["vllm:num_requests_waiting"] == 1.0
    gauges = parse_metrics(vllm_backend.sglang_metrics(vllm))
    assert gauges["sglang:num_running_reqs"] == m["vllm:num_requests_running"]
    assert gauges["sglang:num_queue_reqs"] == 1.0
    assert gauges["sglang:num_used_tokens"] == 0.5 * 1000 + 0.25 * 400  # each engine's cache
    assert load_from_metrics(gauges) == (6.0, 600.0)
    for bad in ("<html>502 Bad Gateway</html>", "sglang:num_running_reqs three"):
        with pytest.raises(ValueError, match="not Prometheus text"):
            parse_metrics(bad)
        with pytest.raises(ValueError, match="not Prometheus text"):
            vllm_backend.sglang_metrics(bad)


def test_route_sends_a_continuation_back_while_its_version_holds():
    a, b = ServerState("a", version=3), ServerState("b", version=3)

    def req(**kw):
        return ScheduleRequest("r", prompt_len=4, new_token_budget=8, **kw)

    cont = req(previous_server_url="b", previous_version=3)
    assert route([a, b], cont, "round_robin", 0, b) == (b, False)
    # The server moved to new weights: its cached prefix is stale, the policy decides.
    moved = req(previous_server_url="b", previous_version=2)
    assert route([a, b], moved, "round_robin", 0, b) == (a, True)
    # A server that just failed this rollout is avoided, even as its previous server...
    failed = req(previous_server_url="b", previous_version=3, exclude=("b",))
    assert route([a, b], failed, "round_robin", 1, b) == (a, True)
    # ...unless every live server is excluded: they are used anyway.
    assert route([a, b], req(exclude=("a", "b")), "round_robin", 1, None) == (b, True)
    with pytest.raises(NoServerAvailable, match="dead {'c': 'gone'}"):
        route([], req(), "round_robin", 0, None, {"c": "gone"})


def test_load_from_metrics_adds_running_and_queued_requests():
    m = {"sglang:num_running_reqs": 2.0, "sglang:num_queue_reqs": 3.0}
    assert load_from_metrics(m) == (5.0, 0.0)
    assert load_from_metrics({"sglang:num_used_tokens": 40.0}) == (0.0, 40.0)
