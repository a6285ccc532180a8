"""What the launcher's console shows while a run goes, and the verdict at its end.

The master worker writes ``progress.json`` (the plan: total steps, first step) and
``metrics.jsonl`` (one line per step; step 0 is the evaluation before training) into the
run directory. :class:`RunConsole` follows both from the launcher's process — whatever the
launcher, as every process of a run shares its file root — and shows:

* on a terminal, a rich progress bar (step / total, samples/s, reward or loss, the last
  eval accuracy, staleness for async runs, time left); evaluations and the launcher's own
  log lines (worker failures and restarts, in colour) are printed above it;
* elsewhere (a pipe, a file), plain lines: the first step, every evaluation, the last
  step, and between them one line at most every ``interval`` seconds.

:func:`summarize` reads the same files into the run's summary, which the launcher prints
with :func:`format_summary` and saves as ``summary.json``; the warnings and errors the
launcher logged meanwhile (a worker lost or restarted, a relaunch) are listed in it as
incidents, so they stand out at the end too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from realhf.base import constants
from realhf.system.dag.outputs import accuracy_key

__all__ = ["RunConsole", "summarize", "format_summary", "read_records", "RecordTail"]

#: seconds between plain progress lines (evaluations and the last step always print)
PLAIN_INTERVAL_S = 10.0
#: incidents listed in the printed summary (summary.json has them all)
MAX_INCIDENTS_SHOWN = 8


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_records(path: str) -> List[Dict[str, Any]]:
    """The complete JSON lines of ``path`` ([] when absent); one per step, the last line
    of a step winning (a resumed run may have rewritten it)."""
    try:
        with open(path, "rb") as f:
            return _by_step(f.read())
    except FileNotFoundError:
        return []


def _by_step(data: bytes) -> List[Dict[str, Any]]:
    """The step records of the JSON lines in ``data``, one per step (the last line wins)."""
    by_step: Dict[int, Dict[str, Any]] = {}
    for line in data.splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


class RecordTail:
    """The step records appended to a JSON-lines file since the last :meth:`read`.

    The console polls ``metrics.jsonl`` every half second for the whole run; reading the
    file whole each time cost O(steps) per poll, O(steps²) over a run.  This keeps its
    offset and reads only what was appended, up to the last complete line (a line being
    written is read once it ends).  It starts over from the beginning when the file was
    replaced (another inode: a resumed run rewrites it atomically) or truncated (shorter
    than the offset).
    """

    def __init__(self, path: str):
        self.path = path
        self._file: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) being followed
        self._offset = 0

    def read(self) -> List[Dict[str, Any]]:
        """The records of the complete lines written since the last call, one per step."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            self._file, self._offset = None, 0
            return []
        with f:
            st = os.fstat(f.fileno())  # of the file opened, not of one that replaced it
            if (st.st_dev, st.st_ino) != self._file or st.st_size < self._offset:
                self._file, self._offset = (st.st_dev, st.st_ino), 0
            if st.st_size == self._offset:
                return []
            f.seek(self._offset)
            data = f.read(st.st_size - self._offset)
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        return _by_step(complete)


