"""Moving an idle model's weights to host memory and back, in place.

Every parameter of a :class:`~realhf.impl.model.nn.real_model.ReaLModel` is a view into its
one flat buffer, so offloading is one copy of that buffer into a (pinned) host tensor and
freeing the buffer's storage (``untyped_storage().resize_(0)``); the parameter objects, the
engine and every view stay valid and see the weights again after :meth:`Offloader.onload`
regrows the storage and copies them back.  On a CPU device the weights are on the host
already: :meth:`Offloader.offload` only records the state (``force=True`` moves anyway,
which the tests use to check the mechanism without a GPU).
"""

from __future__ import annotations

import torch

__all__ = ["Offloader", "free_storage", "regrow_storage"]


def free_storage(flat: torch.Tensor) -> None:
    """Release ``flat``'s memory; its views stay valid (and hold garbage after
    :func:`regrow_storage` until written)."""
    flat.detach().untyped_storage().resize_(0)


def regrow_storage(flat: torch.Tensor) -> None:
    """Give a buffer freed by :func:`free_storage` its memory back (contents undefined)."""
    flat = flat.detach()
    need = flat.numel() * flat.element_size()
    if flat.untyped_storage().nbytes() < need:
        flat.untyped_storage().resize_(need)


class Offloader:
    """Offload / onload one flat parameter buffer (see the module docstring).

    Args:
        flat: the model's flat parameter buffer (``model.flat_params``).
        force: move even when ``flat`` is on the CPU.
    """

    def __init__(self, flat: torch.Tensor, force: bool = False):
        self.flat = flat
        self.moves = force or flat.device.type != "cpu"
        self.host = None
        #: whether the weights are in host memory now
        self.offloaded = False

    def offload(self) -> int:
        """Copy the weights to host memory and free the device buffer; returns bytes moved."""
        if self.offloaded:
            return 0
        self.offloaded = True
        if not self.moves:
            return 0
        flat = self.flat.detach()
        if self.host is None:
            pin = flat.device.type == "cuda"
            self.host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=pin)
        self.host.copy_(flat)
        free_storage(flat)
        return self.host.numel() * self.host.element_size()

    def onload(self) -> int:
        """Bring the weights back into the (regrown) device buffer; returns bytes moved."""
        if not self.offloaded:
            return 0
        self.offloaded = False
        if not self.moves:
            return 0
        flat = self.flat.detach()
        regrow_storage(flat)
        flat.copy_(self.host)
        return flat.numel() * flat.element_size()
