"""What the master writes while a run goes: metrics, tensorboard, trace, progress, curves.

* ``metrics.jsonl`` — one flat JSON object per step (:class:`MetricsLog`); a resumed run
  first drops the lines of steps after its checkpoint, so every step appears once.
* ``tensorboard/`` — the same numbers as scalars (``SummaryWriter``, purged past the
  checkpoint on resume).
* ``wandb/`` — the same numbers in a Weights & Biases run when ``wandb.mode`` is
  ``offline`` or ``online`` (:class:`WandbLog`).
* ``trace.json`` — Chrome trace events (open in Perfetto or chrome://tracing): one
  complete ("X") event per MFC call per worker (:class:`TraceLog`).
* progress — a log line per step in the master's log (:class:`ProgressDisplay`).
* ``curves.png`` — the selected statistics against the step, drawn at the end
  (:func:`plot_curves`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

from realhf.base import logging
from realhf.base.storage.atomic_file import write_atomic

logger = logging.getLogger("master_worker", "system")

__all__ = [
    "MetricsLog",
    "TensorBoardLog",
    "WandbLog",
    "TraceLog",
    "ProgressDisplay",
    "accuracy_key",
    "plot_curves",
    "select_keys",
]

DEFAULT_PROGRESS_KEYS = ("reward", "loss")


def select_keys(keys: Iterable[str], patterns: Sequence[str]) -> List[str]:
    """Keys containing any of ``patterns`` (default: ``reward`` or ``loss``), sorted."""
    patterns = tuple(patterns) or DEFAULT_PROGRESS_KEYS
    return sorted(k for k in keys if any(p in k for p in patterns))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per step (key ``step`` is the global step, from 1).

    Args:
        path: the file.
        resume_step: on resume, the checkpoint's step: lines of later steps (written by the
            run that died) are dropped.  None: a fresh run, the file starts empty.
    """

    def __init__(self, path: str, resume_step: Optional[int] = None):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        kept: List[str] = []
        if resume_step is not None and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError):  # a line cut by the crash
                        continue
        # Atomically: a crash while rewriting must not lose the kept history too.
        write_atomic(path, "".join(kept))

    def write(self, record: Dict[str, Any]) -> None:
        """Append one step's record."""
        with open(self.path, "a") as f:
            # NaN stats (e.g. a mean over an empty mask) are written as NaN, which Python's
            # json reads back, rather than failing the step.
            f.write(json.dumps(record, allow_nan=True) + "\n")


