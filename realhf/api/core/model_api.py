"""What an algorithm sees: the model handle, training progress, generation settings, and
the :class:`ModelInterface` base class that algorithms subclass.

A new algorithm is a ``ModelInterface`` subclass registered by name::

    from realhf.api.core.registry import register_interface
    from realhf.api.core.model_api import ModelInterface

    class MyInterface(ModelInterface):
        def __init__(self, beta: float = 0.1):
            self.beta = beta

        def train_step(self, model, data, mb_spec):
            ...  # compute a loss over `data` (a SequenceSample), step the optimizer
            return {"loss": ...}

    register_interface("my_algo", MyInterface)

and an experiment refers to it as ``InterfaceAbstraction("my_algo", {"beta": 0.2})`` in an
MFC (see :mod:`realhf.api.core.dfg`).  Model workers call the method named by the MFC's
interface type with the model, the MFC's input data and its micro-batch spec.  A constructor
that declares a ``rollout`` parameter receives the run's :class:`RolloutContext` (group size
and temperature) from the experiment instead of repeating them in its own options.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from realhf.api.core.dfg import ModelName
from realhf.base.config_checks import Checks, is_int, is_num

if TYPE_CHECKING:  # imported for annotations only
    import torch

    from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
    from realhf.api.core.gen_api import SamplingParams

__all__ = [
    "GenerationHyperparameters",
    "FinetuneSpec",
    "StepInfo",
    "Model",
    "RolloutContext",
    "GroupSizeError",
    "ModelInterface",
]


@dataclasses.dataclass
class GenerationHyperparameters:
    """Sampling settings of a generate call (one prompt yields ``n`` answers).

    Attributes:
        n: answers per prompt (the RL group size).
        max_new_tokens: most tokens generated per answer.
        min_new_tokens: stop tokens are masked until this many tokens exist.
        greedy: take the argmax token; ``temperature == 0`` means greedy too.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (>= 1; a huge value keeps all).
        temperature: softmax temperature (>= 0).  The trainer divides logits by the same
            temperature when it recomputes logprobs, so it must match generation.
        stop_token_ids: token ids that end an answer besides EOS/pad.
    """

    n: int = 1
    max_new_tokens: int = 16384
    min_new_tokens: int = 0
    greedy: bool = False
    top_p: float = 1.0
    # Larger than any vocabulary, i.e. "keep all"; to_sampling_params() turns
    # it into SGLang's -1.
    top_k: int = int(1e8)
    temperature: float = 1.0
    stop_token_ids: List[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        ck = Checks("GenerationHyperparameters")
        if not is_int(self.n) or self.n < 1:
            raise ck.bad("n", self.n, "use an integer >= 1 (answers per prompt)")
        ck.integer(self, "max_new_tokens", 1)
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ck.bad(
                "min_new_tokens",
                self.min_new_tokens,
                f"use an integer in [0, max_new_tokens={self.max_new_tokens}]",
            )
        ck.bools(self, "greedy")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ck.bad("top_p", self.top_p, "use a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 1:
            raise ck.bad(
                "top_k",
                self.top_k,
                "use an integer >= 1 (a large value such as 1e8 keeps every token)",
            )
        if not is_num(self.temperature) or self.temperature < 0:
            raise ck.bad(
                "temperature", self.temperature, "use a finite number >= 0 (0 means greedy)"
            )
        ids = list(self.stop_token_ids or [])
        if not all(is_int(t) and t >= 0 for t in ids):
            raise ck.bad("stop_token_ids", self.stop_token_ids, "use a list of token ids >= 0")
        self.stop_token_ids = ids

    @property
    def is_greedy(self) -> bool:
        """Whether decoding takes the argmax (``greedy``, ``temperature == 0`` or
        ``top_k == 1``)."""
        return self.greedy or self.temperature == 0 or self.top_k == 1

    def new(self, **changes) -> "GenerationHyperparameters":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_sampling_params(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """The SGLang ``sampling_params`` equivalent (see :mod:`realhf.api.core.gen_api`).

        Greedy becomes temperature 0; ``top_k`` at or above ``vocab_size`` (or the 1e8 default)
        becomes -1, SGLang's "keep all".
        """
        from realhf.api.core.gen_api import SamplingParams

        keep_all = self.top_k >= int(1e8) or (vocab_size is not None and self.top_k >= vocab_size)
        return SamplingParams(
            n=self.n,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=0.0 if self.is_greedy else float(self.temperature),
            top_p=float(self.top_p),
            top_k=-1 if keep_all else self.top_k,
            stop_token_ids=tuple(self.stop_token_ids),
        )


@dataclasses.dataclass
class FinetuneSpec:
    """How long training runs: the LR schedule and the run controller are indexed by its steps.

    A step consumes ``train_batch_size`` items; the last step of an epoch may take fewer.
    """

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    def __post_init__(self):
        for name in ("total_train_epochs", "dataset_size", "train_batch_size"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"FinetuneSpec.{name} must be an integer >= 1, got {v!r}")

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one pass over the dataset (a partial last batch counts as a step)."""
        return -(-self.dataset_size // self.train_batch_size)  # ceil, in exact ints

    @property
    def total_train_steps(self) -> int:
        """Steps over all epochs."""
        return self.total_train_epochs * self.steps_per_epoch


@dataclasses.dataclass
class StepInfo:
    """Where training is: epoch, step inside the epoch and global step (all from 0).

    The global step is also the model's weight version that generation servers report.
    """

    epoch: int = 0
    epoch_step: int = 0
    global_step: int = 0

    def __post_init__(self):
        for name in ("epoch", "epoch_step", "global_step"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(f"StepInfo.{name} must be an integer >= 0, got {v!r}")

    def next(self, epoch_done: bool = False) -> "StepInfo":
        """The StepInfo after one more step; ``epoch_done`` starts a new epoch."""
        if epoch_done:
            return StepInfo(self.epoch + 1, 0, self.global_step + 1)
        return StepInfo(self.epoch, self.epoch_step + 1, self.global_step + 1)


@dataclasses.dataclass
class Model:
    """A model handle as interfaces see it.

    Attributes:
        name: the model's role and replica (a string means replica 0).
        module: the (backend-wrapped) network.
        tokenizer: a HuggingFace tokenizer.
        device: where the module's parameters live.
        dtype: parameter dtype; taken from the module's first parameter when omitted.
        version: training progress of these weights.
        ft_spec: the run's length, for LR schedules (None for models that do not train).
    """

    name: Union[ModelName, str]
    module: Any
    tokenizer: Any
    device: Union[str, "torch.device"]
    dtype: Optional["torch.dtype"] = None
    version: StepInfo = dataclasses.field(default_factory=StepInfo)
    ft_spec: Optional[FinetuneSpec] = None

    def __post_init__(self):
        if isinstance(self.name, str):
            self.name = ModelName(self.name, 0)
        if not isinstance(self.name, ModelName):
            raise TypeError(f"Model.name must be a ModelName or a role string, got {self.name!r}")
        if self.dtype is None:
            params = getattr(self.module, "parameters", None)
            first = next(iter(params()), None) if callable(params) else None
            self.dtype = None if first is None else first.dtype

    def inc_version(self, epoch_done: bool = False):
        """Advance :attr:`version` by one training step."""
        self.version = self.version.next(epoch_done)


class GroupSizeError(ValueError):
    """Data whose answers per prompt differ from the run's ``group_size``."""


@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """What a grouped-rollout run (``ppo-math``, ``async-ppo-math``) tells its interfaces.

    The experiment builds it once from its config (``ppo.group_size``, ``ppo.gen.temperature``)
    and gives it as the keyword argument ``rollout`` to every actor interface whose
    constructor declares a ``rollout`` parameter (and to the built-in ``ppo_actor`` and
    ``ppo_critic``), so an algorithm never repeats these values in its own options.

    Attributes:
        group_size: answers generated per prompt; every input item is one prompt holding
            exactly this many sequences, so the answers of one prompt are never split
            across items, micro-batches or data-parallel ranks.
        temperature: divide the logits by it when (re)computing log-probs, so that they
            match the behaviour log-probs (``packed_logprobs``): the sampling temperature,
            ``ppo.temperature`` when that overrides it, 1.0 for greedy decoding.
    """

    group_size: int
    temperature: float

    def __post_init__(self):
        if not is_int(self.group_size) or self.group_size < 1:
            raise ValueError(
                f"RolloutContext.group_size={self.group_size!r}: use an integer >= 1 "
                "(answers per prompt)"
            )
        if not is_num(self.temperature) or self.temperature <= 0:
            raise ValueError(
                f"RolloutContext.temperature={self.temperature!r}: use a finite number > 0 "
                "(1.0 for greedy decoding)"
            )

    def check_groups(self, data: "SequenceSample", who: str, key: str = "packed_input_ids"):
        """Fail unless every item of ``data`` holds ``group_size`` sequences of ``key``.

        Raises:
            GroupSizeError: naming ``who``, the first offending item, its count, the run's
                ``group_size`` and how many items differ.
        """
        counts = [len(lens) for lens in data.seqlens[key]]
        bad = [(i, c) for i, c in zip(data.ids, counts) if c != self.group_size]
        if bad:
            (item, count), n = bad[0], len(bad)
            raise GroupSizeError(
                f"{who} expects group_size={self.group_size} answers per prompt, but item "
                f"{item!r} holds {count} sequences ({n} of {len(counts)} items differ); the "
                "data and the run disagree about the group size: generate group_size answers "
                "per prompt (ppo.group_size), and do not regroup the items"
            )

    def require(self, who: str, fix: str, **assumed: Any) -> None:
        """Fail if values an interface assumes (``group_size=4``, ``temperature=0.7``)
        differ from this run's; the message names both values and ends with ``fix``."""
        for name, value in assumed.items():
            mine = getattr(self, name)
            same = float(value) == float(mine) if is_num(value) else value == mine
            if not same:
                raise ValueError(
                    f"{who} assumes {name}={value!r}, but this run's {name} is {mine!r}; {fix}"
                )


class ModelInterface:
    """Base class of algorithms: what a model does for each kind of model function call.

    Each method receives the :class:`Model`, the call's input as a ``SequenceSample`` and the
    ``MicroBatchSpec`` to cut it by.  ``inference`` and ``generate`` return a ``SequenceSample``
    holding the MFC's output keys (or None on ranks that hold no output); ``train_step``
    returns a stats dict (or a list of them, one per optimizer step).  A subclass implements
    only the methods its MFCs use; calling another one raises ``NotImplementedError`` naming
    the interface and the method.

    ``uses_weights = False`` says the interface never reads the model's weights (a reward
    computed from the tokens alone): such an MFC needs no layout of its own in a per-MFC
    allocation, and no reallocation brings weights to it.

    **The run's settings.** The model worker builds one instance per MFC as
    ``cls(**args)``.  In ``ppo-math`` / ``async-ppo-math`` an actor interface whose
    constructor declares ``rollout`` receives a :class:`RolloutContext`:
    ``rollout.group_size`` (answers per prompt; each item of ``data`` is one prompt holding
    that many sequences, checked by ``rollout.check_groups(data, who)``) and
    ``rollout.temperature`` (divide logits by it when computing log-probs).  An option of the
    interface's own named ``group_size`` or ``temperature`` must equal the run's: a
    different value, given or as the constructor's default, fails when the experiment is
    built, before any process starts.

    **Micro-batches.** ``data.split(mb_spec)`` (which the engines call) packs whole items,
    never cutting one, first-fit-decreasing by each item's token count (on the key with the
    most tokens) into micro-batches of at most ``mb_spec.max_tokens_per_mb`` tokens, at
    least ``mb_spec.n_mbs`` of them while there are that many items; the answers of one
    prompt therefore stay in one micro-batch.  ``TrainEngine.train_batch`` splits with
    ``synced_data_parallel_split``: every data-parallel rank runs the same number of
    micro-batches (the largest any rank needs), so collectives issued per micro-batch stay
    in step.  ``InferenceEngine.forward`` splits each rank on its own.

    **Loss and its statistics.** ``train_batch(sample, mb_spec, loss_fn, loss_weight_fn)``
    calls ``loss_fn(logits, mb) -> (loss, stats)`` once per micro-batch and weighs the
    micro-batch by ``w = loss_weight_fn(mb)`` over ``W``, the sum of ``w`` over every
    micro-batch of every data-parallel rank.  The gradient is that of ``sum w/W * loss``,
    and the returned ``loss`` and each ``stats`` value are the same weighted sums, reduced
    over the ranks: a micro-batch mean weighted by its token count gives the global token
    mean.  ``n_tokens`` is ``W``; ``grad_norm``, ``lr`` and ``n_mbs`` come with them, equal on
    every rank.
    """

    uses_weights: bool = True

    def inference(
        self, model: Model, data: "SequenceSample", mb_spec: "MicroBatchSpec"
    ) -> Optional["SequenceSample"]:
        """A gradient-free forward pass producing new keys (logprobs, values, rewards)."""
        raise self._missing("inference")

    def generate(
        self, model: Model, data: "SequenceSample", mb_spec: "MicroBatchSpec"
    ) -> Optional["SequenceSample"]:
        """Sample answers for the prompts in ``data``."""
        raise self._missing("generate")

    def train_step(
        self, model: Model, data: "SequenceSample", mb_spec: "MicroBatchSpec"
    ) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        """Update the model's weights on ``data``; returns training statistics."""
        raise self._missing("train_step")

    def evaluate(
        self, model: Model, data: "SequenceSample", mb_spec: "MicroBatchSpec"
    ) -> Dict[str, Any]:
        """Evaluate the model on held-out ``data``; returns metrics."""
        raise self._missing("evaluate")

    def save(self, model: Model, save_dir: str) -> None:
        """Write the model as a HuggingFace checkpoint directory."""
        raise self._missing("save")

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"interface {type(self).__name__} does not implement {method}(); implement it in the "
            f"subclass or use an interface type that {type(self).__name__} supports in the MFC"
        )
