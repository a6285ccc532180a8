"""Process-wide run identity and the run-directory layout.

Every process of an experiment knows which experiment and trial it belongs to;
the launcher sets them once per process with :func:`set_experiment_trial_names`
and everything else reads them through the getters, which raise a clear error
when they were never set (instead of writing under ``None/None``).

File root
    ``REALHF_FILEROOT`` if set, else ``~/.cache/realhf``.  Override per process
    with :func:`set_fileroot` (the launcher does so from the experiment config).

Run directory (``run_dir()``) = ``{fileroot}/{experiment}/{trial}/``::

    config.yaml      the resolved experiment config
    logs/            one ``{worker}.log`` per worker (``/`` in names -> ``_``)
    checkpoints/     HuggingFace checkpoint directories + recover state
    tensorboard/     event files
    trace.json       Chrome trace of MFCs and rollouts
    metrics.jsonl    one JSON object of stats per step

Weights that the trainer publishes for generation servers go to
``{fileroot}/.cache/{experiment}/{trial}/weights/{role}/v{version}``
(:func:`weight_publication_dir`), outside the run dir so clearing the cache
never touches results.  A generation server loads weights from under
:func:`weight_publication_root` only.

The default name-resolve root is ``{fileroot}/name_resolve`` (see
:mod:`realhf.base.name_resolve`).
"""

from __future__ import annotations

import getpass
import hashlib
import os
import pathlib
import re
from typing import List, Optional, Tuple

__all__ = [
    "set_experiment_trial_names",
    "experiment_name",
    "trial_name",
    "has_experiment_trial_names",
    "clear_experiment_trial_names",
    "user",
    "get_fileroot",
    "set_fileroot",
    "ensure_writable",
    "run_dir",
    "config_path",
    "log_dir",
    "worker_log_path",
    "checkpoint_dir",
    "tensorboard_dir",
    "trace_path",
    "metrics_path",
    "progress_path",
    "cache_root",
    "weight_publication_root",
    "weight_publication_dir",
    "name_resolve_root",
]

_experiment_name: Optional[str] = None
_trial_name: Optional[str] = None
_fileroot: Optional[str] = None


def _check_name(kind: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} must be a non-empty string, got {value!r}.")
    if "/" in value or value in (".", ".."):
        raise ValueError(
            f"{kind} {value!r} may not contain '/' or be '.'/'..': it names a "
            "directory and a name-resolve key segment. Pick e.g. "
            f"{value.replace('/', '-').strip('.') or 'run'!r}."
        )


def set_experiment_trial_names(experiment: str, trial: str) -> None:
    """Set this process's experiment and trial names.

    Setting the same names again is a no-op; setting different names raises,
    because keys and files already created would then be orphaned.  Call
    :func:`clear_experiment_trial_names` first to switch deliberately (tests).
    """
    global _experiment_name, _trial_name
    _check_name("experiment name", experiment)
    _check_name("trial name", trial)
    if _experiment_name is not None and (_experiment_name, _trial_name) != (
        experiment,
        trial,
    ):
        raise RuntimeError(
            f"Experiment/trial names are already set to "
            f"{_experiment_name!r}/{_trial_name!r}; refusing to change them to "
            f"{experiment!r}/{trial!r}. Call clear_experiment_trial_names() first."
        )
    _experiment_name, _trial_name = experiment, trial


def clear_experiment_trial_names() -> None:
    """Forget the experiment and trial names (for tests and notebooks)."""
    global _experiment_name, _trial_name
    _experiment_name = _trial_name = None


def has_experiment_trial_names() -> bool:
    """Whether :func:`set_experiment_trial_names` was called in this process."""
    return _experiment_name is not None


def experiment_name() -> str:
    """This process's experiment name; raises RuntimeError if unset."""
    if _experiment_name is None:
        raise RuntimeError(
            "Experiment name is not set in this process. Call "
            "realhf.base.constants.set_experiment_trial_names(experiment, trial) "
            "first (the launcher does this for every worker)."
        )
    return _experiment_name


def trial_name() -> str:
    """This process's trial name; raises RuntimeError if unset."""
    if _trial_name is None:
        raise RuntimeError(
            "Trial name is not set in this process. Call "
            "realhf.base.constants.set_experiment_trial_names(experiment, trial) "
            "first (the launcher does this for every worker)."
        )
    return _trial_name


