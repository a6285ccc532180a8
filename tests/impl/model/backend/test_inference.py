"""InferenceEngine: outputs come back in item order however the batch is cut."""

import pytest
import torch
from backend_testlib import batch, tiny_model

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.impl.model.backend import InferenceEngine, TrainEngine
from realhf.impl.model.utils.functional import gather_packed_shifted_log_probs


def _logprobs(logits, mb):
    ids = mb.data["packed_input_ids"]
    return gather_packed_shifted_log_probs(logits, mb.cu_seqlens("packed_input_ids"), ids)


def test_forward_restores_item_order_across_micro_batches():
    engine = InferenceEngine(tiny_model())
    b = batch()
    whole = engine.forward(b, MicroBatchSpec())
    cut = engine.forward(b, MicroBatchSpec(max_tokens_per_mb=13))
    assert len(b.split(MicroBatchSpec(max_tokens_per_mb=13))[0]) >= 4
    assert whole.shape == (sum(b.flat_seqlens("packed_input_ids")), 64)
    assert not whole.requires_grad
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-5)
    ids, cu = b.data["packed_input_ids"], b.cu_seqlens("packed_input_ids")
    torch.testing.assert_close(whole, engine.model(ids, cu).detach(), rtol=1e-5, atol=1e-5)


def test_post_hook_with_shifted_output_lengths_and_multi_sequence_items():
    # Items with 2 sequences each (an RL group), hook returning L-1 log-probs per sequence.
    g = torch.Generator().manual_seed(3)
    lens = [[4, 6], [3, 9], [5, 2]]
    ids = torch.randint(0, 64, (sum(map(sum, lens)),), generator=g)
    b = SequenceSample.from_default(
        ids=["a", "b", "c"], seqlens=lens, data={"packed_input_ids": ids}
    )
    out_lens = [[l - 1 for l in item] for item in lens]
    engine = TrainEngine(tiny_model())  # a train engine forwards too
    got = engine.forward(b, MicroBatchSpec(max_tokens_per_mb=12), _logprobs, out_lens)
    ref = _logprobs(engine.model(ids, b.cu_seqlens("packed_input_ids")), b).detach()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="output_seqlens"):
        engine.forward(b, MicroBatchSpec(), _logprobs)  # default lengths L do not match L-1


def test_missing_token_key_is_named():
    b = batch()
    b.remap_keys_({"packed_input_ids": "tokens"})
    with pytest.raises(KeyError, match="packed_input_ids"):
        InferenceEngine(tiny_model()).forward(
            b, MicroBatchSpec(), output_seqlens=b.seqlens["tokens"]
        )
