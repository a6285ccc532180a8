"""Packed token helpers: shifted indices, next-token log-probs, masked normalisation, SFT loss."""

import math

import pytest
import torch

from realhf.impl.model.utils.functional import (
    gather_packed_shifted_log_probs,
    masked_mean,
    masked_normalization,
    sft_loss,
    shift_one_indices,
    short1cu_seqlens,
)


def test_shift_one_indices_and_short1cu():
    cu = torch.tensor([0, 3, 4, 6])  # lengths 3, 1, 2
    assert shift_one_indices(cu).tolist() == [0, 1, 4]
    assert short1cu_seqlens(cu).tolist() == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="length 0"):
        shift_one_indices(torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="starting at 0"):
        shift_one_indices(torch.tensor([1, 2]))


def test_log_probs_hand_computed():
    # one sequence of 2 tokens [0, 1], vocab 2; position 0 predicts token 1
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, -5.0]])
    ids = torch.tensor([0, 1])
    cu = torch.tensor([0, 2])
    out = gather_packed_shifted_log_probs(logits, cu, ids)
    assert out.shape == (1,) and out.item() == pytest.approx(math.log(0.75))
    t = 2.0  # logits / 2 -> [0, ln3/2]: p(1) = sqrt3 / (1 + sqrt3)
    out = gather_packed_shifted_log_probs(logits, cu, ids, temperature=t)
    assert out.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_log_probs_match_a_per_sequence_loop():
    g = torch.Generator().manual_seed(0)
    lens = [4, 1, 6, 2]
    T, V = sum(lens), 11
    logits = torch.randn(T, V, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    expect = []
    for i in range(len(lens)):
        s, e = int(cu[i]), int(cu[i + 1])
        lp = torch.log_softmax(logits[s:e] / 0.7, -1)
        expect += [lp[t, ids[s + t + 1]] for t in range(e - s - 1)]
    out = gather_packed_shifted_log_probs(logits.to(torch.bfloat16).float(), cu, ids, 0.7)
    ref = gather_packed_shifted_log_probs(logits, cu, ids, 0.7)
    assert torch.allclose(ref, torch.stack(expect), atol=1e-6) and out.shape == (T - len(lens),)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        gather_packed_shifted_log_probs(logits, cu, ids, 0.0)
    with pytest.raises(ValueError, match="ends at 13 but the packed tensor has 12"):
        gather_packed_shifted_log_probs(logits[:12], cu, ids[:12])


def test_masked_normalization_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([True, True, True, False])
    std = math.sqrt(2.0 / 3.0)
    out = masked_normalization(x, mask)
    assert out.tolist() == pytest.approx([-1 / (std + 1e-5), 0.0, 1 / (std + 1e-5), 0.0])
    assert out.dtype == torch.float32
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    assert masked_mean(x, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def test_sft_loss_counts_only_answer_tokens():
    V = 5
    # seq 1: prompt 2 tokens + answer 2; seq 2: prompt 1 + answer 1
    ids = torch.tensor([1, 2, 3, 4, 0, 4])
    prompt_mask = torch.tensor([True, True, False, False, True, False])
    cu = torch.tensor([0, 4, 6])
    loss, n = sft_loss(torch.zeros(6, V), ids, cu, prompt_mask)
    assert n.item() == 3 and loss.item() == pytest.approx(math.log(V))
    # make the answer tokens certain; prompt predictions stay uniform and must not count
    logits = torch.zeros(6, V)
    logits[1, 3] = logits[2, 4] = logits[4, 4] = 50.0
    loss, n = sft_loss(logits, ids, cu, prompt_mask)
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and n.item() == 3
    loss, n = sft_loss(torch.zeros(6, V), ids, cu, torch.ones(6, dtype=torch.bool))
    assert loss.item() == 0.0 and n.item() == 0
