"""The run's secret: where it comes from, the files launchers write, tokens and MACs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from realhf.base.net import auth


@pytest.fixture
def clean_env(monkeypatch):
    """No secret in the environment; the module's cache forgotten before and after."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    auth.reset()
    yield monkeypatch
    auth.reset()


def test_issue_writes_a_fresh_0600_secret_and_workers_read_only_its_path(clean_env, tmp_path):
    env = auth.issue(str(tmp_path))
    assert list(env) == [auth.SECRET_FILE_ENV], "workers get the path, never the secret"
    path = env[auth.SECRET_FILE_ENV]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = open(path).read()
    clean_env.setenv(auth.SECRET_FILE_ENV, path)
    assert auth.run_secret() == bytes.fromhex(first) and len(auth.run_secret()) == 32
    # A new launch of the same trial gets a new secret: processes of the old one are out.
    auth.issue(str(tmp_path))
    assert open(path).read() != first
    # A running process keeps the secret it started with (so it cannot join the new launch);
    # a process of the new launch reads the new one.
    assert auth.run_secret() == bytes.fromhex(first)
    auth.reset()
    assert auth.run_secret() == bytes.fromhex(open(path).read())
    assert [p for p in os.listdir(tmp_path) if p != auth.SECRET_FILE_NAME] == [], "no temp left"


def test_a_secret_file_others_can_read_is_refused(clean_env, tmp_path):
    path = tmp_path / "run_secret"
    path.write_text("ab" * 32)
    os.chmod(path, 0o644)
    clean_env.setenv(auth.SECRET_FILE_ENV, str(path))
    with pytest.raises(auth.SecretError, match="chmod 600"):
        auth.run_secret()
    clean_env.setenv(auth.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(auth.SecretError, match="cannot be read"):
        auth.run_secret()


def test_bad_hex_in_the_environment_is_refused(clean_env):
    clean_env.setenv(auth.SECRET_ENV, "not hex")
    with pytest.raises(auth.SecretError, match="at least 16 bytes"):
        auth.run_secret()


def test_a_process_without_a_secret_makes_one_its_children_share(clean_env):
    env = auth.child_env()
    assert os.environ[auth.SECRET_ENV] == env[auth.SECRET_ENV]
    code = "from realhf.base.net import auth; print(auth.http_token())"
    child = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == auth.http_token()
    assert auth.http_token() not in auth.run_secret().hex(), "the token is not the secret"


def test_bearer_header_check(clean_env):
    token = auth.http_token()
    assert auth.bearer_ok(f"Bearer {token}") and auth.bearer_ok(f"bearer {token}")
    for bad in (None, "", token, f"Basic {token}", f"Bearer {token[:-1]}", "Bearer "):
        assert not auth.bearer_ok(bad), bad


def test_the_mac_binds_the_channel_kind_and_every_byte(clean_env):
    body = b"payload"
    assert auth.mac(b"control", body) != auth.mac(b"push_pull", body), "no cross-channel replay"
    assert auth.mac(b"control", body) != auth.mac(b"control", body + b"!")
    assert auth.mac(b"contro", b"l" + body) != auth.mac(b"control", body), "kind is delimited"
    assert len(auth.mac(b"control", body)) == auth.MAC_BYTES