def _pick(record: Dict[str, Any], *suffixes: str) -> Optional[str]:
    """The first key of ``record`` (sorted) ending in one of ``suffixes``, tried in order,
    whose value is a finite number."""
    for suffix in suffixes:
        for k in sorted(record):
            if k.endswith(suffix) and _finite(record[k]):
                return k
    return None


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RunConsole:
    """Live progress of the run in ``run_dir`` on ``stream`` (default stdout), from a
    background thread; use as a context manager around the launch.

    Args:
        name: the quickstart command, shown at the start of plain lines.
        tty: rich bar (True) or plain lines (False); default: whether ``stream`` is one.
        interval: seconds between plain lines.
        poll_s: how often the files are read.
    """

    def __init__(
        self,
        name: str,
        run_dir: str,
        *,
        stream: Optional[TextIO] = None,
        tty: Optional[bool] = None,
        interval: float = PLAIN_INTERVAL_S,
        poll_s: float = 0.5,
    ):
        self.name = name
        self.run_dir = run_dir
        self.stream = sys.stdout if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self.interval = interval
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._shown: Dict[int, Dict[str, Any]] = {}  # step -> record already shown
        self._records = RecordTail(os.path.join(run_dir, "metrics.jsonl"))
        self._plan: Optional[Dict[str, Any]] = None
        self._first: Optional[tuple] = None  # (monotonic time, step) of the first step seen
        self._last_line = -math.inf
        self._accuracy: Optional[tuple] = None  # (step, value) of the last evaluation
        self._progress = None
        self._task = None
        #: the first line of every warning or error the launcher logged meanwhile (a worker
        #: lost or restarted, a relaunch): the summary lists them
        self.incidents: List[str] = []
        self._handler = _Incidents(self.incidents)

    # ---- thread -------------------------------------------------------------

    def __enter__(self) -> "RunConsole":
        logging.getLogger("realhf").addHandler(self._handler)
        self._thread = threading.Thread(target=self._loop, name="run-console", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.poll()  # the steps written since the last poll
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        logging.getLogger("realhf").removeHandler(self._handler)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as e:  # the display must never take the launch down
                print(f"{self.name}: progress display stopped: {e!r}", file=sys.stderr)
                return

    # ---- reading ------------------------------------------------------------

    def poll(self) -> None:
        """Show what the run wrote since the last call."""
        plan = _read_json(os.path.join(self.run_dir, "progress.json"))
        if plan is not None and plan != self._plan:
            self._plan = plan
            self._first = None  # a new attempt: its own rate
            # Steps past a resumed checkpoint are written again; show them again.
            self._shown = {s: r for s, r in self._shown.items() if s <= plan["start_step"]}
        if self._plan is None:
            return
        # Only what was appended since the last poll; a rewritten file is read anew, and
        # its records are shown again only where they differ from what was shown.
        for r in self._records.read():
            if self._shown.get(r["step"]) != r:
                self._shown[r["step"]] = r
                self._show(r)

    # ---- showing ------------------------------------------------------------

    def describe(self, r: Dict[str, Any]) -> str:
        """The text of one step's record (without step and ETA)."""
        parts = []
        if _finite(r.get("n_items")) and _finite(r.get("time")) and r["time"] > 0:
            parts.append(f"{r['n_items'] / r['time']:.1f} samples/s")
        key = _pick(r, "/task_reward", "/reward")
        loss = None if key else _pick(r, "/loss")
        if key:
            parts.append(f"reward {r[key]:.3g}")
        elif loss:
            parts.append(f"loss {r[loss]:.4g}")
        acc = accuracy_key(r)
        if acc:
            self._accuracy = (r["step"], r[acc])
        if self._accuracy is not None:
            parts.append(f"eval acc {self._accuracy[1]:.1%} @ step {self._accuracy[0]}")
        if _finite(r.get("rollout/staleness_mean")):
            parts.append(
                f"staleness {r['rollout/staleness_mean']:.2f}"
                f" max {r.get('rollout/staleness_max', float('nan')):.0f}"
            )
        return " | ".join(parts)

    def _eta(self, step: int, total: int) -> float:
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
            return math.nan
        t0, s0 = self._first
        return (now - t0) / (step - s0) * (total - step) if step > s0 else math.nan

    def _show(self, r: Dict[str, Any]) -> None:
        step, total = r["step"], self._plan["total_steps"]
        text = self.describe(r)
        if step == 0:  # the evaluation before training
            self._print(f"{self.name}: before training | {text}")
            return
        eta = self._eta(step, total)
        if self.tty:
            self._bar(step, total, text)
            if accuracy_key(r):
                self._print(f"step {step}/{total} | {text}")
            return
        now = time.monotonic()
        if now - self._last_line >= self.interval or step >= total or accuracy_key(r):
            self._last_line = now
            self._print(f"{self.name}: step {step}/{total} | {text} | ETA {_duration(eta)}")

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.stream, flush=True)

    def _bar(self, step: int, total: int, text: str) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            # The description last: a narrow terminal cuts it, not the bar.
            self._progress = Progress(
                TextColumn(f"[bold]{self.name}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=Console(file=self.stream, force_terminal=True),
            )
            start = self._plan["start_step"]
            self._task = self._progress.add_task("", total=total, completed=start)
            # Log lines (worker failures, restarts) go above the bar, not through it.
            self._progress.start()
        self._progress.update(self._task, completed=step, description=text)


class _Incidents(logging.Handler):
    """Keeps the first line of each warning or error record (of the realhf loggers)."""

    def __init__(self, out: List[str]):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        lines = record.getMessage().splitlines()
        self.out.append(f"{record.name}: {lines[0] if lines else ''}"[:200])


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


# ---- the verdict ------------------------------------------------------------------


def _eval_command(cfg, checkpoint: str, run_dir: str) -> Optional[str]:
    """The command that evaluates ``checkpoint`` on the run's held-out problems, for the
    math experiments (their config has ``dataset.eval_max_new_tokens``)."""
    dataset = getattr(cfg, "dataset", None)
    max_new = getattr(dataset, "eval_max_new_tokens", None)
    if max_new is None:
        return None
    data = getattr(dataset, "eval_path", "") or cfg.task
    args = [
        "python", "-m", "evaluation.eval_and_aggregate",
        "--model_path", checkpoint,
        "--data_names", data,
        "--output_path", os.path.join(run_dir, "eval"),
        "--max_gen_tokens", str(max_new),
    ]  # fmt: skip
    return shlex.join(args)


def summarize(
    name: str, run_dir: str, wall_s: float, cfg=None, incidents: Sequence[str] = ()
) -> Dict[str, Any]:
    """The run's summary from the files in ``run_dir``: accuracy at the start and the end
    (and the loss or reward where there is no evaluation), trained samples, throughput,
    staleness, the last checkpoint and the command that evaluates it, and the launcher's
    ``incidents`` (:attr:`RunConsole.incidents`)."""
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    steps = [r for r in records if r["step"] >= 1]
    plan = _read_json(os.path.join(run_dir, "progress.json")) or {}
    out: Dict[str, Any] = {
        "experiment": name,
        "run_dir": run_dir,
        "wall_time_s": round(wall_s, 1),
        "steps": steps[-1]["step"] if steps else 0,
        "total_steps": plan.get("total_steps"),
    }
    samples = sum(r.get("n_items", 0) for r in steps)
    train_s = sum(r.get("time", 0.0) for r in steps)
    out["trained_samples"] = samples
    out["samples_per_s"] = round(samples / train_s, 2) if train_s > 0 else None
    out["samples_per_s_wall"] = round(samples / wall_s, 2) if wall_s > 0 else None
    evals = [(r["step"], r[k], k) for r in records for k in [accuracy_key(r)] if k]
    if evals:
        out["accuracy"] = {
            "key": evals[-1][2],
            "start": evals[0][1],
            "start_step": evals[0][0],
            "final": evals[-1][1],
            "final_step": evals[-1][0],
        }
        for k in sorted({k for r in records for k in r if k.startswith("eval/") and "pass@" in k}):
            vals = [(r["step"], r[k]) for r in records if _finite(r.get(k))]
            out.setdefault("pass_at_k", {})[k] = {"start": vals[0][1], "final": vals[-1][1]}
    elif steps:
        key = _pick(steps[0], "/task_reward", "/reward") or _pick(steps[0], "/loss")
        if key:
            vals = [r[key] for r in steps if _finite(r.get(key))]
            out["trend"] = {"key": key, "first": vals[0], "last": vals[-1]}
    stale = [r for r in steps if _finite(r.get("rollout/staleness_mean"))]
    if stale:
        out["staleness"] = {
            "mean": round(sum(r["rollout/staleness_mean"] for r in stale) / len(stale), 3),
            "max": max(r.get("rollout/staleness_max", 0) for r in stale),
        }
    out["incidents"] = list(incidents)
    # The newest checkpoint of the policy (of another role when no actor is trained).
    ckpts = constants.hf_checkpoints(run_dir)
    ckpts = [c for c in ckpts if c[1] == "actor"] or ckpts
    out["checkpoint"] = ckpts[-1][2] if ckpts else None
    if ckpts and cfg is not None:
        out["evaluate"] = _eval_command(cfg, ckpts[-1][2], run_dir)
    return out


def format_summary(s: Dict[str, Any]) -> str:
    """The summary block printed at the end of a run."""
    rule = "=" * 72
    lines = [rule, f"{s['experiment']}: run summary ({s['run_dir']})"]
    steps = f"{s['steps']}" + (f" of {s['total_steps']}" if s.get("total_steps") else "")
    lines.append(f"  wall time        {_duration(s['wall_time_s'])} ({steps} steps)")
    rate = f"{s['samples_per_s']} samples/s over the training steps" if s["samples_per_s"] else ""
    lines.append(f"  trained samples  {s['trained_samples']}" + (f" ({rate})" if rate else ""))
    acc = s.get("accuracy")
    if acc:
        gain = (acc["final"] - acc["start"]) * 100
        lines.append(
            f"  {acc['key']:<16} {acc['start']:.1%} (step {acc['start_step']}) -> "
            f"{acc['final']:.1%} (step {acc['final_step']}), {gain:+.1f} points"
        )
    for k, v in (s.get("pass_at_k") or {}).items():
        lines.append(f"  {k:<16} {v['start']:.1%} -> {v['final']:.1%}")
    if s.get("trend"):
        t = s["trend"]
        lines.append(f"  {t['key']}: {t['first']:.4g} (first step) -> {t['last']:.4g} (last)")
    if s.get("staleness"):
        st = s["staleness"]
        lines.append(f"  staleness        mean {st['mean']:.2f}, max {st['max']:.0f}")
    incidents = s.get("incidents") or []
    if incidents:
        lines.append(f"  incidents        {len(incidents)} warnings/errors while it ran:")
        lines += [f"    ! {line}" for line in incidents[:MAX_INCIDENTS_SHOWN]]
        if len(incidents) > MAX_INCIDENTS_SHOWN:
            lines.append(f"    ... all {len(incidents)} in summary.json")
    lines.append(f"  checkpoint       {s.get('checkpoint') or 'none saved'}")
    if s.get("evaluate"):
        lines.append(f"  evaluate it with {s['evaluate']}")
    lines.append(f"  summary.json, metrics.jsonl, curves.png in {s['run_dir']}")
    lines.append(rule)
    return "\n".join(lines)
