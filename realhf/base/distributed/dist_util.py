"""All-reducing a tensor on a device its process group's backend can reduce on.

NCCL reduces CUDA tensors only, while the counts, flags and statistics realhf reduces
are built on the CPU (and the same code runs with gloo on CPU-only machines).
:func:`all_reduce_` hides the difference: under nccl a CPU tensor travels to the
current CUDA device for the collective and the result is copied back into it; any
other backend reduces the tensor where it is.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from realhf.base.net import network

__all__ = ["reduce_device", "all_reduce_", "master_store"]


def reduce_device(backend: str, device: torch.device) -> torch.device:
    """The device on which a tensor that lives on ``device`` is reduced under ``backend``.

    ``nccl`` needs a CUDA device: the tensor's own if it is on one, else the current
    one (``torch.device("cuda")``, which ``Tensor.to`` resolves to
    ``torch.cuda.current_device()``).  Any other backend — gloo, or a per-device
    backend string such as ``"cpu:gloo,cuda:nccl"`` — takes the tensor where it is.
    """
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        return torch.device("cuda")
    return device


def all_reduce_(
    tensor: torch.Tensor,
    op=dist.ReduceOp.SUM,
    group=None,
    *,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (None: the default group); returns it.

    Every rank of ``group`` must call it.  The reduction runs on
    :func:`reduce_device` of the group's backend (``backend`` overrides the lookup,
    e.g. where the caller knows it already); when that is not the tensor's device, a
    copy is reduced there and the result written back, so ``tensor`` keeps its device.
    """
    if backend is None:
        backend = dist.get_backend(group)
    device = reduce_device(backend, tensor.device)
    on = tensor if device == tensor.device else tensor.to(device)
    dist.all_reduce(on, op=op, group=group)
    if on is not tensor:
        tensor.copy_(on)
    return tensor


def master_store(host: str, timeout: float, world_size: Optional[int] = None) -> dist.TCPStore:
    """A rendezvous ``TCPStore`` served by this process, listening on ``host`` only, at a port
    the kernel picked (``store.port``).

    TCPStore alone would listen on every interface.  Here the socket is bound and listening
    before anyone learns its port, so no other process can take the port in between; the
    store owns the socket from then on.  It does not wait for its clients."""
    listener = network.listening_socket(host)
    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
