"""The actor's generate: the built-in engine over the live weights, packed for PPO."""

import pytest
import torch

from realhf.api.core.data_api import MicroBatchSpec
from realhf.impl.model.interface import PPOActorInterface
from realhf.impl.model.interface.offline_generation import generate_offline
from realhf.impl.model.utils.functional import shift_one_indices

GEN = {"max_new_tokens": 6, "temperature": 1.0}


def test_generate_packs_group_size_answers_per_prompt(make_model, prompts):
    model = make_model()
    model.version = model.version.next().next()  # version 2
    actor = PPOActorInterface(group_size=3, gen=GEN)
    out = actor.generate(model, prompts, MicroBatchSpec())
    assert out.ids == prompts.ids
    assert out.keys == {
        "packed_input_ids",
        "prompt_mask",
        "packed_logprobs",
        "seq_no_eos_mask",
        "version_start",
        "version_end",
    }
    assert out.metadata["solutions"] == prompts.metadata["solutions"]
    ids, pmask, logp = (out.data[k] for k in ("packed_input_ids", "prompt_mask", "packed_logprobs"))
    start = 0
    for item, plen in enumerate(prompts.flat_seqlens("packed_prompts")):
        prompt = prompts.data["packed_prompts"][
            sum(prompts.flat_seqlens("packed_prompts")[:item]) :
        ][:plen]
        assert len(out.seqlens["packed_input_ids"][item]) == 3
        for L in out.seqlens["packed_input_ids"][item]:
            assert plen < L <= plen + 6
            assert torch.equal(ids[start : start + plen], prompt)
            assert pmask[start : start + L].tolist() == [True] * plen + [False] * (L - plen)
            start += L
    assert out.data["version_start"].tolist() == [2] * 12 == out.data["version_end"].tolist()
    # Behaviour log-probs: zero where the predicted token is a prompt token, negative elsewhere.
    predicted_is_prompt = pmask[shift_one_indices(out.cu_seqlens("packed_input_ids")) + 1]
    assert (logp[predicted_is_prompt] == 0).all() and (logp[~predicted_is_prompt] < 0).all()
    # A sequence without EOS ran to the length limit.
    lens = torch.tensor(out.flat_seqlens("packed_input_ids"))
    plens = torch.tensor(prompts.flat_seqlens("packed_prompts")).repeat_interleave(3)
    stops = torch.tensor([model.tokenizer.eos_token_id, model.tokenizer.pad_token_id])
    last = ids[out.cu_seqlens("packed_input_ids")[1:].long() - 1]
    no_eos = out.data["seq_no_eos_mask"]
    assert torch.equal(no_eos, ~torch.isin(last, stops))
    assert ((lens - plens)[no_eos] == 6).all()


def test_behaviour_logprobs_match_the_trainer_recompute(make_model, prompts):
    model = make_model()
    actor = PPOActorInterface(group_size=2, gen={"max_new_tokens": 5, "temperature": 0.8})
    out = actor.generate(model, prompts, MicroBatchSpec())
    recomputed = actor.inference(model, out, MicroBatchSpec(max_tokens_per_mb=40))
    assert recomputed.keys == {"logprobs"}
    assert recomputed.seqlens["logprobs"] == out.seqlens["packed_logprobs"]
    answer = out.data["packed_logprobs"] != 0
    torch.testing.assert_close(
        recomputed.data["logprobs"][answer],
        out.data["packed_logprobs"][answer],
        rtol=1e-4,
        atol=1e-4,
    )


def test_sampling_is_reproducible_per_version_and_prompt(make_model, prompts):
    model = make_model()
    actor = PPOActorInterface(group_size=2, gen=GEN)
    a = actor.generate(model, prompts, MicroBatchSpec())
    b = actor.generate(model, prompts.select_items([2, 3]), MicroBatchSpec())  # another split
    assert torch.equal(a.select_items([2, 3]).data["packed_input_ids"], b.data["packed_input_ids"])
    model.inc_version()
    c = actor.generate(model, prompts, MicroBatchSpec())
    assert not torch.equal(a.data["packed_input_ids"], c.data["packed_input_ids"])


def test_generation_uses_the_live_weights(make_model, prompts):
    model = make_model()
    net = model.module.model
    greedy = {"max_new_tokens": 4, "greedy": True}
    before = generate_offline(
        net, prompts, PPOActorInterface(gen=greedy).hp.generation, model.tokenizer
    )
    with torch.no_grad():
        net.flat_params.mul_(-1.0)
    after = generate_offline(
        net, prompts, PPOActorInterface(gen=greedy).hp.generation, model.tokenizer
    )
    assert not torch.equal(before.data["packed_input_ids"], after.data["packed_input_ids"])


def test_too_long_prompt_is_rejected(make_model, prompts):
    model = make_model()
    long = prompts.select_items([0])
    long.data["packed_prompts"] = torch.zeros(300, dtype=torch.long)
    long.seqlens["packed_prompts"] = [[300]]
    with pytest.raises(ValueError, match="context"):
        PPOActorInterface(gen=GEN).generate(model, long, MicroBatchSpec())
