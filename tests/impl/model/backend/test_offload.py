"""Offloading a model's flat buffer to host memory and back, in place (realhf.impl.model.
backend.offload).  On CPU the real move only happens with ``force=True``: that is how these
tests check the mechanism without a GPU."""

import torch

from realhf.impl.model.backend.offload import Offloader, free_storage, regrow_storage
from realhf.impl.model.nn.real_model import ReaLModel


def _logits(model, packed_batch):
    ids, cu, _ = packed_batch
    with torch.no_grad():
        return model(ids, cu).clone()


def test_offload_frees_the_buffer_and_onload_restores_the_same_model(tiny_hf_dir, packed_batch):
    model = ReaLModel.from_hf(tiny_hf_dir("qwen2"))
    before = _logits(model, packed_batch)
    params = dict(model.named_parameters())
    nbytes = model.flat_params.numel() * model.flat_params.element_size()
    off = Offloader(model.flat_params, force=True)
    assert off.offload() == nbytes and off.offloaded
    assert model.flat_params.untyped_storage().nbytes() == 0  # the memory is gone
    assert off.offload() == 0  # twice is once
    assert off.onload() == nbytes and not off.offloaded
    # Same parameter objects (an optimizer or engine holding them keeps working), same
    # weights, same outputs.
    assert all(p is params[n] for n, p in model.named_parameters())
    torch.testing.assert_close(_logits(model, packed_batch), before, rtol=0, atol=0)
    assert off.onload() == 0


def test_offload_on_cpu_without_force_only_records_the_state(tiny_hf_dir):
    model = ReaLModel.from_hf(tiny_hf_dir("qwen2"))
    ptr = model.flat_params.data_ptr()
    off = Offloader(model.flat_params)
    assert off.offload() == 0 and off.offloaded
    assert off.onload() == 0 and not off.offloaded
    assert model.flat_params.data_ptr() == ptr


def test_free_and_regrow_keep_views_bound():
    flat = torch.arange(12.0)
    view = flat[4:8].view(2, 2)
    free_storage(flat)
    assert flat.untyped_storage().nbytes() == 0
    regrow_storage(flat)
    flat.copy_(torch.arange(12.0) * 2)
    assert view.tolist() == [[8.0, 10.0], [12.0, 14.0]]
    regrow_storage(flat)  # already grown: untouched
    assert view.tolist() == [[8.0, 10.0], [12.0, 14.0]]
