"""What every experiment builder shares: defaults, early checks, model specs.

Builders run in the launcher before any process starts, so everything a user can
get wrong (paths, dataset rows, allocation strings) is checked here and reported
with a clear message and a non-zero exit, instead of surfacing later as a worker
failure.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Sequence, Tuple

from realhf.api.cli_args import BaseExperimentConfig, ModelConfig
from realhf.api.core.allocation import (
    AllocationError,
    AllocationMode,
    ParallelismConfig,
    parse_allocation_mode,
    uses_weights,
)
from realhf.api.core.system_api import ExperimentConfig, Scheduling
from realhf.api.core.worker_api import (
    MasterWorkerConfig,
    ModelSpec,
    ModelWorkerConfig,
    Placements,
)
from realhf.base import constants

ASSETS_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
#: asset directory of each embedded task (cli_args.EMBEDDED_TASKS): a complete HF model
#: directory (the task's SFT model and tokenizer) with data/{train,eval,sft}.jsonl
TASK_DIRS = {"tiny_arith": "tiny", "tiny_long": "tiny_long", "tiny_visual": "tiny_visual"}
ASSETS = os.path.join(ASSETS_ROOT, "tiny")
#: the embedded tiny SFT model (a complete HF directory with its tokenizer)
TINY_MODEL = ASSETS
TINY_TRAIN = os.path.join(ASSETS, "data", "train.jsonl")
TINY_EVAL = os.path.join(ASSETS, "data", "eval.jsonl")
TINY_SFT = os.path.join(ASSETS, "data", "sft.jsonl")


def task_model(task: str) -> str:
    """The SFT model directory of embedded task `task`."""
    return os.path.join(ASSETS_ROOT, TASK_DIRS[task])


def task_data(task: str, split: str) -> str:
    """Embedded task `task`'s ``train`` / ``eval`` (math jsonl) or ``sft`` split."""
    return os.path.join(task_model(task), "data", f"{split}.jsonl")


#: modules the workers import so that interfaces and datasets are registered
WORKER_IMPORTS = (
    "realhf.impl.dataset.math_dataset",
    "realhf.impl.dataset.sft_dataset",
    "realhf.impl.model.interface",
)


class ExperimentSetupError(ValueError):
    """The experiment cannot start as configured; the message says what to fix."""


def model_path(cfg: ModelConfig, what: str, task: str = "tiny_arith") -> str:
    """The model directory of `cfg` (embedded task `task`'s model when empty), checked."""
    path = os.path.abspath(os.path.expanduser(cfg.path or task_model(task)))
    if not os.path.isdir(path):
        raise ExperimentSetupError(f"{what}.path: model directory '{path}' does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ExperimentSetupError(
            f"{what}.path: '{path}' is not a HuggingFace model directory (no config.json)"
        )
    return path


def data_path(path: str, default: str, what: str) -> str:
    path = os.path.abspath(os.path.expanduser(path or default))
    if not os.path.isfile(path):
        raise ExperimentSetupError(f"{what}: dataset file '{path}' does not exist")
    return path


#: (dataset class, file and its mtime/size, tokenizer, options) -> items of a file already
#: checked: a build loads each dataset once to fail early, and tests, sweeps and the
#: launcher build the same experiment many times over files that did not change.
_CHECKED_LENGTHS: Dict[tuple, Tuple[int, int]] = {}
_LONGEST: Dict[str, int] = {}


def checked_len(dataset_cls, path: str, tokenizer, **kwargs) -> int:
    """``len(dataset_cls(path, tokenizer, **kwargs))``: loading validates every row (a
    ``DatasetError`` names the bad one); remembered while the file is unchanged."""
    return checked_sizes(dataset_cls, path, tokenizer, **kwargs)[0]


def checked_sizes(dataset_cls, path: str, tokenizer, **kwargs) -> Tuple[int, int]:
    """:func:`checked_len`, and the tokens of the dataset's longest item as loaded with
    these options."""
    st = os.stat(path)
    key = (
        dataset_cls,
        path,
        st.st_mtime_ns,
        st.st_size,
        getattr(tokenizer, "name_or_path", None) or id(tokenizer),
        len(tokenizer),
        tuple(sorted(kwargs.items())),
    )
    if key not in _CHECKED_LENGTHS:
        ds = dataset_cls(path, tokenizer, **kwargs)
        longest = ds.longest()
        _CHECKED_LENGTHS[key] = (len(ds), longest)
        _LONGEST[path] = max(_LONGEST.get(path, 0), longest)
    return _CHECKED_LENGTHS[key]


