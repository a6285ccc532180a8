"""Model API: generation settings, run length, step info, model handle, interface base class."""

import dataclasses

import pytest
import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.dfg import ModelName
from realhf.api.core.gen_api import SamplingParams
from realhf.api.core.model_api import (
    FinetuneSpec,
    GenerationHyperparameters,
    GroupSizeError,
    Model,
    ModelInterface,
    RolloutContext,
    StepInfo,
)
from realhf.api.core.registry import InterfaceAbstraction, make_interface, register_interface


def test_generation_defaults_and_greedy():
    g = GenerationHyperparameters()
    assert (g.n, g.max_new_tokens, g.top_p, g.top_k, g.temperature) == (
        1,
        16384,
        1.0,
        int(1e8),
        1.0,
    )
    assert not g.is_greedy
    assert (
        g.new(temperature=0.0).is_greedy
        and g.new(greedy=True).is_greedy
        and g.new(top_k=1).is_greedy
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n=0), r"\.n=0"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (
            dict(min_new_tokens=5, max_new_tokens=4),
            r"min_new_tokens=5: use an integer in \[0, max_new_tokens=4\]",
        ),
        (dict(top_p=0.0), r"top_p=0.0: use a number in \(0, 1\]"),
        (dict(top_k=0), "top_k=0"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(greedy="yes"), "greedy='yes'"),
    ],
)
def test_generation_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationHyperparameters(**kwargs)


def test_generation_to_sampling_params():
    sp = GenerationHyperparameters(
        n=4, max_new_tokens=16, temperature=0.7, stop_token_ids=[3]
    ).to_sampling_params()
    assert sp == SamplingParams(
        n=4, max_new_tokens=16, temperature=0.7, top_p=1.0, top_k=-1, stop_token_ids=(3,)
    )
    assert GenerationHyperparameters(greedy=True).to_sampling_params().greedy
    assert GenerationHyperparameters(top_k=300).to_sampling_params(vocab_size=268).top_k == -1
    assert GenerationHyperparameters(top_k=20).to_sampling_params(vocab_size=268).top_k == 20


def test_finetune_spec_steps():
    assert FinetuneSpec(2, 10, 4).steps_per_epoch == 3
    assert FinetuneSpec(2, 10, 4).total_train_steps == 6
    assert FinetuneSpec(3, 8, 4).total_train_steps == 6
    with pytest.raises(
        ValueError, match="FinetuneSpec.train_batch_size must be an integer >= 1, got 0"
    ):
        FinetuneSpec(1, 10, 0)


def test_step_info_next():
    s = StepInfo().next().next()
    assert s == StepInfo(0, 2, 2)
    assert s.next(epoch_done=True) == StepInfo(1, 0, 3)
    with pytest.raises(ValueError, match="StepInfo.epoch"):
        StepInfo(epoch=-1)


def test_model_handle():
    m = Model("actor", torch.nn.Linear(2, 2).to(torch.float64), tokenizer=None, device="cpu")
    assert m.name == ModelName("actor", 0) and m.dtype == torch.float64
    m.inc_version()
    m.inc_version(epoch_done=True)
    assert m.version == StepInfo(1, 0, 2)
    with pytest.raises(TypeError, match="Model.name"):
        Model(3, None, None, "cpu")


class CountTokens(ModelInterface):
    """A real (tiny) algorithm: counts tokens per micro-batch."""

    def __init__(self, key: str = "packed_input_ids"):
        self.key = key

    def train_step(self, model, data, mb_spec):
        mbs, _, _ = data.split(mb_spec)
        return [{"n_tokens": int(mb.data[self.key].numel())} for mb in mbs]


def test_interface_subclass_registered_and_called():
    register_interface("tests.count_tokens", CountTokens)
    iface = make_interface(InterfaceAbstraction("tests.count_tokens", {"key": "packed_input_ids"}))
    data = SequenceSample.from_default(
        ids=["a", "b", "c"], seqlens=[3, 5, 2], data={"packed_input_ids": torch.arange(10)}
    )
    model = Model("actor", torch.nn.Linear(1, 1), None, "cpu")
    stats = iface.train_step(model, data, MicroBatchSpec(n_mbs=2))
    assert sorted(s["n_tokens"] for s in stats) == [5, 5]
    with pytest.raises(
        NotImplementedError, match=r"interface CountTokens does not implement generate\(\)"
    ):
        iface.generate(model, data, MicroBatchSpec())
    for method in ("inference", "evaluate"):
        with pytest.raises(NotImplementedError, match=method):
            getattr(ModelInterface(), method)(model, data, MicroBatchSpec())
    with pytest.raises(NotImplementedError, match="save"):
        ModelInterface().save(model, "/tmp/x")


def test_rollout_context_is_validated_and_frozen():
    with pytest.raises(ValueError, match="RolloutContext.group_size=0"):
        RolloutContext(group_size=0, temperature=1.0)
    with pytest.raises(ValueError, match=r"RolloutContext.temperature=0.0: .*1.0 for greedy"):
        RolloutContext(group_size=2, temperature=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        RolloutContext(2, 1.0).group_size = 3


def test_rollout_context_refuses_items_with_another_answer_count():
    ctx = RolloutContext(group_size=2, temperature=0.7)

    def sample(seqlens):
        n = sum(map(sum, seqlens))
        ids = [f"q{i}" for i in range(len(seqlens))]
        return SequenceSample.from_default(
            ids=ids, seqlens=seqlens, data={"packed_input_ids": torch.arange(n)}
        )

    ctx.check_groups(sample([[3, 2], [4, 1]]), "my_algo")
    with pytest.raises(
        GroupSizeError,
        match=r"my_algo expects group_size=2 answers per prompt, but item 'q1' holds 3 "
        r"sequences \(2 of 3 items differ\)",
    ):
        ctx.check_groups(sample([[3, 2], [4, 1, 2], [5]]), "my_algo")


def test_rollout_context_require_names_both_values_and_the_fix():
    ctx = RolloutContext(group_size=4, temperature=0.7)
    ctx.require("my_algo", "fix", group_size=4, temperature=0.7)
    with pytest.raises(
        ValueError, match=r"my_algo assumes group_size=2, but this run's group_size is 4; fix"
    ):
        ctx.require("my_algo", "fix", group_size=2)
    with pytest.raises(ValueError, match=r"assumes temperature=1.0, but this run's .* 0.7"):
        ctx.require("my_algo", "fix", temperature=1.0)
