import socket

import pytest

from realhf.base.net import network


def test_free_ports_bind_and_are_never_repeated():
    ports = network.find_multiple_free_ports(20)
    assert len(set(ports)) == 20
    again = network.find_multiple_free_ports(20)
    assert not set(ports) & set(again)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("", p))


def test_range_and_exclude():
    p = network.find_free_port(low=40000, high=40100, exclude=range(40000, 40050))
    assert 40050 <= p < 40100
    with pytest.raises(ValueError, match="invalid"):
        network.find_free_port(low=10, high=10)


def test_busy_port_is_skipped_and_exhaustion_reported():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="No free TCP port"):
            network.find_free_port(low=busy, high=busy + 1)


def test_gethostip(monkeypatch):
    monkeypatch.delenv("REALHF_HOST_IP", raising=False)
    ip = network.gethostip()
    socket.inet_aton(ip)
    monkeypatch.setenv("REALHF_HOST_IP", "127.0.0.1")
    assert network.gethostip() == "127.0.0.1"
    monkeypatch.delenv("REALHF_HOST_IP")
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    assert network.gethostip() == "127.0.0.1"
