"""Routing: which generation server gets the next chunk of a rollout.

One implementation, used by the gserver manager (through its :class:`~.server_pool.ServerPool`)
and by areal's ``RemoteInferenceEngine`` (the same pool over a fixed list of URLs).

:func:`route` first sends a continuation back to the server that generated its previous chunk
when that server still runs the same weight version: its prefix is cached there, and a chunk
is never split across two versions by routing alone.  Otherwise :func:`choose_server` applies
the run's :class:`SchedulePolicy`:

- ``round_robin``: the live servers in URL order, one after another;
- ``least_requests``: fewest running + queued requests (from ``/metrics``) plus those scheduled
  since that read;
- ``least_token_usage``: fewest KV tokens in use (from ``/metrics``) plus an estimate for those
  scheduled since (``prompt_len + token_usage_budget_ratio * new_token_budget`` each).

The load-based policies read ``/metrics`` (Prometheus text, SGLang's gauge names; the vLLM
adapter reports the same names) at every health check: :func:`parse_metrics`, the one reader
of Prometheus text in the project (``prometheus_client``'s parser; the vLLM adapter reads
vLLM's metrics with it too).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, TypeVar

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from realhf.api.core.rollout_api import ScheduleRequest
from realhf.api.core.rollout_config import SchedulePolicy

__all__ = [
    "NoServerAvailable",
    "choose_server",
    "route",
    "metric_samples",
    "parse_metrics",
    "load_from_metrics",
]


class NoServerAvailable(RuntimeError):
    """No live generation server can take a request."""


class Routable(Protocol):
    """What routing reads of a server (``ServerState`` has these)."""

    url: str
    version: int

    @property
    def request_load(self) -> float: ...

    @property
    def token_load(self) -> float: ...


S = TypeVar("S", bound=Routable)

#: Each policy picks from a non-empty, stably ordered list; ``min`` keeps the first of ties.
_POLICIES: Dict[SchedulePolicy, Callable[[Sequence[Routable], int], Routable]] = {
    SchedulePolicy.ROUND_ROBIN: lambda servers, rr: servers[rr % len(servers)],
    SchedulePolicy.LEAST_REQUESTS: lambda servers, rr: min(servers, key=lambda s: s.request_load),
    SchedulePolicy.LEAST_TOKEN_USAGE: lambda servers, rr: min(servers, key=lambda s: s.token_load),
}


def choose_server(servers: Sequence[S], policy: SchedulePolicy | str, rr_counter: int) -> S:
    """Pick a server for a new chunk (``servers`` non-empty, in a stable order).

    ``round_robin`` takes ``servers[rr_counter % len]``; ``least_requests`` /
    ``least_token_usage`` the smallest estimated load (ties: the first).
    """
    if not servers:
        raise NoServerAvailable("choose_server: no server to choose from")
    try:
        pick = _POLICIES[SchedulePolicy(policy)]
    except ValueError:
        raise ValueError(f"unknown schedule_policy {policy!r}") from None
    return pick(servers, rr_counter)


def route(
    live: Sequence[S],
    req: ScheduleRequest,
    policy: SchedulePolicy | str,
    rr_counter: int,
    previous: Optional[S],
    dead: Optional[Dict[str, str]] = None,
) -> tuple[S, bool]:
    """The server for ``req`` among ``live`` (sorted by URL) and whether the policy chose it.

    ``req.exclude`` (servers that just failed this sequence) is a preference: when every live
    server is excluded they are used anyway — a server that failed a health check after the
    client's report is out of ``live`` already, so an excluded live one only had a transient
    error (the client's ``max_server_failures`` bounds the retries).  ``previous`` is the
    state of ``req.previous_server_url`` if the caller knows it; ``dead`` (URL -> reason) only
    makes the error of an empty ``live`` say why.
    """
    candidates = [s for s in live if s.url not in req.exclude] or list(live)
    if not candidates:
        raise NoServerAvailable(
            f"no live generation server for rollout {req.rollout_id}: "
            f"excluded {list(req.exclude)}, dead {dead or {}}"
        )
    if previous is not None and previous in candidates:
        if previous.version == req.previous_version:
            return previous, False
    return choose_server(candidates, policy, rr_counter), True


def metric_samples(text: str) -> List[Sample]:
    """The samples (``name``, ``labels``, ``value``) of Prometheus text ``text``.

    Raises:
        ValueError: ``text`` is not Prometheus text (the message quotes the parser's).
    """
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as e:
        raise ValueError(f"/metrics is not Prometheus text ({e}): {text[:200]!r}") from None


def parse_metrics(text: str) -> Dict[str, float]:
    """Prometheus text -> ``{sample_name: value}``, the values of a name's label sets summed
    (a server with two engines reports each one's running requests: its load is both).

    Raises:
        ValueError: ``text`` is not Prometheus text.
    """
    out: Dict[str, float] = {}
    for s in metric_samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def load_from_metrics(metrics: Dict[str, float]) -> tuple[float, float]:
    """``(running + queued requests, KV tokens in use)`` from a server's parsed ``/metrics``."""
    requests = metrics.get("sglang:num_running_reqs", 0.0) + metrics.get(
        "sglang:num_queue_reqs", 0.0
    )
    return requests, metrics.get("sglang:num_used_tokens", 0.0)
