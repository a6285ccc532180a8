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
interface type with the model, the MFC's input data and its micro-batch spec.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from realhf.api.core.dfg import ModelName

if TYPE_CHECKING:  # imported for annotations only
    import torch

    from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
    from realhf.api.core.gen_api import SamplingParams

__all__ = ["GenerationHyperparameters", "FinetuneSpec", "StepInfo", "Model", "ModelInterface"]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


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
        def bad(name, fix):
            return ValueError(f"GenerationHyperparameters.{name}={getattr(self, name)!r}: {fix}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "use an integer >= 1 (answers per prompt)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "use an integer >= 1")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad(
                "min_new_tokens", f"use an integer in [0, max_new_tokens={self.max_new_tokens}]"
            )
        if not isinstance(self.greedy, bool):
            raise bad("greedy", "use true or false")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "use a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 1:
            raise bad("top_k", "use an integer >= 1 (a large value such as 1e8 keeps every token)")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "use a finite number >= 0 (0 means greedy)")
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "use a list of token ids >= 0")
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
            if not _is_int(v) or v < 1:
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
            if not _is_int(v) or v < 0:
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
