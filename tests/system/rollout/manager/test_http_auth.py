"""Who may call the gserver manager: every route but ``/health`` wants the run's token.

The attacker is a process on the same host without the run's secret
(tests/helpers/engine_servers.py: as_another_run); the run's own client (ManagerClient) sends
the token, and one holding another run's token is told what is missing.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests
from engine_servers import as_another_run, engine_server, stop_servers, two_model_versions

from realhf.api.core.rollout_config import GserverManagerConfig
from realhf.base.net.http_server import auth_headers
from realhf.system.rollout.manager.client import ManagerClient
from realhf.system.rollout.manager.service import ManagerService
from realhf.system.rollout.manager.state import GserverManager

#: every route but /health, with a body it accepts
ROUTES = [
    ("POST", "/allocate_rollout", {"worker": "w", "incarnation": "i"}),
    ("POST", "/schedule_request", {"rollout_id": "r", "prompt_len": 3, "new_token_budget": 4}),
    ("POST", "/finish_rollout", {"rollout_id": "r", "accepted": True, "wait_s": 0}),
    ("POST", "/heartbeat", {"worker": "w", "incarnation": "i"}),
    ("POST", "/report_server_failure", {"url": "http://x", "error": "e"}),
    ("GET", "/status", None),
]


class _Progress:
    def version(self):
        return 0

    def trained_samples(self):
        return 0


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    dirs = two_model_versions(tmp_path_factory.mktemp("auth"))
    srv = engine_server(dirs["v0"])
    m = GserverManager(
        GserverManagerConfig(server_wait_timeout_s=30), _Progress(), lambda: [srv.url], str
    )
    service = ManagerService(m).start(60)
    yield service
    service.stop()
    stop_servers(srv)


def test_another_run_gets_401_everywhere_but_health_and_changes_nothing(service):
    statuses = as_another_run(service.url, ROUTES + [("GET", "/health", None)])
    assert statuses == [401] * (2 * len(ROUTES)) + [200, 200], statuses
    status = requests.get(service.url + "/status", headers=auth_headers(), timeout=10).json()
    assert status["running"] == 0 and status["owners"] == {}  # no allocation went through


def test_the_run_token_opens_every_route(service):
    h = auth_headers()
    r = requests.post(service.url + ROUTES[0][1], json=ROUTES[0][2], headers=h, timeout=10)
    assert r.status_code == 200 and r.json()["success"], r.text
    rid = r.json()["rollout_id"]
    for method, path, body in ROUTES[1:]:
        if body is not None and "rollout_id" in body:
            body = {**body, "rollout_id": rid}
        r = requests.request(method, service.url + path, json=body, headers=h, timeout=10)
        assert r.status_code == 200, (path, r.text)
    # a wrong token is refused before the body is looked at, with what is missing
    r = requests.post(
        service.url + "/allocate_rollout",
        data="{not json",
        headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 401 and "run's token" in r.json()["detail"], r.text


def test_a_client_without_the_runs_token_is_told_what_is_missing(service):
    async def go():
        client = ManagerClient(service.url, timeout_s=10)
        client._session = aiohttp.ClientSession(headers={"Authorization": "Bearer another-run"})
        try:
            with pytest.raises(PermissionError, match="does not hold the run's secret"):
                await client.heartbeat("w", "i")
        finally:
            await client.close()
        client = ManagerClient(service.url, timeout_s=10)  # this run's: its token is sent
        try:
            assert (await client.heartbeat("w2", "i")).n_rollouts == 0
            assert len((await client.status())["servers"]) == 1
        finally:
            await client.close()

    asyncio.run(go())
