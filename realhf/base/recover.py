"""Recover checkpoints: what is saved, where, and how a checkpoint becomes valid atomically.

Layout under the root (default ``{run_dir}/checkpoints/recover``)::

    step{N}.tmp/                  being written; ignored (and removed) if a run dies here
    step{N}/
        models/{role}/            HF directory of each trainable role (data-parallel replica
                                  0 writes it; rank 0 holds the file handles)
        optimizer/{role}/rank{r}.pt   optimizer + step counters of each rank's engine (its
                                      shard of the parameters under tensor/pipeline parallelism)
        interfaces/{mfc}/rank{r}.pt   state of interfaces that have one (e.g. an adaptive
                                      KL controller): ``state_dict()`` / ``load_state_dict()``
        data/rank{r}.json         each data loader (a replica head's): epoch and ids used in it
        master.json               the master's counters and the trainer layout (written
                                  last, then the rename)

Ranks are model-worker ranks of the trainer layout, so a checkpoint resumes on the same
layout only (the master refuses another one).
    latest                        text: "step{N}", replaced atomically after the rename

A checkpoint is complete once ``latest`` names it: the master writes ``master.json`` into
the ``.tmp`` directory after every model worker has replied, renames the directory, then
replaces ``latest``.  A crash at any point leaves the previous complete checkpoint as the
one :func:`find_latest` returns.

Randomness is derived from ``(seed, global step)`` and ``(seed, epoch)``, never from a
process-global stream, so no RNG state needs saving: a resumed run draws the same numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from realhf.base import constants, logging
from realhf.base.atomic_file import write_atomic, write_json_atomic

logger = logging.getLogger("recover", "system")

__all__ = [
    "LATEST",
    "MASTER_STATE",
    "RecoverError",
    "recover_root",
    "prepare_tmp_dir",
    "commit",
    "find_latest",
    "read_master_state",
    "model_dir",
    "optimizer_path",
    "data_state_path",
    "interface_state_path",
    "save_worker_state",
    "load_worker_state",
]

LATEST = "latest"
MASTER_STATE = "master.json"
_STEP_DIR = re.compile(r"^step(\d+)$")


class RecoverError(RuntimeError):
    """A recover checkpoint that is missing, incomplete or does not fit this run."""


def recover_root(override: Optional[str] = None) -> str:
    """``override`` or ``{run_dir}/checkpoints/recover``."""
    return override or os.path.join(constants.checkpoint_dir(), "recover")


def _step_name(step: int) -> str:
    return f"step{int(step)}"


def prepare_tmp_dir(root: str, step: int) -> str:
    """An empty ``{root}/step{step}.tmp`` (a leftover of a dead run is removed first)."""
    path = os.path.join(root, _step_name(step) + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


#: suffix of a same-step checkpoint moved aside while its replacement is renamed in
_REPLACED = ".replaced"


def commit(
    root: str, tmp_dir: str, step: int, master_state: Mapping[str, Any], keep: int = 1
) -> str:
    """Make ``tmp_dir`` the complete checkpoint of ``step``; returns its final path.

    Writes ``master.json`` into it, renames it to ``step{step}``, points ``latest`` at it,
    then deletes all but the ``keep`` newest complete checkpoints and stale ``.tmp`` dirs.
    """
    # The order is the protocol: master.json marks the directory complete, the
    # rename makes it visible under its final name (atomic within one file
    # system, and tmp_dir is a sibling), and only then does `latest` move.
    # Pruning comes last, so the previous checkpoint stays valid until the new
    # one is fully committed.
    write_json_atomic(os.path.join(tmp_dir, MASTER_STATE), dict(master_state), indent=1)
    final = os.path.join(root, _step_name(step))
    replaced = final + _REPLACED
    if os.path.exists(final):  # the same step checkpointed again after a resume
        # rename() cannot replace a non-empty directory, so the old one steps aside
        # first; it is deleted only after the new one is in place.  A crash between
        # the two renames leaves `latest` naming a missing directory, and
        # find_latest then puts the old (complete, same-step) one back.
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(tmp_dir, final)
    write_atomic(os.path.join(root, LATEST), _step_name(step))
    shutil.rmtree(replaced, ignore_errors=True)
    steps = sorted(
        (int(m.group(1)), name)
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    )
    for _, name in steps[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):
        if name.endswith(".tmp") and os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    logger.info(f"recover checkpoint of step {step} committed at {final}")
    return final


def find_latest(root: str) -> Optional[str]:
    """The directory ``latest`` names if it is complete, else None."""
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(root, name)
    if not os.path.exists(path) and os.path.isfile(os.path.join(path + _REPLACED, MASTER_STATE)):
        # commit() died between moving a same-step checkpoint aside and renaming its
        # replacement in: the one moved aside is complete, restore it.
        os.rename(path + _REPLACED, path)
        logger.warning(f"restored {path} from {path + _REPLACED} (a commit was interrupted)")
    if not _STEP_DIR.match(name) or not os.path.isfile(os.path.join(path, MASTER_STATE)):
        raise RecoverError(
            f"{pointer} names {name!r}, which is not a complete recover checkpoint (no "
            f"{MASTER_STATE}); delete {root} to start afresh or restore the directory"
        )
    return path


def read_master_state(ckpt_dir: str) -> Dict[str, Any]:
    """The master's state saved in ``ckpt_dir``."""
    with open(os.path.join(ckpt_dir, MASTER_STATE)) as f:
        return json.load(f)