def user() -> str:
    """The user name that prefixes name-resolve keys (env ``USER`` first)."""
    name = os.environ.get("USER") or os.environ.get("LOGNAME")
    if name:
        return name
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return f"uid{os.getuid()}"


def get_fileroot() -> str:
    """The file root: set_fileroot() > ``$REALHF_FILEROOT`` > ``~/.cache/realhf``."""
    if _fileroot is not None:
        return _fileroot
    env = os.environ.get("REALHF_FILEROOT")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return os.path.join(os.path.expanduser("~"), ".cache", "realhf")


def set_fileroot(path: Optional[str]) -> None:
    """Override the file root for this process (None restores the default)."""
    global _fileroot
    _fileroot = None if path is None else os.path.abspath(os.path.expanduser(path))


def ensure_writable(path: str) -> str:
    """Create directory ``path`` (and parents) and check that it is writable.

    Raises PermissionError naming the path (and the first component that
    blocks it) when the directory cannot be created or written.
    """
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except (PermissionError, FileExistsError, NotADirectoryError, OSError) as e:
        blocker = _first_blocker(path)
        raise PermissionError(
            f"Cannot create directory {path!r}: {e.strerror or e}"
            + (f" ({blocker!r} is not a writable directory)" if blocker else "")
            + ". Set REALHF_FILEROOT (or the experiment's fileroot) to a writable "
            "directory."
        ) from e
    # A real write rather than os.access(): access() tests the real, not the
    # effective uid, and can say yes where a write then fails (network file
    # systems, quotas).  The pid in the name keeps workers probing one
    # directory at once from racing.
    probe = os.path.join(path, f".write_probe.{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(
            f"Directory {path!r} is not writable: {e.strerror or e}. Set "
            "REALHF_FILEROOT (or the experiment's fileroot) to a writable directory."
        ) from e
    return path


def _first_blocker(path: str) -> Optional[str]:
    """The deepest existing ancestor of ``path`` if it is no writable dir."""
    p = pathlib.Path(path)
    for anc in [p, *p.parents]:
        if anc.exists():
            if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
                return str(anc)
            return None
    return None


# ---- run-directory layout ------------------------------------------------


