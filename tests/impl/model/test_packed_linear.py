"""Pre-packed linear weights (oneDNN on CPU, bf16 and fp32): the plain products' logits,
never used once the weights they were packed from change."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_hf_model

from realhf.impl.kernels import simd_cpu
from realhf.impl.model.nn.packed_linear import PackedLinear, WeightPacker, packing_supported
from realhf.impl.model.nn.real_model import ReaLModel

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")),
    reason="this CPU's oneDNN has no bf16 kernels to pack for",
)

IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
CU = torch.tensor([0, 4, 11], dtype=torch.int32)


@pytest.fixture(scope="module", params=["qwen2", "gpt2", "llama"])
def model_dir(request, tmp_path_factory):
    # qwen2: tied head, q/k/v biases; gpt2: an ungated MLP with biases; llama: own head.
    extra = {"tie_word_embeddings": True} if request.param == "qwen2" else {}
    return make_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param), **extra)


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS, CU).float()


@pytest.fixture
def calls(monkeypatch):
    """How many packed products ran."""
    n = [0]
    real = PackedLinear.__call__

    def counted(self, x):
        n[0] += 1
        return real(self, x)

    monkeypatch.setattr(PackedLinear, "__call__", counted)
    return n


def test_packed_products_give_the_plain_logits(model_dir, calls):
    model = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16).eval()
    plain = _logits(model)
    packer = WeightPacker(model, batch_hint=16)
    while not packer.done:
        packer.pack()
    assert len(packer.jobs) == 1 + 4 * len(model.blocks)  # head, then 4 per block
    assert calls[0] == 0
    packed = _logits(model)
    assert calls[0] == len(packer.jobs)  # every product of the forward was a packed one
    # Same kernels' arithmetic in bf16 up to the order of accumulation.
    torch.testing.assert_close(packed, plain, atol=2e-2, rtol=2e-2)


def test_a_pack_is_not_used_once_its_weights_change(model_dir, calls):
    model = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16).eval()
    packer = WeightPacker(model, batch_hint=16)
    while not packer.done:
        packer.pack()
    # In place (a weight update through the flat buffer): every pack is stale.
    with torch.no_grad():
        model.flat_params.mul_(0.5)
    unpacked = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        unpacked.flat_params.copy_(model.flat_params)
    torch.testing.assert_close(_logits(model), _logits(unpacked), atol=0, rtol=0)
    assert calls[0] == 0
    # A new buffer (use_flat, as shm serving does): the packs still hold the old one.
    packer.reset()
    while not packer.done:
        packer.pack()
    new = model.flat_params.clone()
    with torch.no_grad():
        new.mul_(2.0)
        unpacked.flat_params.copy_(new)
    model.use_flat(new)
    torch.testing.assert_close(_logits(model), _logits(unpacked), atol=0, rtol=0)
    assert calls[0] == 0


def test_packing_goes_a_few_products_at_a_time_and_reset_drops_them(model_dir):
    model = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16).eval()
    packer = WeightPacker(model, batch_hint=16)
    packer.pack()  # budget 0: one product
    assert packer.next == 1 and not packer.done
    half = _logits(model)  # some products packed, the rest plain
    torch.testing.assert_close(half, _logits(ReaLModel.from_hf(model_dir, dtype=torch.bfloat16)))
    packer.reset()
    assert packer.next == 0
    assert all(attr not in owner.__dict__ for owner, attr, _ in packer.jobs)


def test_training_never_uses_a_pack(model_dir, calls):
    model = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16)
    packer = WeightPacker(model, batch_hint=16)
    while not packer.done:
        packer.pack()
    model(IDS, CU).float().sum().backward()  # gradients on: the plain products
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert calls[0] == 0


def test_fp32_packs_too_and_gives_the_plain_logits_to_fp32_rounding(model_dir, calls):
    model = ReaLModel.from_hf(model_dir).eval()
    plain = _logits(model)
    packer = WeightPacker(model, batch_hint=16)
    while not packer.done:
        packer.pack()
    packed = _logits(model)
    assert calls[0] == len(packer.jobs)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_only_the_cpu_packs():
    assert packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("cuda"))
    assert not packing_supported(torch.float16, torch.device("cpu"))


def test_side_by_side_weights_are_packed_without_a_joined_copy(model_dir, monkeypatch):
    """q, k, v (and gate, up) lie one after another in a ReaLModel's flat buffer: the pack
    reads them there, never joining them with ``torch.cat``; matrices apart are joined."""
    from realhf.impl.model.nn.packed_linear import _rows_in_place

    model = ReaLModel.from_hf(model_dir, dtype=torch.bfloat16).eval()
    ca = model.blocks[0].attn.c_attn
    qkv = [ca.q_attn.weight, ca.k_attn.weight, ca.v_attn.weight]
    view = _rows_in_place(qkv)
    assert view is not None and view.data_ptr() == qkv[0].data_ptr()
    assert torch.equal(view, torch.cat(qkv))
    apart = [t.clone() for t in qkv]
    assert _rows_in_place(apart) is None
    assert _rows_in_place([qkv[0], qkv[2]]) is None  # (same buffer, not adjacent)

    def no_cat(*a, **k):
        raise AssertionError("torch.cat called while packing side-by-side weights")

    plain = _logits(model)
    monkeypatch.setattr(torch, "cat", no_cat)
    packer = WeightPacker(model, batch_hint=16)
    if all(getattr(b.attn.c_attn.q_attn, "bias", None) is None for b in model.blocks):
        while not packer.done:
            packer.pack()
    monkeypatch.undo()
    while not packer.done:  # (biases of q, k and v are joined by cat)
        packer.pack()
    torch.testing.assert_close(_logits(model), plain, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(simd_cpu() is None, reason="realhf's decode kernel needs AVX2 or AVX-512")
def test_fp32_packs_take_the_decode_kernel_for_few_rows_and_the_plain_weights_for_many(
    model_dir, monkeypatch
):
    """fp32 packs are realhf's block layout: a decode step's rows run the kernel, a
    prefill's many run F.linear on the model's weights (joined in place, or one product
    per matrix where they lie apart); both give the plain logits to fp32 rounding."""
    from realhf.impl.model.nn import packed_linear

    model = ReaLModel.from_hf(model_dir).eval()
    few = (IDS, CU)
    n = packed_linear.DECODE_KERNEL_ROWS + 9
    many = (torch.arange(n) % 7, torch.tensor([0, 30, n], dtype=torch.int32))
    plain = {k: _run(model, *v) for k, v in (("few", few), ("many", many))}
    kernel = [0]
    real = simd_cpu().decode_linear

    class Counted:
        def __getattr__(self, name):
            return getattr(simd_cpu(), name)

        def decode_linear(self, *a):
            kernel[0] += 1
            return real(*a)

    monkeypatch.setattr(packed_linear, "simd_cpu", lambda: Counted())
    for apart in (False, True):
        if apart:  # packs made as if no matrices lay side by side
            monkeypatch.setattr(
                packed_linear, "_rows_in_place", lambda ws: None if len(ws) > 1 else ws[0]
            )
        packer = WeightPacker(model, batch_hint=16)
        while not packer.done:
            packer.pack()
        assert not any(o.__dict__[a].weight.is_mkldnn for o, a, _ in packer.jobs)
        kernel[0] = 0
        torch.testing.assert_close(_run(model, *few), plain["few"], atol=1e-5, rtol=1e-5)
        assert kernel[0] == len(packer.jobs)
        torch.testing.assert_close(_run(model, *many), plain["many"], atol=1e-5, rtol=1e-5)
        assert kernel[0] == len(packer.jobs)  # (none of the many rows' products)
        packer.reset()
    # an engine running many sequences at once packs for oneDNN (faster at many rows)
    packer = WeightPacker(model, batch_hint=packed_linear.DECODE_KERNEL_BATCH + 1)
    while not packer.done:
        packer.pack()
    assert all(o.__dict__[a].weight.is_mkldnn for o, a, _ in packer.jobs)
    kernel[0] = 0
    torch.testing.assert_close(_run(model, *few), plain["few"], atol=1e-5, rtol=1e-5)
    assert kernel[0] == 0


def _run(model, ids, cu):
    with torch.inference_mode():
        return model(ids, cu).float()
