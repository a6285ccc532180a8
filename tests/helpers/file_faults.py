"""Faults of a run's files and disks, injected from outside (truncated weights, bad rows, a
full disk) by reliability tests and the fault matrix (benchmark/fault_matrix.py).

    from file_faults import inject, KINDS
    fault = inject("truncated_weights", run_dir)        # damage the newest recover checkpoint
    fault = inject("bad_row", "train.jsonl", out=copy)  # a dataset row that fails mid-run
    with inject("full_disk", recover_dir, size=40 << 20):   # a real 40 MiB tmpfs
        ...                                                 # unmounted on exit
    print(fault.kind, fault.path, fault.detail, fault.expect)

Every fault is real: files are cut short or overwritten on disk, a full disk is a real
small file system (``mount -t tmpfs``, needs root or CAP_SYS_ADMIN) or a real file-size
limit (``RLIMIT_FSIZE`` of this process and the children it starts afterwards), a bad row is
a line of a real jsonl file.  ``inject`` returns a :class:`Fault` naming what was done and
the outcome the system promises (``expect``); :meth:`Fault.undo` (or leaving its ``with``
block) undoes what can be undone (a mount, a limit).  A fault this machine cannot make
raises :class:`FaultUnavailable` (tests skip on it).

Kinds (``KINDS``) and their targets:

* checkpoint damage — target: a run directory, a recover root, or one ``step{N}``
  directory (default: the one ``latest`` names).  ``truncated_weights`` (the first
  ``model.safetensors`` cut to half), ``truncated_optimizer`` (an optimizer ``.pt`` cut to
  half), ``garbage_master`` (``master.json`` overwritten with non-JSON), ``garbage_weights``
  (the weights' first bytes overwritten, same size), ``missing_file`` (a data position file
  deleted), ``dangling_latest`` (``latest`` names a directory that does not exist),
  ``no_manifest`` (the manifest deleted: a checkpoint as written before manifests; combine
  with another kind to damage an old-style checkpoint).
* ``full_disk`` — target: a directory (created if missing, must be empty); option ``size``
  (bytes).  ``file_size_limit`` — target: ignored; option ``size`` (bytes per file).
* ``bad_row`` — target: a math jsonl file; options ``how`` (``unparsable``: solutions with
  no readable answer, the default; ``not_string``: a number where a string belongs;
  ``no_solutions``), ``row`` (index, default the middle row), ``out`` (write a modified copy
  there instead of changing the file; required for the embedded assets).

For the fault matrix, ``SCENARIOS`` lists ``(name, experiment, expected outcome, strike)``,
``strike`` naming a function of this module: ``strike(run)`` is called right after the run
started, with the matrix's run object (its ``run_dir``, ``wait_step(step, timeout)``,
``workers(type)`` and ``proc``), injects the fault at its moment and returns a note.  A bad
row needs the run launched on a modified dataset: :func:`bad_row_args` writes one and
returns the launch arguments (``dataset.path=...``), for a harness that can pass them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
from typing import Callable, Optional

__all__ = [
    "inject",
    "Fault",
    "FaultUnavailable",
    "KINDS",
    "newest_checkpoint",
    "small_filesystem",
    "bad_row_args",
    "SCENARIOS",
]


class FaultUnavailable(RuntimeError):
    """This machine cannot make the fault (e.g. mount is not permitted)."""


@dataclasses.dataclass
class Fault:
    """One injected fault: ``kind``, the ``path`` changed, what was done (``detail``) and
    the outcome the system promises (``expect``)."""

    kind: str
    path: str
    detail: str
    expect: str
    row_id: Optional[str] = None
    _undo: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False)

    def undo(self) -> None:
        """Undo what can be undone (unmount, lift a limit); a no-op for damaged files."""
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()

    def __enter__(self) -> "Fault":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


_FALLBACK = (
    "resume falls back to the newest usable checkpoint with a warning naming the damage; with "
    "none usable, RecoverError naming it and how to start afresh"
)
_FULL = (
    "CheckpointWriteError 'no space left ...' naming the checkpoint directory; the .tmp "
    "directory removed, the previous checkpoint still usable; the run fails"
)
_BAD_ROW = (
    "the row is skipped with a warning naming its id and counted (math_reward/bad_rows); "
    "BadRowsError naming the rows once more than max_bad_row_fraction of them failed"
)


def newest_checkpoint(target: str) -> str:
    """The ``step{N}`` directory a checkpoint fault damages: ``target`` itself, or the one
    ``latest`` names under ``target`` (a recover root) or ``target/checkpoints/recover``."""
    if os.path.basename(os.path.normpath(target)).startswith("step"):
        return target
    root = os.path.join(target, "checkpoints", "recover")
    root = root if os.path.isdir(root) else target
    with open(os.path.join(root, "latest")) as f:
        return os.path.join(root, f.read().strip())


def _find(ckpt: str, top: str, name: str) -> str:
    base = os.path.join(ckpt, top)
    for d, _, files in sorted(os.walk(base)):
        for f in sorted(files):
            if f.endswith(name):
                return os.path.join(d, f)
    raise FileNotFoundError(f"no *{name} under {base}")


def _truncate(kind: str, path: str) -> Fault:
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    return Fault(kind, path, f"cut {path} from {size} to {size // 2} bytes", _FALLBACK)


def _checkpoint_fault(kind: str, target: str) -> Fault:
    if kind == "dangling_latest":
        root = os.path.dirname(newest_checkpoint(target))
        name = "step999999"
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(name)
        return Fault(kind, os.path.join(root, "latest"), f"latest names {name}", _FALLBACK)
    ckpt = newest_checkpoint(target)
    if kind == "truncated_weights":
        return _truncate(kind, _find(ckpt, "models", ".safetensors"))
    if kind == "truncated_optimizer":
        return _truncate(kind, _find(ckpt, "optimizer", ".pt"))
    if kind == "garbage_master":
        path = os.path.join(ckpt, "master.json")
        with open(path, "w") as f:
            f.write("\x00garbage{not json")
        return Fault(kind, path, f"overwrote {path} with non-JSON", _FALLBACK)
    if kind == "garbage_weights":
        path = _find(ckpt, "models", ".safetensors")
        with open(path, "r+b") as f:
            f.write(b"\xff" * 64)
        return Fault(kind, path, f"overwrote the first 64 bytes of {path}", _FALLBACK)
    if kind == "missing_file":
        path = _find(ckpt, "data", ".json")
        os.remove(path)
        return Fault(kind, path, f"deleted {path}", _FALLBACK)
    if kind == "no_manifest":
        path = os.path.join(ckpt, "manifest.json")
        os.remove(path)
        return Fault(
            kind,
            path,
            f"deleted {path} (an old-style checkpoint)",
            "loads as before; damage fails the load with RecoverError naming the file",
        )
    raise AssertionError(kind)


def _full_disk(target: str, size: int) -> Fault:
    os.makedirs(target, exist_ok=True)
    if os.listdir(target):
        raise ValueError(f"full_disk: {target} is not empty; a mount would hide its files")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={int(size)}", "tmpfs", target],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise FaultUnavailable(f"cannot mount a tmpfs on {target}: {r.stderr.strip()}")

    def unmount():
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)

    return Fault("full_disk", target, f"a {size}-byte tmpfs on {target}", _FULL, _undo=unmount)


def _file_size_limit(size: int) -> Fault:
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Ignored, the signal a write past the limit sends turns into EFBIG from write();
    # delivered, it would kill the process.
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(size), old_limit[1]))

    def lift():
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)

    return Fault(
        "file_size_limit", "", f"RLIMIT_FSIZE={size} bytes in pid {os.getpid()}", _FULL, _undo=lift
    )


def small_filesystem(target, size: int) -> Fault:
    """``full_disk`` on ``target`` where mount is permitted, else ``file_size_limit``: either
    way a write of more than ``size`` bytes into ``target`` fails for lack of space."""
    try:
        return inject("full_disk", target, size=size)
    except FaultUnavailable:
        os.makedirs(target, exist_ok=True)
        return inject("file_size_limit", None, size=size)


_BAD_SOLUTIONS = {"unparsable": ["\\boxed{}"], "not_string": [42], "no_solutions": []}


def _bad_row(path: str, how: str = "unparsable", row: Optional[int] = None, out=None) -> Fault:
    if how not in _BAD_SOLUTIONS:
        raise ValueError(f"bad_row: how={how!r}; use one of {sorted(_BAD_SOLUTIONS)}")
    if out is None and f"{os.sep}assets{os.sep}" in os.path.abspath(path):
        raise ValueError(f"bad_row: {path} is an embedded asset; pass out= for a copy")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    i = len(rows) // 2 if row is None else row
    rows[i]["solutions"] = _BAD_SOLUTIONS[how]
    out = str(out or path)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rid = str(rows[i]["query_id"])
    return Fault(
        "bad_row",
        out,
        f"row {i} ({rid!r}) of {out}: solutions={rows[i]['solutions']}",
        _BAD_ROW,
        row_id=rid,
    )


_CHECKPOINT_KINDS = (
    "truncated_weights",
    "truncated_optimizer",
    "garbage_master",
    "garbage_weights",
    "missing_file",
    "dangling_latest",
    "no_manifest",
)
#: every kind ``inject`` knows
KINDS = _CHECKPOINT_KINDS + ("full_disk", "file_size_limit", "bad_row")


def inject(kind: str, target, **options) -> Fault:
    """Make fault ``kind`` on ``target`` (see the module docstring); returns the Fault."""
    target = os.fspath(target) if target is not None else ""
    if kind in _CHECKPOINT_KINDS:
        if options:
            raise TypeError(f"{kind} takes no options, got {sorted(options)}")
        return _checkpoint_fault(kind, target)
    if kind == "full_disk":
        return _full_disk(target, **options)
    if kind == "file_size_limit":
        return _file_size_limit(**options)
    if kind == "bad_row":
        return _bad_row(target, **options)
    raise ValueError(f"unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")


# ---- scenarios of the fault matrix (benchmark/fault_matrix.py) -----------------------------------

#: seconds a strike waits for the step it strikes at
_STRIKE_WAIT_S = 300.0
#: seconds a mount outlives the start of its run at most
_RUN_LIMIT_S = 3600.0


def strike_corrupt_checkpoint(run) -> str:
    """After step 5 (the step-4 checkpoint is committed after step 4's line), cut the newest
    checkpoint's weights short and kill the master: the relaunch finds it damaged (with
    max_recover_checkpoints=1 nothing older is kept, so it stops naming the damage; with 2
    it resumes from the older one)."""
    if not run.wait_step(5, _STRIKE_WAIT_S):
        return "not reached"
    fault = inject("truncated_weights", run.run_dir)
    for p in run.workers("master_worker")[:1]:
        p.kill()
    return fault.detail


def strike_full_disk(run) -> str:
    """A tmpfs with room for one checkpoint of the tiny model under the recover root, from
    the start: the second checkpoint does not fit; unmounted when the run ends."""
    import threading

    fault = inject("full_disk", os.path.join(run.run_dir, "checkpoints", "recover"), size=45 << 20)

    def undo_when_done():
        try:
            run.proc.wait(timeout=_RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            pass  # the matrix kills runs long before: unmount anyway
        fault.undo()

    threading.Thread(target=undo_when_done, daemon=True).start()
    return fault.detail


def bad_row_args(root, how: str = "unparsable", n_rows: int = 64) -> list:
    """Write the first ``n_rows`` rows of the embedded data with one bad row (``how``) under
    ``root``; returns the launch arguments that train on it."""
    from realhf.experiments.building_blocks import TINY_TRAIN

    os.makedirs(root, exist_ok=True)
    src = os.path.join(root, "rows.jsonl")
    with open(TINY_TRAIN) as f, open(src, "w") as out:
        out.writelines(line for _, line in zip(range(n_rows), f))
    fault = inject("bad_row", src, how=how, out=os.path.join(root, f"bad-{how}.jsonl"))
    return [f"dataset.path={fault.path}"]


#: (name, experiment, expected outcome, name of the strike function) for benchmark/fault_matrix.py
SCENARIOS = (
    ("sync-corrupt-checkpoint", "ppo-math", "error", "strike_corrupt_checkpoint"),
    ("sync-full-disk-checkpoint", "ppo-math", "error", "strike_full_disk"),
)