def dataset_has_images(path: str) -> bool:
    """Whether any row of the jsonl file ``path`` has ``images`` (the MFCs that read its
    items then take the image keys, :data:`~realhf.api.core.data_api.IMAGE_KEYS`)."""
    import json

    with open(path, encoding="utf-8") as f:
        for line in f:
            if '"images"' in line:
                try:
                    if json.loads(line).get("images"):
                        return True
                except (json.JSONDecodeError, AttributeError):
                    continue  # (the dataset's own load reports malformed rows)
    return False


def with_images(keys: Sequence[str], images: bool) -> Tuple[str, ...]:
    """``keys`` plus the image keys when the items have images."""
    from realhf.api.core.data_api import IMAGE_KEYS

    return tuple(keys) + (IMAGE_KEYS if images else ())


def longest_item(path: str) -> Optional[int]:
    """Tokens of the longest item of the dataset file ``path`` as :func:`checked_len`
    loaded it (None if it was not loaded): what the memory estimate sizes a step by."""
    return _LONGEST.get(path)


def allocation(cfg: BaseExperimentConfig, decoupled: Optional[bool] = None) -> AllocationMode:
    """Parse and check `cfg.allocation_mode` (decoupled: must / must not have a gen part)."""
    try:
        alloc = parse_allocation_mode(cfg.allocation_mode)
        alloc.check_supported()
    except (ValueError, NotImplementedError) as e:
        raise ExperimentSetupError(f"allocation_mode: {e}") from None
    if decoupled is False and alloc.is_decoupled:
        raise ExperimentSetupError(
            f"allocation_mode={cfg.allocation_mode!r} has generation servers, which this "
            "experiment does not use; give the trainer layout only, e.g. 'd1p1m1'"
        )
    if decoupled is True and not alloc.is_decoupled:
        raise ExperimentSetupError(
            f"allocation_mode={cfg.allocation_mode!r} needs generation servers + trainer, "
            "e.g. 'gen.d1p1m1+d1p1m1'"
        )
    return alloc


#: Most model workers per CPU core on a machine without GPUs.  The local launcher starts
#: one process per rank of the trainer layout on this machine; ranks that share a core
#: run correctly over gloo, only slower, so a layout may oversubscribe the cores (the tests
#: run d2p1m2 on 2 cores) up to this factor, beyond which it is refused as a mistake.
MAX_PROCESSES_PER_CORE = 4


def placements(
    alloc: AllocationMode,
    mfcs: Sequence,
    models: Sequence[ModelSpec],
    keep_replicas: bool = True,
) -> Placements:
    """The per-MFC layouts of ``alloc`` checked against the graph ``mfcs`` and the models,
    and whether this machine can hold the model workers (see :func:`check_trainer_layout`);
    an empty :class:`Placements` for one global layout."""
    import importlib

    for module in WORKER_IMPORTS:  # the interfaces say whether they use weights
        importlib.import_module(module)
    try:
        homes = alloc.home_layouts(mfcs)
    except AllocationError as e:
        raise ExperimentSetupError(f"allocation_mode: {e}") from None
    by_role = {m.role: m for m in models}
    if not alloc.is_per_mfc:
        check_trainer_layout(alloc.train, models)
        return Placements()
    weightless = {m.name for m in mfcs if not uses_weights(m)}
    # Every (model, layout) pair that will hold weights must split.
    pairs = {(role, str(x)): (role, x) for role, x in homes.items()}
    for m in mfcs:
        if m.name not in weightless:
            pairs.setdefault(
                (m.role, str(alloc.layout_of(m.name))), (m.role, alloc.layout_of(m.name))
            )
    for role, layout in pairs.values():
        check_trainer_layout(layout, [by_role[role]], n_workers=alloc.train.world_size)
    if not pairs:  # only weightless MFCs listed: still check the workers fit
        check_trainer_layout(alloc.train, [])
    return Placements(
        mfcs={
            m.name: alloc.layout_of(m.name) for m in mfcs if alloc.layout_of(m.name) != alloc.train
        },
        homes={r: x for r, x in homes.items() if x != alloc.train},
        weightless=weightless,
        keep_replicas=keep_replicas,
        manual=True,
    )


def model_positions(path: str) -> int:
    """The longest sequence the model at ``path`` takes (its config's positions)."""
    from realhf.impl.model.conversion.hf import config_from_hf_dir

    try:
        return config_from_hf_dir(path).n_positions
    except ValueError as e:
        raise ExperimentSetupError(f"{path}: {e}") from None


