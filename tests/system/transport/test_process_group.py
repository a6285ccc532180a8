"""init_world: rank 0's store binds before its address is published, and ranks join through it.

The two-rank test runs this file as a script (``python test_process_group.py --rank R
...``), one process per rank, sharing a file-based name-resolve root.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist
from rank_processes import run_ranks

from realhf.base import name_resolve, names, shutdown
from realhf.base.net import network
from realhf.system.transport.process_group import init_world

EXP, GROUP = "pg-test", "model_worker"


def _listening_ports() -> set:
    return {
        c.laddr.port
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.fixture
def loopback(monkeypatch):
    """Rank 0 publishes 127.0.0.1, whatever this host's name resolves to."""
    monkeypatch.setenv("REALHF_HOST_IP", "127.0.0.1")


def test_the_published_port_is_the_one_the_store_listens_on(memory_name_resolve, trial, loopback):
    before = _listening_ports()
    world = init_world(EXP, trial, GROUP, 0, 1, torch.device("cpu"), timeout=30)
    try:
        assert name_resolve.get(names.distributed_master(EXP, trial, GROUP)) == world.address
        host, port = world.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        port = int(port)
        assert port in _listening_ports() - before  # this process listens there...
        probe = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        probe.set("probe", "1")  # ...and what answers there is a store
        assert probe.get("probe") == b"1"
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_port_taken_after_it_was_found_free_cannot_break_the_join(
    memory_name_resolve, trial, loopback, monkeypatch
):
    """The old race, forced: the port a free-port search hands out is taken by someone
    else before the store binds.  Binding port 0 never asks for such a port."""
    squatter = socket.socket()
    squatter.bind(("", 0))  # every interface, as the store would listen
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(network, "find_free_port", lambda *a, **k: taken)
    try:
        world = init_world(EXP, trial, GROUP, 0, 1, torch.device("cpu"), timeout=10)
        try:
            assert not world.address.endswith(f":{taken}")
            t = torch.ones(2)
            dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0]
        finally:
            dist.destroy_process_group()
    finally:
        squatter.close()


def _run_rank(args) -> None:
    name_resolve.reconfigure("file", root=args.nr_root)
    out = {}
    try:
        world = init_world(
            EXP, args.trial, GROUP, args.rank, args.world, torch.device("cpu"), timeout=30
        )
        t = torch.tensor([float(args.rank + 1)])
        dist.all_reduce(t)
        out = {"address": world.address, "sum": t.item(), "world": dist.get_world_size()}
    finally:
        with open(os.path.join(args.out_dir, f"rank{args.rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutdown.hard_exit(0)  # plain teardown could abort (see base/shutdown.py)


@pytest.mark.slow
def test_two_ranks_join_through_the_published_store(tmp_path, no_leftover_processes):
    world = 2
    env = dict(os.environ, REALHF_HOST_IP="127.0.0.1")
    args = ["--trial", "two-ranks", "--nr-root", str(tmp_path / "nr")]
    results = run_ranks(__file__, world, lambda r: args, str(tmp_path), env=env)
    assert [r["sum"] for r in results] == [3.0, 3.0], results
    assert results[0]["address"] == results[1]["address"]
    assert all(r["world"] == 2 for r in results)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    for a in ("--trial", "--nr-root", "--out-dir"):
        p.add_argument(a, required=True)
    for a in ("--rank", "--world"):
        p.add_argument(a, type=int, required=True)
    _run_rank(p.parse_args())
