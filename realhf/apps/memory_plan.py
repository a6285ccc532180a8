"""How much memory each process of a run needs, estimated before anything starts.

``quickstart EXP --dry-run`` prints the estimate; a local run whose processes together
would not fit in this host's memory is refused before launch, with the options that would
make it fit (``memory_check=false`` skips the check).  Before that, the memory options a
config leaves empty are chosen (:func:`choose_unset`): ``mb.max_tokens_per_mb`` (no budget
unless one is needed to fit) and each model's ``gradient_checkpointing`` (off unless needed).

The estimate is analytic, per process, by kind of bytes:

- ``weights``: parameters x bytes of the role's dtype, divided over the pipeline stages and
  tensor shards of the layout (every role the worker hosts: actor, ref, critic, ...); twice
  for a built-in generation server on a CPU, which keeps its linear weights packed for oneDNN
  too (``pack_weights``).
- ``gradients``: one gradient in the model's dtype, plus the fp32 sum of a bf16/fp16 model
  (with LoRA, ``actor.lora.rank > 0``, of the adapters only: the base is frozen).  A
  training step frees the fp32 sum for its forward and backward passes and allocates it
  again after the first, when the activations and logits are gone, so a step of one
  micro-batch counts only what it exceeds them by (all of it under ZeRO-1, whose buffer
  stays, and with more micro-batches, whose later passes run beside it).  It is kept
  between calls, which this peak of the training call does not count; the gradient in the
  model's dtype is freed during the calls that do not train (``TrainEngine.
  gradients_released``), which is what makes room for generation's packed weights.  A
  step of one micro-batch on one rank (no pipeline) has no fp32 sum at all: it applies the
  bf16 gradient, converted a chunk at a time.
- ``optimizer``: Adam's two fp32 moments, plus the fp32 master weights of a bf16/fp16
  model; ZeRO-1 (``optimizer.zero_stage=1``) divides them by the data-parallel size.
- ``activations``: what backward keeps of a training micro-batch: per token and layer
  ``b(3I + 4h + 3q + 2kv)`` bytes (:meth:`Shape.layer_activation_bytes`: the norms'
  inputs and outputs, q/k/v, the attention's output, the MLP's gate, up and product; more
  with q/k norms), or the layer inputs only plus one layer's worth with gradient
  checkpointing.
- ``logits``: one micro-batch's ``[T, V/m]`` logits in the model's dtype, twice for training
  (their gradient); log-probs and entropy are vocabulary-chunked, so nothing larger.
- ``kv cache``: ``2 x layers x kv dim`` values per token: a trainer's generation sizes its
  cache to the step's sequences (those generated at once x their length, a group's prompt
  once); a generation server reserves and zero-fills ``kv_cache_tokens`` (default
  ``max_running_requests x context_length``) tokens up front.
- ``runtime``: the interpreter, torch and the libraries (measured: ~0.6 GiB for a model
  worker or generation server, less for the other processes).

Micro-batches hold ``min(max_tokens_per_mb, tokens of the step on this data-parallel rank)``
tokens (a training call's, 1/``ppo_n_minibatches`` of them: it steps on each mini-batch in
turn); a step's sequences are taken at their longest (prompt + ``max_new_tokens``), and a
prompt that a group's answers share is computed once.
It is an estimate: within ~25% of the measured peak on the shapes in ``benchmark/scale.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

from realhf.api.core.dfg import ModelInterfaceType
from realhf.api.core.system_api import ExperimentConfig

GiB = 1024**3
TERMS = ("weights", "gradients", "optimizer", "activations", "logits", "kv cache", "runtime")
#: what a process costs before it holds any model (interpreter, torch, libraries)
RUNTIME = {"model_worker": int(0.6 * GiB), "generation_server": int(0.6 * GiB)}
RUNTIME_OTHER = int(0.25 * GiB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: the longest sequence when a config does not say (tokens)
DEFAULT_SEQ_LEN = 1024


#: the share of the available memory the options chosen for a run may plan to use
CHOICE_HEADROOM = 0.9


class MemoryPlanError(ValueError):
    """A run's processes would not fit in this host's memory."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of a model that decide its memory."""

    n_params: int
    n_layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int  # key (= value) width: kv heads x head dim
    n_positions: int  # the longest context the model takes
    q_dim: int = 0  # query width: query heads x head dim (0: the hidden width)
    qk_norm: bool = False  # per-head norms on q and k (qwen3)

    def layer_activation_bytes(self, b: int) -> int:
        """Bytes one layer keeps per token for backward, in a model of ``b`` bytes per value
        (what autograd saves, counted with ``saved_tensors_hooks`` on qwen2.5-0.5b and
        qwen3-0.6b: within 1%): both norms' inputs and outputs, the attention's q, k, v,
        output and the output projection's input, the MLP's gate, up and product; with
        q/k norms their inputs as well."""
        q = self.q_dim or self.hidden
        out = b * (3 * self.intermediate + 4 * self.hidden + 3 * q + 2 * self.kv_dim)
        if self.qk_norm:
            out += b * (q + self.kv_dim)
        return out

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(path: str, is_critic: bool = False) -> "Shape":
        """The shape of the HF model in ``path`` (its parameters counted without allocating
        them: the model is built on the ``meta`` device)."""
        from realhf.impl.model.conversion.hf import config_from_hf_dir
        from realhf.impl.model.nn.real_model import ReaLModel

        cfg = config_from_hf_dir(path, is_critic=is_critic)
        model = ReaLModel(cfg, device="meta", is_critic=is_critic, init_weights=False)
        return Shape(
            n_params=model.flat_params.numel(),
            n_layers=cfg.n_layers,
            hidden=cfg.hidden_dim,
            intermediate=cfg.intermediate_dim,
            vocab=1 if is_critic else cfg.vocab_size,
            kv_dim=cfg.kv_dim,
            n_positions=cfg.n_positions,
            q_dim=cfg.n_q_heads * cfg.head_dim,
            qk_norm=bool(cfg.qk_layernorm),
        )


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step asks: ``seqs`` sequences (all answers) of up to ``seq_len`` tokens."""

    seq_len: int
    seqs: int
    #: most sequences a trainer's generation runs at once (sync RL)
    gen_concurrency: int = 1 << 30
    #: optimizer steps a training call splits its batch into (PPO's mini-batches)
    train_splits: int = 1
    #: tokens of a prompt that a group's answers share: training and inference compute it
    #: once per group (:mod:`realhf.impl.model.modules.shared_prefix`)
    shared_prompt: int = 0
    group: int = 1

    @property
    def computed_tokens(self) -> int:
        """Tokens a forward over the step's sequences computes (shared prompts once)."""
        shared = (self.seqs - self.seqs // max(1, self.group)) * self.shared_prompt
        return max(1, self.seqs * self.seq_len - shared)

    @staticmethod
    def of(cfg, exp: Optional[ExperimentConfig] = None) -> "Workload":
        """From an experiment config: the longest item of the training data as the builder
        loaded it (else the prompt or length limit) plus ``max_new_tokens`` when answers
        are generated; ``train_batch_size`` x ``group_size`` sequences."""
        ds = getattr(cfg, "dataset", None)
        ppo = getattr(cfg, "ppo", None)
        gen = getattr(ppo, "gen", None)
        longest = _longest_item(exp) if exp is not None else None
        prompt = 0
        if gen is not None:
            prompt = longest or getattr(ds, "max_prompt_len", None) or DEFAULT_SEQ_LEN
            seq_len = prompt + gen.max_new_tokens
        else:
            seq_len = longest or getattr(ds, "max_length", None) or DEFAULT_SEQ_LEN
        group = int(getattr(ppo, "group_size", 1) or 1)
        seqs = int(getattr(cfg, "train_batch_size", 1)) * group
        running = getattr(ppo, "gen_max_running_requests", None) or seqs
        splits = getattr(ppo, "ppo_n_minibatches", None) or 1
        return Workload(
            seq_len=int(seq_len),
            seqs=seqs,
            gen_concurrency=int(running),
            train_splits=int(splits),
            shared_prompt=int(prompt),
            group=group,
        )


def _longest_item(exp: ExperimentConfig) -> Optional[int]:
    from realhf.experiments.building_blocks import longest_item

    found = []
    for workers in exp.workers.values():
        for w in workers[:1]:
            ds = getattr(w, "dataset", None)
            path = getattr(ds, "args", {}).get("dataset_path") if ds is not None else None
            if path and longest_item(path):
                found.append(longest_item(path))
    return max(found, default=None)


@dataclasses.dataclass
class ProcessEstimate:
    """The estimated peak of each process of one kind (they are alike)."""

    kind: str
    count: int
    terms: Dict[str, int]
    note: str = ""

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def _layout(worker) -> Tuple[int, int, int]:
    lay = getattr(worker, "layout", None)
    if lay is None:
        return 1, 1, 1
    return lay.data, lay.pipe, lay.tensor


def _model_worker(worker, n_workers: int, load: Workload) -> ProcessEstimate:
    d, p, m = _layout(worker)
    if getattr(worker, "layout", None) is None:
        d = n_workers
    terms = dict.fromkeys(TERMS, 0)
    terms["runtime"] = RUNTIME["model_worker"]
    calls: Dict[str, List] = {}
    for mfc in worker.mfcs:
        role = getattr(mfc.model_name, "role", str(mfc.model_name).split("@")[0])
        calls.setdefault(role, []).append(mfc)
    # Tokens per micro-batch: the step's tokens on this data-parallel rank, capped by the
    # call's budget.
    step_tokens = max(1, load.computed_tokens // d)
    notes = []
    for spec in worker.models:
        shape = Shape.of(spec.path, spec.is_critic)
        b = DTYPE_BYTES[spec.dtype]
        n = shape.n_params / (p * m)
        if getattr(spec, "adapters_of", None) is None:  # (else: the LoRA role's own base)
            terms["weights"] += int(n * b)
        if getattr(spec, "has_lora", False):
            # Only the adapters train: their weights, gradients and optimizer state.
            from realhf.impl.model.conversion.hf import config_from_hf_dir
            from realhf.impl.model.nn.lora import adapter_numel

            cfg = config_from_hf_dir(spec.path, is_critic=spec.is_critic)
            n = adapter_numel(spec.lora, cfg) / (p * m)
            terms["weights"] += int(n * b)
        types = {ModelInterfaceType(c.interface_type) for c in calls.get(spec.role, [])}
        budgets = [
            c.mb_spec.max_tokens_per_mb
            for c in calls.get(spec.role, [])
            if c.mb_spec is not None
            and ModelInterfaceType(c.interface_type) != ModelInterfaceType.GENERATE
        ]
        tokens = min([step_tokens] + budgets)
        # A training call steps the optimizer on each of its mini-batches in turn.
        train_tokens = min([max(1, step_tokens // load.train_splits)] + budgets)
        layers = -(-shape.n_layers // p)
        per_layer = shape.layer_activation_bytes(b)
        if spec.trainable:
            z = d if spec.optimizer_config.zero_stage == 1 else 1
            terms["optimizer"] += int(n * (8 + (4 if b < 4 else 0)) / z)
            if spec.gradient_checkpointing:
                act = train_tokens * (layers * shape.hidden * b + per_layer)
            else:
                act = train_tokens * layers * per_layer
            terms["activations"] = max(terms["activations"], int(act))
            # the logits of a training micro-batch and their gradient
            logits = 2 * train_tokens * (shape.vocab / m) * b
            terms["logits"] = max(terms["logits"], int(logits))
            fp32_grad = 4 * n if b < 4 else 0  # (freed by TrainEngine.zero_grad)
            one_mb = train_tokens >= step_tokens // load.train_splits
            if d == 1 and p == 1 and one_mb:
                fp32_grad = 0  # one micro-batch on one rank: stepped from the bf16 gradient
            elif z == 1 and one_mb:
                # allocated after the backward pass, when the activations are gone (with
                # more micro-batches it is there for the second one's)
                fp32_grad = max(0, fp32_grad - act - logits)
            terms["gradients"] += int(n * b + fp32_grad)
        if types - {ModelInterfaceType.TRAIN_STEP, ModelInterfaceType.GENERATE}:
            logits = tokens * (shape.vocab / m) * b  # an inference call's logits
            terms["logits"] = max(terms["logits"], int(logits))
        if ModelInterfaceType.GENERATE in types:
            running = min(load.seqs / d, load.gen_concurrency)
            # (a group's answers hold their prompt's pages once: gen/kv_cache.py)
            shared = (running - running / max(1, load.group)) * load.shared_prompt
            kv = (running * load.seq_len - shared) * 2 * layers * (shape.kv_dim / m) * b
            terms["kv cache"] += int(kv)
        note = f"{spec.role} {shape.n_params / 1e6:.0f}M {spec.dtype}"
        if getattr(spec, "has_lora", False):
            note += f" + LoRA r{spec.lora.rank} ({n * p * m / 1e6:.1f}M trained)"
        elif getattr(spec, "adapters_of", None) is not None:
            note = f"{spec.role}: {spec.adapters_of}'s base (no weights of its own)"
        notes.append(note)
    return ProcessEstimate("model_worker", n_workers, terms, ", ".join(notes))


def _generation_server(server, load: Workload) -> ProcessEstimate:
    shape = Shape.of(server.model_path)
    b = DTYPE_BYTES.get(server.dtype, 4)
    terms = dict.fromkeys(TERMS, 0)
    terms["runtime"] = RUNTIME["generation_server"]
    terms["weights"] = shape.n_params * b
    notes = f"{shape.n_params / 1e6:.0f}M {server.dtype}"
    if _packs(server):  # realhf.impl.model.nn.packed_linear: the linear weights once more
        terms["weights"] *= 2
        notes += ", packed copy"
    # The engine reserves and zero-fills its whole KV cache up front.
    slots, slot_len = server.max_running_requests, server.context_length or shape.n_positions
    kv_tokens = getattr(server, "kv_cache_tokens", None) or slots * slot_len
    terms["kv cache"] = int(kv_tokens * 2 * shape.n_layers * shape.kv_dim * b)
    # Decoding holds [running, V] logits (prefill: the last position of each sequence only).
    terms["logits"] = int(min(slots, max(1, load.seqs)) * shape.vocab * 4)
    return ProcessEstimate("generation_server", 1, terms, notes)


def _packs(server) -> bool:
    """Whether a built-in server keeps a packed copy of its weights (on a CPU)."""
    if not getattr(server, "pack_weights", False) or server.dtype not in ("float32", "bfloat16"):
        return False
    if str(getattr(server, "backend", "builtin")).lower().endswith(("sglang", "vllm")):
        return False
    if server.device == "auto":
        import torch

        return not torch.cuda.is_available()
    return server.device == "cpu"


def estimate(cfg, exp: ExperimentConfig) -> List[ProcessEstimate]:
    """The estimate of every kind of process of ``exp`` (built from ``cfg``)."""
    load = Workload.of(cfg, exp)
    out = []
    for kind, workers in exp.workers.items():
        if not workers:
            continue
        if kind == "model_worker":
            out.append(_model_worker(workers[0], len(workers), load))
        elif kind == "generation_server":  # every server serves the same model
            server = _generation_server(workers[0], load)
            server.count = len(workers)
            out.append(server)
        else:
            terms = dict.fromkeys(TERMS, 0)
            terms["runtime"] = RUNTIME_OTHER
            out.append(ProcessEstimate(kind, len(workers), terms))
    trainers = exp.workers.get("model_worker") or []
    for spec in trainers[0].models if trainers else []:
        if spec.publish_weights and spec.weight_sync == "shm":
            # Files in /dev/shm are memory: the version servers hold and the next one.
            terms = dict.fromkeys(TERMS, 0)
            terms["weights"] = 2 * Shape.of(spec.path).n_params * DTYPE_BYTES[spec.dtype]
            out.append(ProcessEstimate("shm weight files", 1, terms, f"2 versions of {spec.role}"))
        elif spec.publish_weights and spec.weight_sync == "broadcast":
            # The trainer's weight sender holds the version servers pull: one more copy (two
            # for a moment if a transfer still reads the last one when the next is staged).
            terms = dict.fromkeys(TERMS, 0)
            terms["weights"] = Shape.of(spec.path).n_params * DTYPE_BYTES[spec.dtype]
            out.append(ProcessEstimate("weight sender copy", 1, terms, f"in {spec.role}'s trainer"))
    return out


def host_total(estimates: Sequence[ProcessEstimate]) -> int:
    """All processes together (a local run puts them on this host), plus the launcher."""
    return sum(e.total * e.count for e in estimates) + RUNTIME_OTHER


def available_memory() -> int:
    """Bytes this host can give a new run now (``MemAvailable``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def report(estimates: Sequence[ProcessEstimate], available: Optional[int] = None) -> List[str]:
    """The estimate as a table (GiB per process, by term) and the host total."""
    rows = [("process", "count", *TERMS, "total", "")]
    for e in estimates:
        rows.append(
            (
                e.kind,
                str(e.count),
                *(_gib(e.terms[t]) for t in TERMS),
                _gib(e.total),
                e.note,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["memory estimate (GiB per process):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    total = host_total(estimates)
    tail = f"  all processes: {_gib(total)} GiB"
    if available is not None:
        tail += f" of {_gib(available)} GiB available on this host"
    return lines + [tail]


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _model_fields(cfg, exp: ExperimentConfig) -> List[str]:
    """The config's model fields (``actor``, ``ref``, ``model``, ...) the run uses: named
    like a role of its model workers (``reward_model`` for ``reward``), or ``model`` when
    the roles have other names (sft's ``default``)."""
    from realhf.api.cli_args import ModelConfig

    fields = [
        f.name
        for f in dataclasses.fields(cfg)
        if isinstance(getattr(cfg, f.name, None), ModelConfig)
    ]
    roles = {spec.role for w in exp.workers.get("model_worker", [])[:1] for spec in w.models}
    used = [f for f in fields if f in roles or f.removesuffix("_model") in roles]
    return used or [f for f in fields if f == "model"]


def _options(cfg, exp: ExperimentConfig) -> List[Tuple[str, Dict[str, object]]]:
    """What may shrink a run, in the order they are tried: ``(label, overrides)``."""
    roles = _model_fields(cfg, exp)
    out: List[Tuple[str, Dict[str, object]]] = []
    if any(getattr(cfg, r).dtype == "float32" for r in roles):
        out.append(("bf16 weights", {f"{r}.dtype": "bfloat16" for r in roles}))
    if any(not getattr(cfg, r).gradient_checkpointing for r in roles):
        out.append(("gradient checkpointing", {f"{r}.gradient_checkpointing": True for r in roles}))
    if any(getattr(cfg, r).optimizer.zero_stage == 0 for r in roles):
        out.append(
            (
                "ZeRO-1 (shards over d of allocation_mode)",
                {f"{r}.optimizer.zero_stage": 1 for r in roles},
            )
        )
    if len(out) > 1:
        combined: Dict[str, object] = {}
        for _, o in out:
            combined.update(o)
        out.append(("all of the above", combined))
    return out


def with_overrides(cfg, overrides: Dict[str, object]):
    """A copy of ``cfg`` with dotted ``key: value`` overrides set (for estimates only: the
    copy's own checks do not run again)."""
    import copy

    cfg = copy.deepcopy(cfg)
    for key, value in overrides.items():
        *path, last = key.split(".")
        obj = cfg
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return cfg


def choose_unset(cfg, build, available: Optional[int] = None):
    """Fill in, in place, the memory options ``cfg`` leaves empty, and build the run:
    ``(experiment, notes)``.

    ``gradient_checkpointing`` (per model) and ``mb.max_tokens_per_mb`` left empty are off /
    no budget, unless a local run (with ``memory_check``) would then not fit in
    ``CHOICE_HEADROOM`` of ``available`` bytes (default: this host's available memory):
    then checkpointing is
    turned on for the models that left it empty, and if that is not enough the largest
    power-of-two token budget that fits is set.  ``notes`` says what was chosen and why.
    """
    from realhf.api.cli_args import ModelConfig

    unset = [
        f.name
        for f in dataclasses.fields(cfg)
        if isinstance(getattr(cfg, f.name, None), ModelConfig)
        and getattr(cfg, f.name).gradient_checkpointing is None
    ]
    for name in unset:
        getattr(cfg, name).gradient_checkpointing = False
    exp = build(cfg)
    unset = [name for name in _model_fields(cfg, exp) if name in unset]  # the run's models
    auto = getattr(cfg, "mode", "local") == "local" and getattr(cfg, "memory_check", True)
    mb = getattr(cfg, "mb", None)
    budget_unset = mb is not None and getattr(mb, "max_tokens_per_mb", 0) is None
    if not auto or not (unset or budget_unset):
        return exp, []
    available = available_memory() if available is None else available
    # Options are chosen to leave room for the estimate's error (measured peaks came up to
    # 12% above it, on qwen3-0.6b; a run that overshoots the host is killed, not slowed).
    room = int(available * CHOICE_HEADROOM)
    need = host_total(estimate(cfg, exp))
    if need <= room:
        return exp, []
    why = (
        f"without: {_gib(need)} GiB, {_gib(available)} GiB available, "
        f"{CHOICE_HEADROOM:.0%} of it planned"
    )

    def fits_with(ckpt: bool):
        """The first fitting (checkpointing, budget) with checkpointing ``ckpt``, else None.
        Micro-batches are tried before recomputation: they cost less time."""
        for name in unset:
            getattr(cfg, name).gradient_checkpointing = ckpt
        budgets = [None] + list(TOKEN_BUDGETS if budget_unset else [])
        for budget in budgets if ckpt else budgets[1:]:
            if budget_unset:
                mb.max_tokens_per_mb = budget
            exp = build(cfg)
            total = host_total(estimate(cfg, exp))
            if total <= room:
                return exp, total
        return None

    for ckpt in ([False] if budget_unset else []) + ([True] if unset else []):
        found = fits_with(ckpt)
        if found is not None:
            exp, total = found
            notes = []
            if ckpt:
                notes.append(f"gradient checkpointing turned on for {', '.join(unset)}")
            if budget_unset and mb.max_tokens_per_mb is not None:
                notes.append(f"mb.max_tokens_per_mb={mb.max_tokens_per_mb} chosen")
            return exp, [f"{n} ({why}; with it: {_gib(total)} GiB)" for n in notes]
    # Nothing fits: leave what was empty off, for check_fits to refuse with the options.
    for name in unset:
        getattr(cfg, name).gradient_checkpointing = False
    if budget_unset:
        mb.max_tokens_per_mb = None
    return build(cfg), []


def check_fits(name: str, cfg, exp: ExperimentConfig, build, available: Optional[int] = None):
    """Refuse a local run whose processes would not fit in ``available`` bytes (default:
    this host's available memory now) with :class:`MemoryPlanError`.  ``build(cfg)`` is the
    experiment's builder: the options that would fit are found by building with them."""
    if getattr(cfg, "mode", "local") != "local" or not getattr(cfg, "memory_check", True):
        return
    estimates = estimate(cfg, exp)
    need = host_total(estimates)
    available = available_memory() if available is None else available
    if need <= available:
        return
    lines = [
        f"{name}: this run needs an estimated {_gib(need)} GiB, but this host has "
        f"{_gib(available)} GiB available; nothing was started.",
        *report(estimates, available),
        "options (estimated total):",
    ]
    for label, overrides in _options(cfg, exp):
        try:
            cfg2 = with_overrides(cfg, overrides)
            total = host_total(estimate(cfg2, build(cfg2)))
            verdict = "fits" if total <= available else "does not fit"
            args = " ".join(f"{k}={_arg(v)}" for k, v in overrides.items())
            lines.append(f"  {label}: {_gib(total)} GiB, {verdict}  ({args})")
        except ValueError as e:
            lines.append(f"  {label}: not possible here ({e})")
    budget = _fitting_token_budget(cfg, exp, build, available)
    if budget is not None:
        lines.append(f"  {budget[0]}: {_gib(budget[1])} GiB, fits  ({budget[2]})")
    lines.append(
        "  or a smaller train_batch_size or shorter answers; memory_check=false skips this check"
    )
    raise MemoryPlanError("\n".join(lines))


#: token budgets per micro-batch tried when activations are what does not fit
TOKEN_BUDGETS = (16384, 8192, 4096, 2048, 1024, 512, 256)


def _fitting_token_budget(cfg, exp: ExperimentConfig, build, available: int):
    """``(label, total, args)`` of the largest ``mb.max_tokens_per_mb`` (alone, or with every
    other option) that fits, or None."""
    mb = getattr(cfg, "mb", None)
    if mb is None or not hasattr(mb, "max_tokens_per_mb"):
        return None
    options = _options(cfg, exp)
    rest = options[-1][1] if options else {}
    for extra, label in (
        ({}, "fewer tokens per micro-batch"),
        (rest, "all of the above and fewer tokens per micro-batch"),
    ):
        for budget in TOKEN_BUDGETS:
            if budget >= (mb.max_tokens_per_mb or 1 << 30):
                continue
            overrides = {**extra, "mb.max_tokens_per_mb": budget}
            try:
                cfg2 = with_overrides(cfg, overrides)
                total = host_total(estimate(cfg2, build(cfg2)))
            except ValueError:
                continue
            if total <= available:
                return label, total, " ".join(f"{k}={_arg(v)}" for k, v in overrides.items())
    return None


def _arg(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