def check_trainer_layout(
    layout: ParallelismConfig, models: Sequence[ModelSpec], n_workers: Optional[int] = None
) -> None:
    """Fail before any process starts unless every model can be split as ``layout`` says
    (``m`` divides its heads, MLP width and vocabulary; ``p`` fits its layers) and this
    machine can hold the ``n_workers`` model workers (default: the layout's ``d·p·m``): one
    CUDA device each when CUDA is present (nccl ranks cannot share a device), at most
    ``MAX_PROCESSES_PER_CORE`` per CPU core otherwise."""
    import torch

    from realhf.impl.model.conversion.hf import config_from_hf_dir
    from realhf.impl.model.parallelism import check_layout

    for spec in models:
        try:
            config = config_from_hf_dir(spec.path, is_critic=spec.is_critic)
        except ValueError as e:
            raise ExperimentSetupError(f"model {spec.role!r}: {e}") from None
        try:
            check_layout(config, layout, f"model {spec.role!r} ({spec.path})")
        except ValueError as e:
            raise ExperimentSetupError(f"allocation_mode: {e}") from None
        except NotImplementedError as e:
            raise ExperimentSetupError(f"allocation_mode: not yet supported: {e}") from None
        if spec.critic_lm_logits and not config.tied_embedding:
            raise ExperimentSetupError(
                f"model {spec.role!r} ({spec.path}): an LM regulariser on a reward model "
                "reads the logits through the tied embedding matrix, and this model's "
                "embeddings are not tied; train it without (lm_coef=0)"
            )
        if spec.critic_lm_logits and layout.pipe > 1:
            raise ExperimentSetupError(
                f"allocation_mode: model {spec.role!r} with an LM regulariser needs whole "
                f"models (its head reads the embedding matrix), not {layout.pipe} pipeline "
                "stages; use p1, or lm_coef=0"
            )
    n = layout.world_size if n_workers is None else n_workers
    needs = f"layout {layout} needs d·p·m = {n}" if n_workers is None else f"the layouts need {n}"
    if torch.cuda.is_available():
        devices = torch.cuda.device_count()
        if n > devices:
            raise ExperimentSetupError(
                f"allocation_mode: {needs} model workers, one "
                f"CUDA device each, but this machine has {devices}; use a smaller layout"
            )
        return
    cores = os.cpu_count() or 1
    if n > MAX_PROCESSES_PER_CORE * cores:
        raise ExperimentSetupError(
            f"allocation_mode: {needs} model worker processes "
            f"on {cores} CPU core(s); at most {MAX_PROCESSES_PER_CORE} per core are allowed "
            f"({MAX_PROCESSES_PER_CORE * cores} here): use a smaller layout"
        )


