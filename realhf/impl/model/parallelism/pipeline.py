"""Pipeline-parallel execution of micro-batches over the stages of a :class:`ParallelGrid`.

Each pipeline stage holds a contiguous slice of the model's layers; a micro-batch flows
through the stages in order, and only hidden states travel between neighbours (activations
forward, their gradients backward), over torch.distributed point-to-point ops in the
grid's ``pipe`` group.  Micro-batches are packed sequences whose token count differs from
one to the next, but every stage holds the same batch metadata, so every stage knows the
shape of each micro-batch's activation (``act_shape(i)``, e.g. ``[T_i, H]``) without a
shape handshake: receive buffers are allocated from it, and every sent tensor is checked
against it.

Inference (:func:`forward_only`) streams micro-batches through: receive, run the stage,
send on.  Training (:func:`train_1f1b`) runs the one-forward-one-backward schedule
(PipeDream-flush / Megatron-LM).  Stage ``s`` of ``p`` first runs ``w = min(p - s - 1, n)``
warm-up forwards, then alternates one forward with one backward, then runs the ``w``
remaining backwards (cool-down).  With ``p = 4`` stages, ``n = 6`` micro-batches and one
time slot per forward ``F`` or backward ``B`` (``.`` = idle, time runs right)::

    stage 0  F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2  . B3  . B4  . B5
    stage 1   . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3  . B4  . B5  .
    stage 2   .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4  . B5  .  .
    stage 3   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5  .  .  .

Stage 0 warms up with F0..F2, runs F3 B0 F4 B1 F5 B2 in the steady state and cools down
with B3..B5; the last stage has no warm-up.  Backwards run in micro-batch order on every
stage, so parameter gradients accumulate in the same order as in a one-process loop.

A stage keeps at most ``w + 1 <= p - s`` micro-batches in flight (their input activation
and output, with the autograd graph between them), so activation memory is O(pipeline
depth), not O(n); a micro-batch's tensors are dropped right after its backward.

Communication.  Every exchange is one :func:`torch.distributed.batch_isend_irecv` call whose
works are all waited on before the stage goes on.  In the steady state a stage pairs its
send of an activation with the receive of a gradient (``send_forward_recv_backward``) and
its send of a gradient with the receive of the next activation
(``send_backward_recv_forward``); the neighbour issues the mirror-image pair at the same
step, so each batch is matched by exactly one batch on the other side and no stage ever
waits for a peer that is itself waiting on it, even when sends are rendezvous (NCCL) rather
than eager (gloo, small messages).  Messages between two stages in one direction are
matched in issue order, which is micro-batch order on both sides.

Peers are given as **world** ranks (``grid.prev_stage`` / ``grid.next_stage``) together
with ``group=grid.groups["pipe"]``; torch translates them to group ranks.  Group ranks are
*not* pipeline indices in general: ``dist.new_group`` orders a group by world rank, and a
grid built over a permuted ``ranks`` list puts pipeline stage ``k`` anywhere in it.

Contract with callers: ``stage_fn(x, i)`` runs this stage on micro-batch ``i``.  ``x`` is
None on the first stage, else the received activation (a leaf with ``requires_grad=True``
in training).  A non-last stage returns the activation to send (shape ``act_shape(i)``,
dtype ``dtype``); the last stage returns whatever the caller collects or feeds to
``loss_fn``.  A stage that raises (or returns a wrongly shaped tensor, a ``ValueError``)
fails on its own rank; its peers then block in communication until the group's timeout.
"""

from __future__ import annotations

import collections
from typing import Callable, Deque, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from realhf.impl.model.parallelism.grid import ParallelGrid

__all__ = ["StageFn", "LossFn", "ActShapeFn", "forward_only", "train_1f1b"]

#: ``stage_fn(x, i) -> output``: run this stage on micro-batch ``i`` (see the module docstring).
StageFn = Callable[[Optional[torch.Tensor], int], torch.Tensor]
#: ``loss_fn(output, i) -> scalar``: the last stage's loss of micro-batch ``i``, backwarded as is.
LossFn = Callable[[torch.Tensor, int], torch.Tensor]
#: ``act_shape(i) -> shape``: the activation shape at every stage boundary for micro-batch ``i``.
ActShapeFn = Callable[[int], Sequence[int]]


def _check_n_micro(n_micro) -> None:
    if isinstance(n_micro, bool) or not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro must be an integer >= 1, got {n_micro!r}")