class TensorBoardLog:
    """Every number of a step's record as a tensorboard scalar under ``tensorboard/``."""

    def __init__(self, log_dir: str, resume_step: Optional[int] = None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge)

    def write(self, step: int, record: Dict[str, Any]) -> None:
        """Add every finite number of ``record`` at ``step``."""
        for k, v in record.items():
            if k != "step" and _finite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close."""
        self.writer.close()


def wandb_run_id(experiment: str, trial: str) -> str:
    """The W&B run id of a trial: the same on every attempt, so a resumed run continues it.

    W&B ids allow letters, digits, ``-``, ``_`` and ``.``, at most 64 characters; other
    characters become ``-`` and a longer id is cut and given a hash of the full name.
    """
    full = f"{experiment}_{trial}"
    run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", full)
    if len(run_id) > 64:
        run_id = run_id[:55] + "-" + hashlib.sha1(full.encode()).hexdigest()[:8]
    return run_id


class WandbLog:
    """Every number of a step's record in a Weights & Biases run.

    ``offline`` writes ``{run_dir}/wandb/offline-run-*/run-{id}.wandb`` without touching
    the network (``wandb sync`` uploads it); ``online`` streams to the W&B server.  The run
    id comes from experiment and trial (:func:`wandb_run_id`) and is resumed when it exists,
    so a recovered run continues the same W&B run.  Records carry the global step as the
    metric ``step``, the x axis of every chart: unlike W&B's own ``_step``, which must only
    grow, it may repeat the steps a crashed attempt logged past its checkpoint.

    Args:
        cfg: the ``wandb.*`` options (:class:`~realhf.api.wandb_args.WandbConfig`);
            ``mode=disabled`` makes this a no-op that does not import wandb.
        run_dir: where the ``wandb/`` directory goes.
        experiment, trial: the run's names (default project and display name, the id).
        config_dict: the resolved experiment config, the W&B run's config.
        resume_step: on resume, the checkpoint's step (None: a fresh run).
    """

    def __init__(
        self,
        cfg,
        run_dir: str,
        experiment: str,
        trial: str,
        config_dict: Optional[Dict[str, Any]] = None,
        resume_step: Optional[int] = None,
    ):
        self.run = None
        if cfg.mode == "disabled":
            return
        # Never prompt for a login (a missing key is an error instead) and keep wandb's
        # own chatter out of the master's log.
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:
            raise ImportError(
                f"wandb.mode={cfg.mode!r} needs the wandb package: pip install 'realhf[wandb]' "
                "(or set wandb.mode=disabled)"
            ) from None
        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(
            mode=cfg.mode,
            project=cfg.project or experiment,
            entity=cfg.entity or None,
            name=cfg.name or f"{experiment}/{trial}",
            group=cfg.group or None,
            job_type=cfg.job_type or None,
            notes=cfg.notes or None,
            tags=list(cfg.tags) or None,
            dir=run_dir,
            id=wandb_run_id(experiment, trial),
            resume="allow",
            config=config_dict,
            # The master's stdout stays its own (rich progress bar, log lines).
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if cfg.mode == "online":
            where = self.run.url
        else:  # the offline-run-* directory (run.dir is its files/)
            where = f"{os.path.dirname(self.run.dir)}; upload it with `wandb sync DIR`"
        resumed = "" if resume_step is None else f" (resumed at step {resume_step})"
        logger.info(f"W&B {cfg.mode} run {self.run.id}{resumed}: {where}")

    def write(self, step: int, record: Dict[str, Any]) -> None:
        """Log every finite number of ``record`` at ``step``."""
        if self.run is None:
            return
        data = {k: v for k, v in record.items() if k != "step" and _finite(v)}
        self.run.log({**data, "step": step})

    def close(self, exit_code: int = 1) -> None:
        """Finish the run: ``exit_code`` 0 marks it finished, else failed (the default, for
        shutdown paths that close a run which did not complete)."""
        if self.run is not None:
            import wandb

            run, self.run = self.run, None
            run.finish(exit_code=exit_code)
            # finish() returns before wandb's service has written everything out (offline,
            # the .wandb file may still be empty); teardown waits for it and stops it.
            wandb.teardown()


class TraceLog:
    """``trace.json`` in Chrome's JSON-array format, appended as events come.

    Processes are numbered: 0 is the master, ``i + 1`` is ``model_worker/i``.  The file is
    closed with ``]`` by :meth:`close`; a resumed run reopens and continues it.
    """

    def __init__(self, path: str, process_names: Sequence[str], resume: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.pids = {name: i for i, name in enumerate(process_names)}
        kept = []
        if resume and os.path.exists(path):
            # One event per line: keep the complete ones (a killed run may have cut the last).
            with open(path) as f:
                for line in f:
                    line = line.strip().rstrip(",")
                    if line in ("[", "]", ""):
                        continue
                    try:
                        json.loads(line)
                    except ValueError:
                        break
                    kept.append(line)
        prefix = "[\n" + "".join(f"{e},\n" for e in kept)
        self._f = open(path, "w")
        self._f.write(prefix)
        for name, pid in self.pids.items():
            self._event(
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            )
        self._f.flush()

    def _event(self, ev: Dict[str, Any]) -> None:
        self._f.write(json.dumps(ev) + ",\n")

    def complete(
        self, name: str, process: str, start: float, end: float, tid: str = "main", **args
    ) -> None:
        """One "X" event: ``name`` ran on ``process`` from ``start`` to ``end`` (wall seconds)."""
        self._event(
            {
                "name": name,
                "ph": "X",
                "pid": self.pids.get(process, 0),
                "tid": tid,
                "ts": round(start * 1e6),
                "dur": max(0, round((end - start) * 1e6)),
                "args": args,
            }
        )

    def flush(self) -> None:
        """Push events to the file."""
        self._f.flush()

    def close(self) -> None:
        """Finish the JSON array."""
        if self._f.closed:
            return
        self._f.write(
            json.dumps(
                {
                    "name": "trace_end",
                    "ph": "i",
                    "s": "g",
                    "pid": 0,
                    "tid": "main",
                    "ts": round(time.time() * 1e6),
                }
            )
            + "\n]\n"
        )
        self._f.close()


def accuracy_key(record: Dict[str, Any]) -> Optional[str]:
    """The eval accuracy of a step record: ``eval/greedy_acc``, else another finite
    ``eval/`` key with ``acc`` in it (None: the step ran no evaluation)."""
    if _finite(record.get("eval/greedy_acc")):
        return "eval/greedy_acc"
    keys = [k for k in sorted(record) if k.startswith("eval/") and "acc" in k]
    return next((k for k in keys if _finite(record[k])), None)


class ProgressDisplay:
    """Step progress in the master's log: one line per step (at most one per ``interval``
    seconds, and always the last), with the epoch, the selected statistics (``reward`` /
    ``loss`` by default), the last eval accuracy, tokens/s and the time left.

    The master's stdout is a log file under every launcher; the live bar a person watches
    is the launcher's (:class:`realhf.apps.console.RunConsole`, from ``metrics.jsonl``).
    """

    def __init__(
        self, total_steps: int, start_step: int, patterns: Sequence[str], interval: float = 0.0
    ):
        self.total = total_steps
        self.start_step = start_step
        self.patterns = tuple(patterns)
        self.interval = interval
        self.t0 = time.monotonic()
        self._last_line = 0.0
        self.accuracy: Optional[float] = None

    def summary(self, record: Dict[str, Any]) -> str:
        """The text shown for one step's record."""
        parts = [f"epoch {record.get('epoch')}"]
        for k in select_keys(record, self.patterns):
            if _finite(record[k]):
                parts.append(f"{k}={record[k]:.4g}")
        key = accuracy_key(record)
        if key is not None:
            self.accuracy = record[key]
        if self.accuracy is not None:
            parts.append(f"accuracy={self.accuracy:.3f}")
        if _finite(record.get("tokens_per_s")):
            parts.append(f"{record['tokens_per_s']:.0f} tok/s")
        return " | ".join(parts)

    def update(self, record: Dict[str, Any]) -> None:
        """Log step ``record['step']``."""
        step = record["step"]
        text = self.summary(record)
        now = time.monotonic()
        if now - self._last_line < self.interval and step < self.total:
            return
        self._last_line = now
        done = step - self.start_step
        eta = (now - self.t0) / done * (self.total - step) if done > 0 else float("nan")
        eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if math.isfinite(eta) else "?"
        logger.info(f"step {step}/{self.total} | {text} | ETA {eta_s}")


def plot_curves(metrics_path: str, out_path: str, patterns: Sequence[str]) -> Optional[str]:
    """Draw the selected statistics (and eval metrics) of ``metrics.jsonl`` against the step.

    Returns ``out_path``, or None when there is nothing to draw.
    """
    records = []
    with open(metrics_path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    keys = sorted(
        set(select_keys({k for r in records for k in r}, patterns))
        | {k for r in records for k in r if k.startswith("eval/")}
    )
    if not records or not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        pts = [(r["step"], r[k]) for r in records if _finite(r.get(k))]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 50 else None)
        ax.set_ylabel(k, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
