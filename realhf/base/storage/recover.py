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
        master.json               the master's counters and the trainer layout
        manifest.json             size and checksum of every file above (written last,
                                  then the rename; see :mod:`realhf.base.storage.manifest`)
    step{N}.invalid/              a checkpoint that failed its check, moved aside
    latest                        text: "step{N}", replaced atomically after the rename

Ranks are model-worker ranks of the trainer layout, so a checkpoint resumes on the same
layout only (the master refuses another one).

A checkpoint is complete once it is renamed to ``step{N}``: the master writes
``master.json`` and the manifest into the ``.tmp`` directory after every model worker has
replied, renames the directory, then replaces ``latest``.  A crash at any point leaves the
previous complete checkpoint as the one :func:`find_latest` returns.

Faults and their outcomes:

* a damaged checkpoint (a file cut short, missing or overwritten, ``master.json`` not JSON,
  ``latest`` naming nothing): :func:`find_latest` checks the checkpoint against its
  manifest before anyone loads it and falls back to the newest usable one with a warning
  naming the damage, or raises :class:`RecoverError` naming it and how to start afresh.
  Checkpoints written before manifests existed are used as before; damage a check cannot
  see fails their load with a :class:`RecoverError` naming the file.
* a full disk (or quota, or file-size limit) while writing: :class:`CheckpointWriteError`
  ("no space left ...", naming the checkpoint directory); the master removes the ``.tmp``
  directory and the run fails, its previous checkpoint still usable.  Failing rather than
  training on without checkpoints: the run was asked to be recoverable every N steps, and
  the metrics and saved models that share the disk would be lost next.

Randomness is derived from ``(seed, global step)`` and ``(seed, epoch)``, never from a
process-global stream, so no RNG state needs saving: a resumed run draws the same numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from realhf.base import constants, logging
from realhf.base.storage.atomic_file import write_atomic, write_json_atomic
from realhf.base.storage.disk import free_bytes, no_space_reason
from realhf.base.storage.manifest import MANIFEST, check_manifest, write_manifest

logger = logging.getLogger("recover", "system")

