"""Fuzzing the HTTP bodies of every route of the gserver manager (hypothesis).

As tests/impl/model/gen/test_http_fuzz.py for the generation server: bodies each route
accepts with one field made awkward, dropped or added (rollout ids often of rollouts that
exist), random JSON, and bytes that are no JSON (tests/helpers/http_fuzz.py), sent with the
run's token.  Every answer must be 2xx or 4xx, and the manager must still serve afterwards
(``/health``, and its background loops alive).  One manager (and one tiny generation
server) for the module.
"""

from __future__ import annotations

import pytest
import requests
from engine_servers import engine_server, stop_servers, two_model_versions
from http_fuzz import ANY_JSON, check_route, mutants
from hypothesis import strategies as st

from realhf.api.core.rollout_config import GserverManagerConfig
from realhf.base.net.http_server import auth_headers
from realhf.system.rollout.manager import state
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.state import GserverManager

NAME = st.sampled_from(["w0", "w1", "i0"]) | st.text(min_size=1, max_size=6)


class _Progress:
    def version(self):
        return 0

    def trained_samples(self):
        return 0


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    """The manager's service, the URL of its server, and ids of rollouts it runs."""
    dirs = two_model_versions(tmp_path_factory.mktemp("fuzz"))
    srv = engine_server(dirs["v0"])
    cfg = GserverManagerConfig(
        server_wait_timeout_s=30, train_batch_size=8, max_head_offpolicyness=1000
    )
    m = GserverManager(cfg, _Progress(), lambda: [srv.url], lambda v: dirs["v1"])
    # A held /finish_rollout waits up to this long: short, or an example waits a minute.
    held, state.MAX_FINISH_WAIT_S = state.MAX_FINISH_WAIT_S, 0.2
    service = ManagerService(m).start(60)
    session = requests.Session()
    session.headers.update(auth_headers())
    # Rollouts of owners the examples do not name: an example's allocate or heartbeat as
    # a new incarnation of a worker releases that worker's rollouts.
    ids = []
    for w in ("owner-a", "owner-b"):
        r = session.post(
            service.url + "/allocate_rollout",
            json={"worker": w, "incarnation": "o", "count": 3},
            timeout=10,
        ).json()
        ids += [r["rollout_id"]] + [s["rollout_id"] for s in r["more"]]
    yield service, srv.url, ids, session
    session.close()
    service.stop()
    state.MAX_FINISH_WAIT_S = held
    stop_servers(srv)


def _routes(server_url, ids):
    """Each route's bodies (see http_fuzz.mutants); rollout ids are often of live rollouts."""
    rollout = st.sampled_from(ids) | NAME
    url = st.sampled_from([server_url, "http://127.0.0.1:9"]) | NAME
    count = st.integers(0, 5)
    # In this order: schedules and finishes while the rollouts made at the start still run.
    return {
        ("POST", "/schedule_request"): mutants(
            st.fixed_dictionaries(
                {
                    "rollout_id": rollout,
                    "prompt_len": st.integers(1, 64),
                    "new_token_budget": count,
                },
                optional={
                    "previous_server_url": url,
                    "previous_version": st.integers(-1, 2),
                    "exclude": st.lists(url, max_size=2),
                    "n_sequences": st.integers(1, 4),
                },
            )
        ),
        ("POST", "/finish_rollout"): mutants(
            st.fixed_dictionaries(
                {"rollout_id": rollout, "accepted": st.booleans()},
                optional={"wait_s": st.floats(0, 0.1)},
            )
        ),
        ("POST", "/allocate_rollout"): mutants(
            st.fixed_dictionaries(
                {"worker": NAME, "incarnation": NAME},
                optional={"qid": st.text(max_size=6), "count": st.integers(1, 4)},
            )
        ),
        ("POST", "/heartbeat"): mutants(
            st.fixed_dictionaries({"worker": NAME, "incarnation": NAME})
        ),
        ("POST", "/report_server_failure"): mutants(
            st.fixed_dictionaries({"url": url}, optional={"error": st.text(max_size=20)})
        ),
        ("GET", "/status"): ANY_JSON,
        ("GET", "/health"): ANY_JSON,
    }


ROUTES = list(_routes("", ["x"]))


@pytest.mark.parametrize("method,path", ROUTES)
def test_random_bodies_get_2xx_or_4xx_and_the_manager_keeps_serving(manager, method, path):
    service, server_url, ids, session = manager
    check_route(session, service.url, method, path, _routes(server_url, ids)[(method, path)])
    assert requests.get(service.url + "/health", timeout=10).status_code == 200
    service.check()  # the background loops are alive