def run_dir(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{fileroot}/{experiment}/{trial}`` (defaults: this process's names)."""
    return os.path.join(get_fileroot(), experiment or experiment_name(), trial or trial_name())


def config_path(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/config.yaml``: the resolved experiment config."""
    return os.path.join(run_dir(experiment, trial), "config.yaml")


def log_dir(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/logs``: one file per worker."""
    return os.path.join(run_dir(experiment, trial), "logs")


def worker_log_path(
    worker: str, experiment: Optional[str] = None, trial: Optional[str] = None
) -> str:
    """``{run_dir}/logs/{worker}.log`` with ``/`` in the worker name as ``_``."""
    if not worker:
        raise ValueError("worker name must be non-empty, e.g. 'model_worker/0'.")
    return os.path.join(log_dir(experiment, trial), worker.replace("/", "_") + ".log")


def checkpoint_dir(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/checkpoints``."""
    return os.path.join(run_dir(experiment, trial), "checkpoints")


def hf_checkpoint_name(epoch: int, epoch_step: int, global_step: int) -> str:
    """The directory name of a role's HF checkpoint under ``checkpoints/<role>/``, e.g.
    ``epoch1epochstep3globalstep3``."""
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def hf_checkpoints(run_dir_: str, role: Optional[str] = None) -> List[Tuple[int, str, str]]:
    """``(global_step, role, path)`` of the complete HF checkpoints (with a
    ``config.json``, or a LoRA role's ``adapter_config.json``) under
    ``{run_dir_}/checkpoints/<role>/``, by step then role; only ``role``'s when given."""
    found = []
    root = os.path.join(run_dir_, "checkpoints")
    roles = [role] if role is not None else sorted(os.listdir(root)) if os.path.isdir(root) else []
    for r in roles:
        rdir = os.path.join(root, r)
        if not os.path.isdir(rdir):
            continue
        for name in os.listdir(rdir):
            m = _HF_CKPT.fullmatch(name)
            path = os.path.join(rdir, name)
            if m and any(
                os.path.isfile(os.path.join(path, f))
                for f in ("config.json", "adapter_config.json")
            ):
                found.append((int(m.group(1)), r, path))
    return sorted(found)


_HF_CKPT = re.compile(r"epoch\d+epochstep\d+globalstep(\d+)")


def tensorboard_dir(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/tensorboard``."""
    return os.path.join(run_dir(experiment, trial), "tensorboard")


def trace_path(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/trace.json``: Chrome trace of MFCs and rollouts."""
    return os.path.join(run_dir(experiment, trial), "trace.json")


def metrics_path(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/metrics.jsonl``: one JSON object of stats per step."""
    return os.path.join(run_dir(experiment, trial), "metrics.jsonl")


def progress_path(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{run_dir}/progress.json``: the run's plan (total steps, first step), which the
    master writes when training starts and the launcher's console reads."""
    return os.path.join(run_dir(experiment, trial), "progress.json")


def cache_root() -> str:
    """``{fileroot}/.cache``: scratch data that can be deleted between runs."""
    return os.path.join(get_fileroot(), ".cache")


def weight_publication_root(experiment: Optional[str] = None, trial: Optional[str] = None) -> str:
    """``{fileroot}/.cache/{experiment}/{trial}/weights``: every version of every role a run
    publishes lies under it, and a generation server of the run loads weights from nowhere
    else (``/update_weights_from_disk`` answers 403 for any other path)."""
    return os.path.join(
        cache_root(), experiment or experiment_name(), trial or trial_name(), "weights"
    )


def _check_version_key(role: str, version: int) -> None:
    if not role or "/" in role:
        raise ValueError(f"role must be a non-empty name without '/', got {role!r}.")
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}.")


def weight_publication_dir(
    role: str,
    version: int,
    experiment: Optional[str] = None,
    trial: Optional[str] = None,
) -> str:
    """Where version ``version`` of model ``role`` is written for generation servers.

    ``{fileroot}/.cache/{experiment}/{trial}/weights/{role}/v{version}``.
    """
    _check_version_key(role, version)
    return os.path.join(weight_publication_root(experiment, trial), role, f"v{version}")


#: Where ``weight_sync=shm`` puts weight files: a memory file system every process of the
#: host sees (``REALHF_SHM_DIR`` overrides it).
SHM_DIR = "/dev/shm"


def weight_shm_root(
    experiment: Optional[str] = None, trial: Optional[str] = None, fileroot: Optional[str] = None
) -> str:
    """``/dev/shm/realhf-{hash of the fileroot}/{experiment}/{trial}``: the versions a run
    with ``weight_sync=shm`` publishes (one file each), and the only place its generation
    servers map weights from.  The hash keeps runs of different file roots (users, test
    sessions) apart in the host-wide ``/dev/shm``.  Its files are memory: the gserver
    manager retires old versions after each update (the trainer's next write reuses one),
    and the run deletes the directory when it ends."""
    base = os.environ.get("REALHF_SHM_DIR", SHM_DIR)
    root = os.path.abspath(fileroot or get_fileroot())
    key = hashlib.sha256(root.encode()).hexdigest()[:12]
    return os.path.join(
        base, f"realhf-{key}", experiment or experiment_name(), trial or trial_name()
    )


def weight_shm_path(
    role: str,
    version: int,
    experiment: Optional[str] = None,
    trial: Optional[str] = None,
) -> str:
    """The flat weight file of version ``version`` of ``role`` under :func:`weight_shm_root`
    (see :mod:`realhf.impl.model.conversion.flat_file`)."""
    _check_version_key(role, version)
    return os.path.join(weight_shm_root(experiment, trial), role, f"v{version}.flat")


def name_resolve_root() -> str:
    """``{fileroot}/name_resolve``: root of the default file name-resolve backend."""
    return os.path.join(get_fileroot(), "name_resolve")


#: the fraction of its GPU's memory a process may allocate, set by the launcher where
#: generation servers and trainers share GPUs (``share_gpus``); read by
#: :func:`apply_cuda_memory_fraction`
CUDA_MEMORY_FRACTION_ENV = "REALHF_CUDA_MEMORY_FRACTION"


def apply_cuda_memory_fraction(device=None) -> Optional[float]:
    """Cap this process's CUDA allocations at ``$REALHF_CUDA_MEMORY_FRACTION`` of
    ``device``'s memory (the current device by default); returns the fraction, None when
    unset or without CUDA.  A process that goes over gets PyTorch's out-of-memory error
    instead of taking memory its neighbour on the same GPU counted on."""
    value = os.environ.get(CUDA_MEMORY_FRACTION_ENV)
    if not value:
        return None
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"{CUDA_MEMORY_FRACTION_ENV}={value!r} is not a number") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{CUDA_MEMORY_FRACTION_ENV}={value!r} must be in (0, 1]")
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