class _StageLink:
    """This stage's point-to-point channels to its pipeline neighbours.

    Every method blocks until its transfers are complete; a missing neighbour (the first
    stage has no previous one, the last no next one) turns its half into a no-op.
    """

    def __init__(
        self,
        grid: ParallelGrid,
        act_shape: ActShapeFn,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.group = grid.groups["pipe"]
        if self.group is None:
            raise ValueError(f"{grid} has {grid.pp_size} pipeline stages but no pipe group")
        self.prev = grid.prev_stage
        self.next = grid.next_stage
        self.pp_rank = grid.pp_rank
        self.act_shape = act_shape
        self.dtype = dtype
        self.device = torch.device(device)

    def shape(self, i: int) -> torch.Size:
        return torch.Size(self.act_shape(i))

    def _check(self, t: torch.Tensor, i: int, what: str) -> torch.Tensor:
        want = self.shape(i)
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"pipeline stage {self.pp_rank}: {what} of micro-batch {i} must be a tensor, "
                f"got {type(t).__name__}"
            )
        if t.shape != want or t.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage {self.pp_rank}: {what} of micro-batch {i} has shape "
                f"{tuple(t.shape)} and dtype {t.dtype}, but activations and gradients "
                f"between stages have act_shape({i}) = {tuple(want)} and dtype {self.dtype}"
            )
        return t.detach().to(self.device).contiguous()

    def _exchange(
        self,
        sends: List[Tuple[torch.Tensor, int]],
        recvs: List[Tuple[int, int]],
    ) -> List[torch.Tensor]:
        """Send ``(tensor, peer)`` pairs and receive ``(micro-batch, peer)`` activations or
        gradients (both have ``act_shape``) in one batch; wait for all of it."""
        ops = [dist.P2POp(dist.isend, t, peer=p, group=self.group) for t, p in sends]
        bufs = []
        for i, p in recvs:
            buf = torch.empty(self.shape(i), dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, peer=p, group=self.group))
            bufs.append(buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return bufs

    # Each helper returns what it received (None when there is nothing to receive).

    def recv_forward(self, i: int) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        return self._exchange([], [(i, self.prev)])[0]

    def send_forward(self, out: torch.Tensor, i: int) -> None:
        if self.next is not None:
            self._exchange([(self._check(out, i, "output"), self.next)], [])

    def recv_backward(self, i: int) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        return self._exchange([], [(i, self.next)])[0]

    def send_backward(self, grad: Optional[torch.Tensor], i: int) -> None:
        if self.prev is not None:
            self._exchange([(self._check(grad, i, "input gradient"), self.prev)], [])

    def send_forward_recv_backward(
        self, out: torch.Tensor, i_send: int, i_recv: int
    ) -> Optional[torch.Tensor]:
        if self.next is None:
            return None
        sent = self._check(out, i_send, "output")
        return self._exchange([(sent, self.next)], [(i_recv, self.next)])[0]

    def send_backward_recv_forward(
        self, grad: Optional[torch.Tensor], i_send: int, i_recv: int
    ) -> Optional[torch.Tensor]:
        if self.prev is None:
            return None
        sent = self._check(grad, i_send, "input gradient")
        return self._exchange([(sent, self.prev)], [(i_recv, self.prev)])[0]


def forward_only(
    stage_fn: StageFn,
    n_micro: int,
    grid: ParallelGrid,
    act_shape: ActShapeFn,
    dtype: torch.dtype,
    device: torch.device,
) -> Optional[List[torch.Tensor]]:
    """Run ``n_micro`` micro-batches through the pipeline without gradients.

    Every stage of the pipeline calls this with the same ``n_micro`` and ``act_shape``.

    Args:
        stage_fn: this stage's computation, ``stage_fn(x, i)`` (see the module docstring).
        n_micro: number of micro-batches (>= 1).
        grid: this rank's grid; its ``pipe`` group carries the activations.
        act_shape: ``act_shape(i)``, the activation shape between stages for micro-batch i.
        dtype: dtype of the activations between stages.
        device: where received activations are allocated (the backend's device).

    Returns:
        On the last stage, the outputs of ``stage_fn`` for micro-batches ``0..n_micro-1`` in
        order; None on the other stages.

    Raises:
        ValueError: ``n_micro < 1``, or a non-last stage returned a tensor whose shape or
            dtype differ from ``act_shape(i)`` / ``dtype``.
    """
    _check_n_micro(n_micro)
    with torch.no_grad():
        if grid.pp_size == 1:
            return [stage_fn(None, i) for i in range(n_micro)]
        link = _StageLink(grid, act_shape, dtype, device)
        outs: Optional[List[torch.Tensor]] = [] if grid.is_last_stage else None
        for i in range(n_micro):
            x = link.recv_forward(i)
            out = stage_fn(x, i)
            del x
            if outs is not None:
                outs.append(out)
            else:
                link.send_forward(out, i)
            del out
        return outs


def _scalar_loss(loss_fn: LossFn, out: torch.Tensor, i: int) -> torch.Tensor:
    loss = loss_fn(out, i)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {shape} for micro-batch {i}")
    return loss


def _backward(out: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """``out.backward(grad)``; a no-op when ``out`` does not depend on anything trainable
    (a frozen stage: every gradient it would produce is zero)."""
    if out.requires_grad:
        torch.autograd.backward(out, grad_tensors=grad)


def train_1f1b(
    stage_fn: StageFn,
    n_micro: int,
    grid: ParallelGrid,
    act_shape: ActShapeFn,
    dtype: torch.dtype,
    device: torch.device,
    loss_fn: LossFn,
) -> Optional[List[torch.Tensor]]:
    """Forward and backward ``n_micro`` micro-batches with the 1F1B schedule.

    Every stage of the pipeline calls this with the same ``n_micro`` and ``act_shape``.
    Gradients accumulate into the ``.grad`` of the parameters each stage uses (nothing is
    zeroed, reduced over data-parallel ranks or stepped here).  With one stage this is a
    plain loop: forward, loss, backward per micro-batch.

    Args:
        stage_fn: this stage's computation, ``stage_fn(x, i)`` (see the module docstring).
        n_micro: number of micro-batches (>= 1).
        grid: this rank's grid; its ``pipe`` group carries activations and gradients.
        act_shape: ``act_shape(i)``, the activation shape between stages for micro-batch
            i (also the shape of the gradient sent back).
        dtype: dtype of activations and gradients between stages.
        device: where received tensors are allocated (the backend's device).
        loss_fn: on the last stage, ``loss_fn(output, i)``: a scalar that is backwarded as
            is (scale it beforehand, e.g. by the micro-batch's share of the tokens).

    Returns:
        On the last stage, the detached losses of micro-batches ``0..n_micro-1``; None on
        the other stages.

    Raises:
        ValueError: ``n_micro < 1``, ``loss_fn`` did not return a scalar, or a non-last
            stage returned a tensor whose shape or dtype differ from ``act_shape(i)`` /
            ``dtype``.
    """
    _check_n_micro(n_micro)
    if grid.pp_size == 1:
        losses = []
        for i in range(n_micro):
            loss = _scalar_loss(loss_fn, stage_fn(None, i), i)
            _backward(loss, None)
            losses.append(loss.detach())
            del loss
        return losses

    link = _StageLink(grid, act_shape, dtype, device)
    last = grid.is_last_stage
    losses: Optional[List[torch.Tensor]] = [] if last else None
    # Micro-batches forwarded but not yet backwarded: (i, input activation, output or loss).
    inflight: Deque[Tuple[int, Optional[torch.Tensor], torch.Tensor]] = collections.deque()

    def forward(x: Optional[torch.Tensor], i: int) -> torch.Tensor:
        if x is not None:
            x.requires_grad_()
        out = stage_fn(x, i)
        if last:
            out = _scalar_loss(loss_fn, out, i)
            losses.append(out.detach())
        inflight.append((i, x, out))
        return out

    def backward(grad: Optional[torch.Tensor], i: int) -> Optional[torch.Tensor]:
        j, x, out = inflight.popleft()
        assert j == i, (j, i)  # backwards run in forward order
        _backward(out, grad)
        del out, grad
        if x is None:
            return None
        if x.grad is None:  # the output did not depend on the input
            return torch.zeros_like(x)
        return x.grad

    warmup = min(grid.pp_size - grid.pp_rank - 1, n_micro)
    steady = n_micro - warmup
    fwd_i = bwd_i = 0

    for _ in range(warmup):
        link.send_forward(forward(link.recv_forward(fwd_i), fwd_i), fwd_i)
        fwd_i += 1
    x = link.recv_forward(fwd_i) if steady > 0 else None
    for k in range(steady):
        out = forward(x, fwd_i)
        grad = link.send_forward_recv_backward(out, fwd_i, bwd_i)
        fwd_i += 1
        out = x = None  # kept in ``inflight`` until their backward
        dx = backward(grad, bwd_i)
        grad = None
        if k < steady - 1:
            x = link.send_backward_recv_forward(dx, bwd_i, fwd_i)
        else:
            link.send_backward(dx, bwd_i)
        dx = None
        bwd_i += 1
    for _ in range(warmup):
        grad = link.recv_backward(bwd_i)
        dx = backward(grad, bwd_i)
        del grad
        link.send_backward(dx, bwd_i)
        del dx
        bwd_i += 1
    assert fwd_i == bwd_i == n_micro and not inflight
    return losses
