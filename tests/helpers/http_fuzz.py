"""Hypothesis strategies for fuzzing the JSON bodies of HTTP routes, and the check itself.

A route's body comes three ways: any JSON value at all; bytes that are no JSON; and, most
often, a *mutant* — a body the route accepts (built from strategies of valid field values)
with at most one field replaced by an awkward value (a huge or negative number, NaN, a
string, a list, a nested object, ...), dropped, or joined by a field the route does not
know, and the same again one level down.  Purely random JSON almost never gets past the first
check of a handler; mutants of valid bodies reach the code behind it.
"""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

#: examples per route; REALHF_FUZZ_EXAMPLES=5000 searches longer, with fresh examples each run
EXAMPLES = int(os.environ.get("REALHF_FUZZ_EXAMPLES", "40"))

ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinities too: Python's json writes and reads them
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
#: values at the edges of what a field of a JSON body may hold
AWKWARD = (
    st.sampled_from(
        [0, -1, 1, 2**31, 2**63, 10**40, -(10**40), 1e308, -0.0, 0.5, "", "1", [], {}, None]
    )
    | st.sampled_from([float("nan"), float("inf"), float("-inf"), True, False])
    | ANY_JSON
)


def mutants(valid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` dicts as they are, or with one key set to an :data:`AWKWARD` value,
    removed, or joined by an unknown key."""

    def mutate(body, pick, value, how):
        body = dict(body)
        keys = sorted(body)
        if how == "extra" or not keys:
            body["unknown_field"] = value
        elif how == "drop":
            body.pop(keys[pick % len(keys)])
        else:
            body[keys[pick % len(keys)]] = value
        return body

    changed = st.builds(
        mutate,
        valid,
        st.integers(0, 50),
        AWKWARD,
        st.sampled_from(["set", "set", "set", "drop", "extra"]),
    )
    return valid | changed


def bodies(shaped: st.SearchStrategy) -> st.SearchStrategy:
    """Request bodies as bytes: mostly :func:`mutants`-style ``shaped`` ones, some any JSON,
    some no JSON at all."""
    as_json = st.one_of(shaped, shaped, shaped, ANY_JSON).map(lambda v: json.dumps(v).encode())
    return as_json | st.binary(max_size=40)


def check_route(session, url: str, method: str, path: str, shaped, after=None) -> None:
    """Send :data:`EXAMPLES` bodies of :func:`bodies` ``(shaped)`` to ``method path`` and fail
    on the first answer that is not 2xx or 4xx, naming the body; ``after()`` runs after each
    request (e.g. to undo a pause).  The same examples every run unless
    ``$REALHF_FUZZ_EXAMPLES`` is set, so a failure reproduces."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize="REALHF_FUZZ_EXAMPLES" not in os.environ,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies(shaped))
    def one(body):
        r = session.request(
            method,
            url + path,
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
        if after is not None:
            after()
        assert r.status_code < 500, (method, path, body, r.status_code, r.text[:500])

    one()