def scheduling(alloc: AllocationMode, share_gpus: float = 0.0) -> dict:
    """Per worker type resources for the launchers: with CUDA, one device per model worker
    and ``m`` per generation server, each process getting its own ``CUDA_VISIBLE_DEVICES``
    (generation servers are launched first, so they take the first devices, as
    ``allocation_mode`` says); nothing on a machine without CUDA.

    ``share_gpus`` (0 < f < 0.9): generation servers and model workers share the devices
    instead (each side needs only as many as it has processes): servers may allocate the
    fraction ``f`` of a device's memory, model workers ``0.95 - f`` (the rest is the two
    processes' CUDA contexts), each capped by PyTorch
    (:func:`~realhf.base.constants.apply_cuda_memory_fraction`)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    devices = torch.cuda.device_count()
    if share_gpus:
        need = max(alloc.gen_world_size, alloc.train_world_size)
        if need > devices:
            raise ExperimentSetupError(
                f"allocation_mode={str(alloc)!r} with share_gpus needs {need} CUDA devices "
                f"(generation servers and model workers share them) but this machine has "
                f"{devices}; use a smaller layout"
            )
        env = constants.CUDA_MEMORY_FRACTION_ENV
        gen = Scheduling(gpu=alloc.gen.tensor, env={env: f"{share_gpus:.3f}"})
        train = Scheduling(gpu=1, env={env: f"{0.95 - share_gpus:.3f}"})
        return {"model_worker": train, "generation_server": gen}
    if alloc.world_size > devices:
        raise ExperimentSetupError(
            f"allocation_mode={str(alloc)!r} needs {alloc.world_size} CUDA devices "
            f"({alloc.gen_world_size} for generation servers, {alloc.train_world_size} for "
            f"model workers) but this machine has {devices}; use a smaller layout, or "
            "share_gpus=F to run both on the same devices"
        )
    out = {"model_worker": Scheduling(gpu=1)}
    if alloc.gen is not None:
        out["generation_server"] = Scheduling(gpu=alloc.gen.tensor)
    return out


def torch_threads(cfg, n_model_workers: int) -> int:
    """Intra-op threads per model worker: ``cfg.torch_threads`` when set, else the cores
    shared evenly (no oversubscription: OpenMP pools that share a core wait on each other).

    The master, controller and data handling take under 3% of a core, so no core is held back
    for them: on the 2-core VM a ppo-math step takes 0.77 s with 2 threads and 1.02 s with 1
    (2026-11-25). Before the per-sequence attention used ``split`` (whose backward does not
    zero-fill a whole-pack gradient per sequence) the small ops made 2 threads slower.
    """
    if cfg.torch_threads is not None:
        return cfg.torch_threads
    return max(1, (os.cpu_count() or 1) // n_model_workers)


def tracking(cfg: BaseExperimentConfig) -> dict:
    """The ``MasterWorkerConfig`` fields of experiment tracking, the same for every
    experiment: the W&B options and the resolved config (the W&B run's config)."""
    return dict(wandb=cfg.wandb, run_config=dataclasses.asdict(cfg))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ExperimentSetupError(f"cannot load a tokenizer from '{path}': {e}") from None


def model_spec(
    role: str,
    cfg: ModelConfig,
    path: str,
    *,
    trainable: bool,
    is_critic: bool = False,
    critic_lm_logits: bool = False,
    publish_weights: bool = False,
    adapters_of: Optional[str] = None,
) -> ModelSpec:
    """``role``'s ModelSpec from its config section (``adapters_of``: see ModelSpec)."""
    if cfg.lora.enabled and not trainable:
        raise ExperimentSetupError(
            f"{role}.lora.rank={cfg.lora.rank}: role {role!r} does not train, so it cannot "
            f"have LoRA adapters; set {role}.lora.rank=0"
        )
    return ModelSpec(
        role=role,
        path=path,
        dtype=cfg.dtype,
        is_critic=is_critic,
        critic_lm_logits=critic_lm_logits,
        trainable=trainable,
        optimizer=cfg.optimizer if trainable else None,
        gradient_checkpointing=bool(cfg.gradient_checkpointing),  # None: not chosen: off
        publish_weights=publish_weights,
        offload=cfg.offload,
        lora=cfg.lora if cfg.lora.enabled else None,
        adapters_of=adapters_of,
    )


def trainer_workers(
    cfg: BaseExperimentConfig,
    alloc: AllocationMode,
    *,
    mfcs: list,
    models: list,
    ft_spec,
    batch_size: int,
    tokenizer_path: str,
    imports: Sequence[str],
    log_stats_keys: Sequence[str],
    eval: bool = False,
    torch_num_threads: Optional[int] = None,
    max_fill_rounds: int = 1,
    **worker_fields,
) -> Tuple[ModelWorkerConfig, MasterWorkerConfig]:
    """The model worker config (one for every rank of the trainer layout: a worker learns
    its rank from its WorkerInformation) and the master's, for a run of ``mfcs`` over
    ``models`` with ``batch_size`` items per step.  ``worker_fields`` are the remaining
    :class:`ModelWorkerConfig` fields (dataset, evaluation, stream, ...)."""
    layout = alloc.train
    places = placements(alloc, mfcs, models, cfg.keep_replicas)
    if torch_num_threads is None:
        torch_num_threads = torch_threads(cfg, layout.world_size)
    worker = ModelWorkerConfig(
        seed=cfg.seed,
        models=models,
        layout=layout,
        placements=places,
        mfcs=mfcs,
        tokenizer_path=tokenizer_path,
        dataset_batch_size=batch_size,
        timeout=cfg.worker_timeout,
        ft_spec=ft_spec,
        torch_num_threads=torch_num_threads,
        imports=tuple(imports),
        **worker_fields,
    )
    master = MasterWorkerConfig(
        seed=cfg.seed,
        mfcs=mfcs,
        exp_ctrl=cfg.exp_ctrl,
        n_model_workers=layout.world_size,
        layout=layout,
        placements=places,
        train_batch_size=batch_size,
        ft_spec=ft_spec,
        timeout=cfg.worker_timeout,
        recover_mode=cfg.recover_mode,
        max_recover_checkpoints=cfg.max_recover_checkpoints,
        **tracking(cfg),
        log_stats_keys=tuple(log_stats_keys),
        eval=eval,
        max_fill_rounds=max_fill_rounds,
    )
    return worker, master


def trainer_experiment(cfg: BaseExperimentConfig, alloc: AllocationMode, **kw) -> ExperimentConfig:
    """One master and the d·p·m model workers of the trainer layout (see
    :func:`trainer_workers` for the arguments).  Model workers serve until told to stop,
    so the master alone decides when the run is done."""
    worker, master = trainer_workers(cfg, alloc, **kw)
    return ExperimentConfig(
        workers={"model_worker": [worker] * alloc.train.world_size, "master_worker": [master]},
        completion_types=("master_worker",),
        scheduling=scheduling(alloc),
    )
