"""The model workers' torch.distributed world, found through name resolution.

Worker 0 starts the rendezvous store (a ``TCPStore`` bound to port 0, so the kernel picks a
port that is already its own) and publishes ``host:port`` under
``names.distributed_master(exp, trial, group_name)`` (with a keepalive TTL, so the address
of a dead worker 0 vanishes instead of misleading a restarted run); the others wait for it
(bounded), connect to the store, then all join through it.  (Publishing a port found free
and binding it later would leave a window in which another process could take it.)  The
backend is gloo on CPU and nccl on CUDA devices, with a gloo side group for data transfers
between host buffers; every collective of the groups times out after ``timeout`` seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from realhf.base import logging, name_resolve, names
from realhf.base.distributed.dist_util import master_store
from realhf.base.net import network

logger = logging.getLogger("process_group", "system")

__all__ = ["WorldInfo", "init_world"]


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """The joined world: backend, address, and the group for data transfers."""

    backend: str
    address: str
    #: gloo group for host tensors (None: the default group is gloo already)
    data_group: Optional[Any]


def _bind_gloo_to(host: str) -> None:
    """Make gloo listen on the interface of ``host`` (by default it binds the address the
    host name resolves to, which may be a LAN address even for a single-machine run).  A
    ``$GLOO_SOCKET_IFNAME`` the user set wins."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    iface = network.interface_of(host)
    if iface is None:
        logger.warning(
            f"No network interface holds {host}; gloo binds where the host name resolves. "
            "Set $GLOO_SOCKET_IFNAME to the interface the cluster uses."
        )
        return
    os.environ["GLOO_SOCKET_IFNAME"] = iface


def init_world(
    experiment_name: str,
    trial_name: str,
    group_name: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: float,
    address_ttl: float = 6.0,
) -> WorldInfo:
    """Join the ``world_size``-rank world as ``rank``; see the module docstring.

    Raises:
        TimeoutError: worker 0 never published its address.
        RuntimeError: joining failed (a peer never came), naming the address and timeout.
    """
    who = f"{group_name}/{rank}"
    key = names.distributed_master(experiment_name, trial_name, group_name)
    on_gpu = device.type == "cuda"
    backend = "nccl" if on_gpu else "gloo"
    td = datetime.timedelta(seconds=timeout)
    store = None
    host = network.gethostip()
    _bind_gloo_to(host)
    if rank == 0:
        # Listening on this host's run address only, before its port is published.
        store = master_store(host, timeout, world_size)
        name_resolve.add(key, f"{host}:{store.port}", keepalive_ttl=address_ttl, replace=True)
    try:
        address = name_resolve.wait(key, timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(
            f"{who}: {group_name}/0 did not publish the process-group address (key {key!r}) "
            f"within {timeout:g}s"
        ) from e
    try:
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=td)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)
    except Exception as e:
        raise RuntimeError(
            f"{who}: joining the {world_size}-rank {backend} group at {address} failed within "
            f"{timeout:g}s: {e}; check that every {group_name} started"
        ) from e
    # nccl moves device tensors only; the data store holds host tensors, so data goes over
    # a gloo group.  new_group is collective: every rank creates it, in the same order.
    data_group = dist.new_group(backend="gloo", timeout=td) if on_gpu else None
    logger.info(f"{who} joined the {backend} group of {world_size} at {address}")
    return WorldInfo(backend, address, data_group)