__all__ = [
    "LATEST",
    "MASTER_STATE",
    "RecoverError",
    "CheckpointWriteError",
    "recover_root",
    "prepare_tmp_dir",
    "discard_tmp_dir",
    "commit",
    "check_checkpoint",
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


class CheckpointWriteError(RecoverError):
    """A recover checkpoint could not be written for lack of space (the message says
    which directory and why); the previous checkpoint is untouched."""


def recover_root(override: Optional[str] = None) -> str:
    """``override`` or ``{run_dir}/checkpoints/recover``."""
    return override or os.path.join(constants.checkpoint_dir(), "recover")


def _step_name(step: int) -> str:
    return f"step{int(step)}"


def prepare_tmp_dir(root: str, step: int) -> str:
    """An empty ``{root}/step{step}.tmp`` (a leftover of a dead run is removed first)."""
    path = os.path.join(root, _step_name(step) + ".tmp")
    shutil.rmtree(path, ignore_errors=True)
    with _writing(path, path):
        os.makedirs(path)
    return path


def discard_tmp_dir(tmp_dir: str) -> None:
    """Remove a ``.tmp`` directory whose checkpoint will not be committed (a write failed)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)


#: suffix of a same-step checkpoint moved aside while its replacement is renamed in
_REPLACED = ".replaced"
#: suffix of a checkpoint that failed its check and was moved aside for a look
_INVALID = ".invalid"


def commit(
    root: str, tmp_dir: str, step: int, master_state: Mapping[str, Any], keep: int = 1
) -> str:
    """Make ``tmp_dir`` the complete checkpoint of ``step``; returns its final path.

    Writes ``master.json`` and the manifest into it, renames it to ``step{step}``, points
    ``latest`` at it, then deletes all but the ``keep`` newest complete checkpoints and
    stale ``.tmp`` dirs.  Raises :class:`CheckpointWriteError` when the disk is full (the
    caller discards ``tmp_dir``; the previous checkpoint is untouched).
    """
    # The order is the protocol: master.json and the manifest (of every file, written
    # last) make the directory complete, the rename makes it visible under its final
    # name (atomic within one file system, and tmp_dir is a sibling), and only then
    # does `latest` move.  Pruning comes last, so the previous checkpoint stays valid
    # until the new one is fully committed.
    with _writing(tmp_dir, os.path.join(tmp_dir, MASTER_STATE)):
        write_json_atomic(os.path.join(tmp_dir, MASTER_STATE), dict(master_state), indent=1)
        write_manifest(tmp_dir)
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
    with _writing(final, os.path.join(root, LATEST)):
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


def check_checkpoint(path: str) -> List[str]:
    """What is wrong with the checkpoint directory ``path``, one line each ([]: usable).

    A checkpoint with a manifest must match it file by file; one written before manifests
    existed needs a readable ``master.json`` only.
    """
    if not os.path.isdir(path):
        return ["the directory is missing"]
    state = os.path.join(path, MASTER_STATE)
    if not os.path.isfile(state):
        return [f"no {MASTER_STATE} (its commit did not finish)"]
    problems = check_manifest(path) if os.path.exists(os.path.join(path, MANIFEST)) else []
    try:
        with open(state) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        problems.insert(0, f"{MASTER_STATE} is not readable JSON ({e})")
    return problems


def has_checkpoint(root: str) -> bool:
    """Whether ``root`` holds a committed ``step{N}`` directory (read only: nothing is
    checked or moved; :func:`find_latest` decides whether it is usable)."""
    return os.path.isdir(root) and any(_STEP_DIR.match(name) for name in os.listdir(root))


def find_latest(root: str) -> Optional[str]:
    """The newest usable recover checkpoint under ``root``, or None when there is none.

    ``latest`` names the one to use; when that one is missing or fails
    :func:`check_checkpoint`, the newest other ``step{N}`` that passes is used instead,
    with a warning naming what was wrong, and each failed one is moved aside to
    ``step{N}.invalid`` (so neither this nor a later run picks it, and pruning keeps
    it for a look).  Raises :class:`RecoverError` naming every problem when checkpoints
    exist but none is usable: resuming from nothing would silently restart the run.
    """
    pointer = os.path.join(root, LATEST)
    try:
        with open(pointer) as f:
            named: Optional[str] = f.read().strip()
    except FileNotFoundError:
        named = None
    if named is not None:
        path = os.path.join(root, named)
        if not os.path.exists(path) and os.path.isfile(
            os.path.join(path + _REPLACED, MASTER_STATE)
        ):
            # commit() died between moving a same-step checkpoint aside and renaming its
            # replacement in: the one moved aside is complete, restore it.
            os.rename(path + _REPLACED, path)
            logger.warning(f"restored {path} from {path + _REPLACED} (a commit was interrupted)")
    others = sorted(
        (
            (int(m.group(1)), name)
            for name in (os.listdir(root) if os.path.isdir(root) else ())
            if (m := _STEP_DIR.match(name)) and name != named
        ),
        reverse=True,
    )
    candidates = ([named] if named is not None else []) + [name for _, name in others]
    bad: List[Tuple[str, List[str]]] = []
    for name in candidates:
        if not _STEP_DIR.match(name):
            bad.append((name, [f"{pointer} names {name!r}, which is not a checkpoint's name"]))
            continue
        problems = check_checkpoint(os.path.join(root, name))
        if not problems:
            if bad:
                _set_aside(root, bad, chosen=name)
            return os.path.join(root, name)
        bad.append((name, problems))
    if not bad:
        return None
    raise RecoverError(
        f"{root} holds no usable recover checkpoint:\n"
        + _describe(bad)
        + f"\nTo start afresh, delete {root} (or the directories named) or run with "
        "recover_mode=disabled; a newer checkpoint cannot be rebuilt from a damaged one.  "
        "With max_recover_checkpoints=2 or more an older checkpoint is kept to fall back to."
    )


def _describe(bad: List[Tuple[str, List[str]]]) -> str:
    # "not a complete recover checkpoint" is the phrase users (and tests) grep for.
    return "\n".join(
        f"  {name} is not a complete recover checkpoint: {'; '.join(problems)}"
        for name, problems in bad
    )


def _set_aside(root: str, bad: List[Tuple[str, List[str]]], chosen: str) -> None:
    moved = []
    for name, _ in bad:
        src = os.path.join(root, name)
        if not _STEP_DIR.match(name) or not os.path.isdir(src):
            continue
        dst, i = src + _INVALID, 1
        while os.path.exists(dst):
            dst, i = f"{src}{_INVALID}{i}", i + 1
        os.rename(src, dst)
        moved.append(os.path.basename(dst))
    logger.warning(
        f"resuming from the older recover checkpoint {os.path.join(root, chosen)}; newer ones "
        f"are unusable:\n{_describe(bad)}"
        + (f"\nmoved aside as {', '.join(moved)} (delete them once inspected)" if moved else "")
    )


def read_master_state(ckpt_dir: str) -> Dict[str, Any]:
    """The master's state saved in ``ckpt_dir``."""
    path = os.path.join(ckpt_dir, MASTER_STATE)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RecoverError(
            f"cannot read {path} ({e}); delete {ckpt_dir} to resume from an older "
            "checkpoint, or run with recover_mode=disabled"
        ) from e


@contextlib.contextmanager
def _writing(ckpt_dir: str, path: str):
    """Turn a full disk while writing ``path`` into a :class:`CheckpointWriteError`."""
    try:
        yield
    except Exception as e:
        reason = no_space_reason(e)
        if reason is None:
            raise
        free = free_bytes(ckpt_dir)
        raise CheckpointWriteError(
            f"no space left for recover checkpoint {ckpt_dir}: {reason} while writing {path}"
            + (f" ({free} bytes free there)" if free is not None else "")
            + "; the previous recover checkpoint stays usable.  A commit needs room for one "
            "checkpoint more than max_recover_checkpoints keeps: free space on that file "
            "system, run with a fileroot on a larger one, or checkpoint less often "
            "(exp_ctrl.ckpt_freq_*)"
        ) from e


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


def _save_pt(obj: Any, ckpt_dir: str, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # Through a Python file object: torch.save to a path reports a full disk as
    # "unexpected pos", with the OSError lost; with a file object it is the context.
    with _writing(ckpt_dir, path), open(path, "wb") as f:
        torch.save(obj, f)


def _load_pt(ckpt_dir: str, path: str, what: str) -> Any:
    try:
        # weights_only=False: these are our own pickles (optimizer states hold
        # plain Python values next to tensors) from this run's own directory.
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise _damaged(ckpt_dir, path, what, e) from e


def _damaged(ckpt_dir: str, path: str, what: str, e: BaseException) -> RecoverError:
    return RecoverError(
        f"recover checkpoint {ckpt_dir}: cannot read {path} ({what}): {type(e).__name__}: {e}. "
        f"If the file is damaged, delete {ckpt_dir} to resume from an older checkpoint, or "
        "run with recover_mode=disabled to start afresh"
    )


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

    Raises :class:`CheckpointWriteError` when the disk is full.
    """
    written = []
    # No atomic writes needed for the .pt files: they go into the .tmp
    # directory, which nobody reads before commit() renames it.
    for name, iface in _stateful(interfaces).items():
        path = interface_state_path(ckpt_dir, name, rank)
        _save_pt(iface.state_dict(), ckpt_dir, path)
        written.append(path)
    if save_weights is None:
        save_weights = rank == 0
    if not isinstance(save_weights, Mapping):
        save_weights = {role: save_weights for role in trainable}
    for role, (model, engine) in trainable.items():
        # Data-parallel replicas hold identical weights, so replica 0 writes one copy;
        # the optimizer state is saved by every rank.
        if save_weights[role]:
            with _writing(ckpt_dir, model_dir(ckpt_dir, role)):
                model.save_trained(model_dir(ckpt_dir, role))  # (with LoRA: the adapters)
            if rank == 0:
                written.append(model_dir(ckpt_dir, role))
        path = optimizer_path(ckpt_dir, role, rank)
        _save_pt(engine.state_dict(), ckpt_dir, path)
        written.append(path)
    if loader_state is not None:
        path = data_state_path(ckpt_dir, rank)
        with _writing(ckpt_dir, path):
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
    model's ``load_trained`` (the whole model on this rank; with LoRA its adapters).  A
    file that is missing or cannot be read raises :class:`RecoverError` naming it.
    """
    for name, iface in _stateful(interfaces).items():
        path = interface_state_path(ckpt_dir, name, rank)
        if not os.path.exists(path):
            raise RecoverError(
                f"recover checkpoint {ckpt_dir} lacks {path} "
                f"(state of MFC {name!r}'s interface); "
                "resume with the same experiment config"
            )
        iface.load_state_dict(_load_pt(ckpt_dir, path, f"state of MFC {name!r}'s interface"))
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
        state = _load_pt(ckpt_dir, opath, f"optimizer state of {role!r}")
        try:
            if load_weights is None:
                model.load_trained(mdir)
            else:
                load_weights(role, mdir)
        except RecoverError:
            raise
        except Exception as e:
            raise _damaged(ckpt_dir, mdir, f"weights of {role!r}", e) from e
        engine.load_state_dict(state)
    if loader is not None:
        path = data_state_path(ckpt_dir, rank)
        if not os.path.exists(path):
            raise RecoverError(
                f"recover checkpoint {ckpt_dir} lacks {path}; "
                "resume with the same number of model workers"
            )
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise _damaged(ckpt_dir, path, "data position", e) from e
        loader.load_state_dict(state)
