"""The ``allocation_mode`` string: how an experiment lays its models over devices.

Grammar (whitespace around parts is ignored)::

    d2p1m1                   trainer only: data x pipeline x tensor (model) parallel degrees;
                             the three letters may come in any order, each exactly once
    gen.d1p1m1+d2p1m1        generation servers (built-in engine) + trainer
    sglang.d4p1m1+d2p2m1     SGLang generation servers + trainer
    vllm.d1p1m1+d1p1m1       vLLM generation servers + trainer
    actor_gen:d2p1m1,actor_train:d1p2m1
                             per-MFC layouts ("manual allocation"): each listed model
                             function call runs on its own layout; the trainer part of a
                             decoupled mode may be per-MFC as well

Per-MFC layouts: MFC ``name:dXpYmZ`` runs on the first ``X·Y·Z`` model workers (every
layout's ranks are a prefix of the workers, so two layouts are always nested and never
overlap part-way); the experiment launches as many model workers as the widest layout
needs.  Each model has one *home* layout, that of its training MFC (or, for a model that is
not trained, of its first listed MFC), which holds the weights and the optimizer state; an
MFC of the model on another layout runs on a *replica* that parameter reallocation brings up
to date before the call.  Which MFCs must be listed is checked by the experiment builders
against their dataflow graph (:meth:`AllocationMode.check_mfcs`).

In a decoupled mode the generation part describes ``data`` servers of ``tensor`` devices each
and takes the first devices; the trainer takes the rest.  ``sglang.d4p1m1+d2p2m1`` on 8 GPUs is
four TP-1 SGLang servers and a dp2 x pp2 trainer.

:func:`parse_allocation_mode` returns a typed :class:`AllocationMode`;
:meth:`AllocationMode.check_supported` rejects what this version cannot run yet (generation
servers of more than one device).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Optional, Sequence, Tuple

__all__ = [
    "AllocationError",
    "MFC_NAME",
    "ParallelismConfig",
    "AllocationMode",
    "GEN_BACKENDS",
    "parse_parallelism",
    "parse_allocation_mode",
    "uses_weights",
]

GEN_BACKENDS = ("gen", "sglang", "vllm")
_EXAMPLES = (
    "valid examples: 'd2p1m1', 'p1m1d4', 'gen.d1p1m1+d2p1m1', 'sglang.d4p1m1+d2p2m1', "
    "'actor_gen:d2p1m1,actor_train:d1p2m1'"
)
#: what an MFC name in a per-MFC allocation may look like
MFC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_LETTERS = {"d": "data", "p": "pipe", "m": "tensor"}


class AllocationError(ValueError):
    """A malformed allocation_mode; the message names the bad part and shows valid examples."""


def _int_ge1(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """Parallel degrees of one model layout.

    Attributes:
        data: data-parallel replicas.
        pipe: pipeline stages.
        tensor: tensor-parallel shards (the ``m`` letter, "model parallel").
    """

    data: int = 1
    pipe: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in ("data", "pipe", "tensor"):
            v = getattr(self, name)
            if not _int_ge1(v):
                raise AllocationError(
                    f"ParallelismConfig.{name} must be an integer >= 1, got {v!r}"
                )

    @property
    def world_size(self) -> int:
        """Devices (processes) this layout occupies."""
        return self.data * self.pipe * self.tensor

    def __str__(self) -> str:
        return f"d{self.data}p{self.pipe}m{self.tensor}"


def parse_parallelism(s: str, what: str = "allocation") -> ParallelismConfig:
    """Parse ``dXpYmZ`` (letters in any order, each once) into a :class:`ParallelismConfig`."""
    part = s.strip()
    # Shape first, meaning second: the fullmatch guarantees findall below
    # consumes the whole string, so no stray character is silently ignored.
    # Letters are matched broadly so that "x2" gets "unknown letter", not
    # "not of the form".
    if not re.fullmatch(r"([a-zA-Z]\d+)+", part):
        raise AllocationError(
            f"{what} {s!r} is not of the form dXpYmZ "
            f"(a letter followed by a degree, for d, p and m); {_EXAMPLES}"
        )
    degrees = {}
    for letter, digits in re.findall(r"([a-zA-Z])(\d+)", part):
        if letter not in _LETTERS:
            raise AllocationError(
                f"{what} {s!r}: unknown letter {letter!r}; "
                f"use d (data), p (pipeline) and m (tensor); {_EXAMPLES}"
            )
        if letter in degrees:
            raise AllocationError(
                f"{what} {s!r}: {letter!r} appears twice; give each of d, p, m once; {_EXAMPLES}"
            )
        if int(digits) < 1:
            raise AllocationError(
                f"{what} {s!r}: degree {letter}{digits} must be >= 1; {_EXAMPLES}"
            )
        degrees[letter] = int(digits)
    missing = [x for x in "dpm" if x not in degrees]
    if missing:
        raise AllocationError(
            f"{what} {s!r}: missing {missing}; give each of d, p, m once; {_EXAMPLES}"
        )
    return ParallelismConfig(**{_LETTERS[k]: v for k, v in degrees.items()})


@dataclasses.dataclass(frozen=True)
class AllocationMode:
    """A parsed allocation: an optional generation layout and the trainer layout(s).

    Attributes:
        train: the model workers' layout: the one layout of every MFC, or with per-MFC
            layouts ``d<N>p1m1`` over the ``N`` workers the widest MFC layout needs (each
            worker then loads its own data shard, and unlisted MFCs that use no weights run
            there).
        gen: the generation servers' layout (``data`` servers of ``tensor`` devices), or None
            when generation runs inside the trainer's layout.
        gen_backend: ``gen`` (built-in engine), ``sglang`` or ``vllm``; None exactly when
            ``gen`` is None.
        mfcs: per-MFC layouts ``((mfc name, layout), ...)``; empty for one global layout.
    """

    train: ParallelismConfig
    gen: Optional[ParallelismConfig] = None
    gen_backend: Optional[str] = None
    mfcs: Tuple[Tuple[str, ParallelismConfig], ...] = ()

    def __post_init__(self):
        if (self.gen is None) != (self.gen_backend is None):
            raise AllocationError("AllocationMode: gen and gen_backend must be given together")
        if self.gen_backend is not None and self.gen_backend not in GEN_BACKENDS:
            raise AllocationError(
                f"unknown generation backend {self.gen_backend!r}; "
                f"use one of {GEN_BACKENDS}; {_EXAMPLES}"
            )
        if self.gen is not None and self.gen.pipe != 1:
            raise AllocationError(
                f"generation layout {self.gen}: "
                "generation servers do not use pipeline parallelism; "
                f"use d{self.gen.data}p1m{self.gen.tensor}"
            )
        if self.mfcs:
            widest = max(layout.world_size for _, layout in self.mfcs)
            if self.train != ParallelismConfig(data=widest):
                raise AllocationError(
                    f"AllocationMode: with per-MFC layouts the workers' layout is "
                    f"d{widest}p1m1 (the widest MFC layout), got {self.train}"
                )

    @property
    def is_decoupled(self) -> bool:
        """Whether generation runs on its own servers (asynchronous RL)."""
        return self.gen is not None

    @property
    def is_per_mfc(self) -> bool:
        """Whether MFCs have layouts of their own."""
        return bool(self.mfcs)

    @property
    def mfc_layouts(self) -> Dict[str, ParallelismConfig]:
        """``{mfc name: layout}`` of the listed MFCs (empty for one global layout)."""
        return dict(self.mfcs)

    @property
    def n_gen_servers(self) -> int:
        """Generation servers (0 when not decoupled)."""
        return 0 if self.gen is None else self.gen.data

    @property
    def gen_world_size(self) -> int:
        """Devices taken by generation servers."""
        return 0 if self.gen is None else self.gen.world_size

    @property
    def train_world_size(self) -> int:
        """Devices taken by the trainer (model workers)."""
        return self.train.world_size

    @property
    def world_size(self) -> int:
        """Devices of the whole experiment."""
        return self.gen_world_size + self.train_world_size

    def layout_of(self, mfc: str) -> ParallelismConfig:
        """The layout MFC ``mfc`` runs on (``train`` when it is not listed)."""
        return self.mfc_layouts.get(mfc, self.train)

    def check_supported(self) -> None:
        """Raise ``NotImplementedError`` for layouts this version cannot run.

        Any trainer layout ``dXpYmZ`` passes here: whether a model can be split that way
        (``m`` against its heads and vocabulary, ``p`` against its layers, and pipeline
        support itself) is checked per model by the experiment builders
        (``realhf.impl.model.parallelism.check_layout``).  Generation servers are still
        one device each (``d<N>p1m1``).
        """
        if self.gen is not None and (self.gen.tensor > 1 or self.gen.pipe > 1):
            raise NotImplementedError(
                f"allocation_mode {str(self)!r} (generation layout {self.gen}): "
                "tensor/pipeline parallelism > 1 is not yet supported "
                "(coming with the parallelism milestone); use d<N>p1m1"
            )

    def home_layouts(self, mfcs: Sequence) -> Dict[str, ParallelismConfig]:
        """Check the per-MFC layouts against the dataflow graph ``mfcs`` (MFCDefs, in
        topological order) and return each model role's home layout.

        Every MFC that uses its model's weights must be listed (a per-MFC allocation that
        forgot one would silently run it on ``train``); MFCs whose interface uses no weights
        (``ModelInterface.uses_weights = False``, e.g. the math reward) may be left out.  All
        training MFCs of a role share one layout: the role's home, which holds the
        optimizer state.  Without per-MFC layouts every role's home is ``train``.

        Raises:
            AllocationError: an unknown MFC is listed, a weight-using MFC is missing, or
                two training MFCs of one role have different layouts.
        """
        roles: Dict[str, ParallelismConfig] = {}
        if not self.mfcs:
            for m in mfcs:
                roles.setdefault(m.role, self.train)
            return roles
        listed = self.mfc_layouts
        names = [m.name for m in mfcs]
        unknown = sorted(set(listed) - set(names))
        if unknown:
            raise AllocationError(
                f"allocation_mode {str(self)!r} lists {unknown}, which this experiment does "
                f"not run; its MFCs are {names}"
            )
        missing = [m.name for m in mfcs if m.name not in listed and uses_weights(m)]
        if missing:
            raise AllocationError(
                f"allocation_mode {str(self)!r} gives no layout to {missing}; with per-MFC "
                f"layouts list every MFC that runs a model: {names} (MFCs that use no "
                "weights, like the math reward, may be left out)"
            )
        train: Dict[str, Tuple[str, ParallelismConfig]] = {}
        for m in mfcs:
            if m.is_train and m.name in listed:
                seen = train.setdefault(m.role, (m.name, listed[m.name]))
                if seen[1] != listed[m.name]:
                    raise AllocationError(
                        f"allocation_mode {str(self)!r}: {seen[0]} and {m.name} both train "
                        f"model {m.role!r} but on different layouts ({seen[1]} and "
                        f"{listed[m.name]}); a model trains on one layout, which holds its "
                        "optimizer state"
                    )
        for m in mfcs:
            if m.role in train:
                roles[m.role] = train[m.role][1]
            elif m.name in listed:
                roles.setdefault(m.role, listed[m.name])
        for m in mfcs:  # roles whose MFCs use no weights at all
            roles.setdefault(m.role, self.layout_of(m.name))
        return roles

    def __str__(self) -> str:
        train = (
            ",".join(f"{name}:{layout}" for name, layout in self.mfcs)
            if self.mfcs
            else str(self.train)
        )
        if self.gen is None:
            return train
        return f"{self.gen_backend}.{self.gen}+{train}"


def uses_weights(mfc) -> bool:
    """Whether ``mfc``'s interface reads its model's weights (the registered class says so
    with ``uses_weights``; unknown interfaces are assumed to)."""
    from realhf.api.core import registry

    name = mfc.interface_impl.type_
    if name not in registry.INTERFACES:
        return True
    return bool(getattr(registry.INTERFACES.get(name), "uses_weights", True))


def _parse_per_mfc(s: str, text: str) -> Tuple[Tuple[str, ParallelismConfig], ...]:
    """``name:dXpYmZ,name:dXpYmZ,...`` (see the module docstring)."""
    out: Dict[str, ParallelismConfig] = {}
    for part in text.split(","):
        name, colon, layout = part.strip().partition(":")
        name = name.strip()
        if not colon or not MFC_NAME.fullmatch(name):
            raise AllocationError(
                f"allocation_mode {s!r}: {part.strip()!r} is not of the form "
                f"'mfc_name:dXpYmZ'; {_EXAMPLES}"
            )
        if name in out:
            raise AllocationError(f"allocation_mode {s!r}: MFC {name!r} is listed twice")
        out[name] = parse_parallelism(layout, f"layout of MFC {name!r}")
    return tuple(out.items())


def _trainer(s: str, text: str) -> AllocationMode:
    if ":" in text or "," in text:
        mfcs = _parse_per_mfc(s, text)
        widest = max(layout.world_size for _, layout in mfcs)
        return AllocationMode(train=ParallelismConfig(data=widest), mfcs=mfcs)
    return AllocationMode(train=parse_parallelism(text, "trainer layout"))


def parse_allocation_mode(s: str) -> AllocationMode:
    """Parse an allocation_mode string (see the module docstring) into an
    :class:`AllocationMode`."""
    if not isinstance(s, str) or not s.strip():
        raise AllocationError(f"allocation_mode must be a non-empty string, got {s!r}; {_EXAMPLES}")
    text = s.strip()
    # The original system's automatic allocation is recognised only to explain that it is
    # not supported here; without this check it would fail with a confusing parse error.
    if text in ("manual", "heuristic"):
        raise AllocationError(
            f"allocation_mode {text!r} is not supported; give the layouts "
            f"(per MFC for a manual allocation); {_EXAMPLES}"
        )
    if "+" not in text:
        if "." in text and ":" not in text:
            raise AllocationError(
                f"allocation_mode {s!r}: a generation backend needs a trainer layout after '+', "
                f"e.g. '{text}+d1p1m1'; {_EXAMPLES}"
            )
        return _trainer(s, text)
    gen_part, sep, train_part = text.partition("+")
    if "+" in train_part:
        raise AllocationError(f"allocation_mode {s!r} has more than one '+'; {_EXAMPLES}")
    backend, dot, gen_layout = gen_part.strip().partition(".")
    if not dot:
        raise AllocationError(
            f"allocation_mode {s!r}: "
            f"the generation part {gen_part.strip()!r} needs a backend prefix "
            f"({' or '.join(repr(b + '.') for b in GEN_BACKENDS)}); {_EXAMPLES}"
        )
    backend = backend.strip()
    if backend not in GEN_BACKENDS:
        raise AllocationError(
            f"allocation_mode {s!r}: unknown generation backend {backend!r}; "
            f"use one of {GEN_BACKENDS}; {_EXAMPLES}"
        )
    gen = parse_parallelism(gen_layout, "generation layout")
    trainer = _trainer(s, train_part)
    return dataclasses.replace(trainer, gen=gen, gen_backend=backend)