# ---- model worker side --------------------------------------------------------


def model_dir(ckpt_dir: str, role: str) -> str:
    """HF directory of ``role`` inside a checkpoint."""
    return os.path.join(ckpt_dir, "models", role)


def optimizer_path(ckpt_dir: str, role: str, rank: int) -> str:
    """Optimizer state of ``role`` on ``rank``."""
    return os.path.join(ckpt_dir, "optimizer", role, f"rank{rank}.pt")


def data_state_path(ckpt_dir: str, rank: int) -> str:
    """Data loader state of ``rank``."""
    return os.path.join(ckpt_dir, "data", f"rank{rank}.json")


def interface_state_path(ckpt_dir: str, mfc_name: str, rank: int) -> str:
    """State of the interface of MFC ``mfc_name`` on ``rank``."""
    return os.path.join(ckpt_dir, "interfaces", mfc_name, f"rank{rank}.pt")


def _stateful(interfaces: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        n: i
        for n, i in interfaces.items()
        if callable(getattr(i, "state_dict", None))
        and callable(getattr(i, "load_state_dict", None))
    }


def save_worker_state(
    ckpt_dir: str,
    rank: int,
    trainable: Mapping[str, Tuple[Any, Any]],
    loader_state: Optional[Dict[str, Any]],
    interfaces: Mapping[str, Any] = {},
    *,
    save_weights: Union[None, bool, Mapping[str, bool]] = None,
) -> List[str]:
    """Write one model worker's part of a checkpoint; returns the paths written.

    Args:
        trainable: ``role -> (ReaLModel, TrainEngine)``; every rank writes its engine's
            ``state_dict()``.
        loader_state: the data loader's ``state_dict()`` (None: no dataset).
        interfaces: ``MFC name -> interface``; those with ``state_dict``/``load_state_dict``
            are saved.
        save_weights: whether this rank calls ``save_hf`` for the weights; under
            tensor/pipeline parallelism that is a collective of data-parallel replica 0,
            whose rank 0 writes the directory; a mapping says it per role (roles on layouts
            of their own).  Default: rank 0 alone (data parallelism).
    """
    written = []
    # No atomic writes needed for the .pt files: they go into the .tmp
    # directory, which nobody reads before commit() renames it.
    for name, iface in _stateful(interfaces).items():
        path = interface_state_path(ckpt_dir, name, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(iface.state_dict(), path)
        written.append(path)
    if save_weights is None:
        save_weights = rank == 0
    if not isinstance(save_weights, Mapping):
        save_weights = {role: save_weights for role in trainable}
    for role, (model, engine) in trainable.items():
        # Data-parallel replicas hold identical weights, so replica 0 writes one copy;
        # the optimizer state is saved by every rank.
        if save_weights[role]:
            model.save_hf(model_dir(ckpt_dir, role))
            if rank == 0:
                written.append(model_dir(ckpt_dir, role))
        path = optimizer_path(ckpt_dir, role, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(engine.state_dict(), path)
        written.append(path)
    if loader_state is not None:
        path = data_state_path(ckpt_dir, rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, loader_state)
        written.append(path)
    return written


def load_worker_state(
    ckpt_dir: str,
    rank: int,
    trainable: Mapping[str, Tuple[Any, Any]],
    loader=None,
    interfaces: Mapping[str, Any] = {},
    *,
    load_weights: Optional[Callable[[str, str], None]] = None,
) -> None:
    """Restore what :func:`save_worker_state` wrote (weights, optimizer, data position,
    interface states).

    ``load_weights(role, model_dir)`` puts the saved HF directory into the role's model in
    place (this rank's part of it under tensor/pipeline parallelism); default: the
    model's ``load_hf_weights`` (the whole model on this rank).
    """
    for name, iface in _stateful(interfaces).items():
        path = interface_state_path(ckpt_dir, name, rank)
        if not os.path.exists(path):
            raise RecoverError(
                f"recover checkpoint {ckpt_dir} lacks {path} "
                f"(state of MFC {name!r}'s interface); "
                "resume with the same experiment config"
            )
        # weights_only=False: these are our own pickles (optimizer states hold
        # plain Python values next to tensors) from this run's own directory.
        iface.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
    for role, (model, engine) in trainable.items():
        mdir = model_dir(ckpt_dir, role)
        opath = optimizer_path(ckpt_dir, role, rank)
        for p in (mdir, opath):
            if not os.path.exists(p):
                raise RecoverError(
                    f"recover checkpoint {ckpt_dir} lacks {p}; it was written by a run "
                    "with other trainable roles or fewer model workers — resume with "
                    "the same experiment config"
                )
        if load_weights is None:
            model.load_hf_weights(mdir)
        else:
            load_weights(role, mdir)
        engine.load_state_dict(torch.load(opath, map_location="cpu", weights_only=False))
    if loader is not None:
        path = data_state_path(ckpt_dir, rank)
        if not os.path.exists(path):
            raise RecoverError(
                f"recover checkpoint {ckpt_dir} lacks {path}; "
                "resume with the same number of model workers"
            )
        with open(path) as f:
            loader.load_state_dict(json.load(f))
