"""A prompt shared by a group of sequences is computed once, with the same outputs and
gradients as the full pack."""

from __future__ import annotations

import pytest
import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.impl.model.backend import TrainEngine
from realhf.impl.model.modules.shared_prefix import SharedPrefix, prompt_lengths

from .backend.backend_testlib import VOCAB, lm_loss, lm_weight, optimizer_config, tiny_model


def _groups(spec, seed=0):
    """Sequences from ``spec``: per group (prompt length, [answer lengths])."""
    g = torch.Generator().manual_seed(seed)
    seqs, plens = [], []
    for plen, answers in spec:
        prompt = torch.randint(0, VOCAB, (plen,), generator=g).tolist()
        for n in answers:
            seqs.append(prompt + torch.randint(0, VOCAB, (n,), generator=g).tolist())
            plens.append(plen)
    return seqs, plens


def _pack(seqs):
    ids = torch.tensor(sum(seqs, []))
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return ids, cu


# Groups of several answers (one of them empty), a lone prompt, and a prompt-less sequence.
SPEC = [(5, [3, 7, 0, 4]), (2, [6]), (9, [1, 2, 8]), (0, [5]), (5, [2])]


def test_layout_keeps_each_prompt_once_and_expands_back():
    seqs, plens = _groups(SPEC)
    ids, cu = _pack(seqs)
    sp = SharedPrefix.from_prompts(ids, cu.tolist(), plens)
    # Saved: the prompts of the followers (3 + 2 of the two multi-answer groups).
    assert len(sp.keep) == len(ids) - 3 * 5 - 2 * 9
    assert torch.equal(ids[sp.keep][sp.expand], ids)  # every row stands for an equal row
    full_pos = torch.cat([torch.arange(len(s)) for s in seqs])
    assert torch.equal(sp.position_ids[sp.expand], full_pos)
    assert SharedPrefix.from_prompts(ids, cu.tolist(), [0] * len(seqs)) is None


def test_prompt_lengths_count_the_leading_run_only():
    mask = torch.tensor([1, 1, 0, 1, 0] + [0, 0] + [1, 1, 1], dtype=torch.bool)
    assert prompt_lengths(mask, [0, 5, 7, 10]) == [2, 0, 3]


def test_outputs_and_gradients_equal_the_full_pack():
    model = tiny_model()
    seqs, plens = _groups(SPEC, seed=3)
    ids, cu = _pack(seqs)
    sp = SharedPrefix.from_prompts(ids, cu.tolist(), plens)
    w = torch.randn(len(ids), VOCAB, generator=torch.Generator().manual_seed(4))
    results = []
    for shared in (None, sp):
        model.zero_grad()
        out = model(ids, cu, shared_prefix=shared)
        (out * w).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((out.detach(), grads))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(ga, gb, atol=1e-4 * ga.abs().max().item())
    rows = torch.tensor([len(ids) - 1, 0, 7, 7])  # the head at some rows only
    with torch.no_grad():
        some = model(ids, cu, shared_prefix=sp, output_rows=rows)
    assert torch.allclose(some, a[rows], atol=1e-5)


def test_shared_prefix_is_refused_where_it_cannot_hold():
    model = tiny_model()
    seqs, plens = _groups(SPEC)
    ids, cu = _pack(seqs)
    sp = SharedPrefix.from_prompts(ids, cu.tolist(), plens)
    with pytest.raises(ValueError, match="positions and attention"):
        model(ids, cu, shared_prefix=sp, position_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="sliding window"):
        tiny_model(sliding_window=4)(ids, cu, shared_prefix=sp)


def test_train_engine_step_is_the_same_with_and_without_sharing():
    seqs, plens = _groups([(6, [4, 5, 3]), (3, [7, 2])], seed=5)
    ids, _ = _pack(seqs)
    mask = torch.cat([torch.arange(len(s)) < p for s, p in zip(seqs, plens)])
    sample = SequenceSample.from_default(
        ids=[f"q{i}" for i in range(len(seqs))],
        seqlens=[len(s) for s in seqs],
        data={"packed_input_ids": ids, "prompt_mask": mask},
    )
    flats, grads, losses = [], [], []
    for share in (False, True):
        engine = TrainEngine(tiny_model(), optimizer_config())
        engine.share_prompts = share
        st = engine.train_batch(sample, MicroBatchSpec(), lm_loss, lm_weight)
        flats.append(engine.model.flat_params.detach().clone())
        grads.append(engine.flat_grad.clone())
        losses.append(st["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-5 * grads[0].abs().max().item())
    # One AdamW step at lr 1e-2 moves a weight by up to ~1e-2: the two runs agree far closer.
    assert torch.allclose(flats[0], flats[1], atol=2e-5)
