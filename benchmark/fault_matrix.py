"""The fault matrix: real runs, real faults, and what each one cost.

Every scenario starts a short ``ppo-math`` (sync) or ``async-ppo-math`` run with
``recover_mode=auto`` in a subprocess, injects one fault at a chosen point, waits for the run
to end (or for ``--timeout``: a run still going then is a HANG), and reads the run's own
records: ``metrics.jsonl`` (one line per step, replayed steps again), ``trajectories.jsonl``
(which indices each step trained), the launcher's output and the workers' logs.

Faults (``--list`` prints every scenario):

* ``kill`` (SIGKILL) / ``hang`` (SIGSTOP: alive but silent) of one worker of each kind, at
  three points: ``early`` (after step 1), ``mid`` (after step 4 of 8) and ``ckpt`` (while the
  step-4 recover checkpoint is being written: the harness polls for ``step4.tmp`` and strikes
  when it appears; if the write is too quick to catch it strikes at the step-4 line and says so);
* a generation server that answers slowly, one that cuts every 5th answer off mid-response,
  a weight update that fails twice on one of two servers (``$REALHF_FAULTS``,
  :mod:`realhf.base.worker_faults`);
* etcd stopped for 10 s (less than the name-resolve outage tolerance: the run rides it out)
  and for 45 s (more: the workers give up, the relaunch waits for etcd);
* a full disk while a checkpoint is written, a corrupted recover checkpoint, a dataset row
  that fails mid-run (injected by ``tests/helpers/file_faults.py``).

Columns: ``outcome`` (``partial``: the lost worker was restarted alone; ``relaunch``: every
worker was relaunched from the last checkpoint; ``rode out``: nothing restarted; ``error``:
the run stopped with the error shown), ``ok`` (the outcome is the one defined for the fault),
``detect`` (injection -> the first log line reacting to it), ``recover`` (injection -> the run
passes the step it had reached), ``lost`` (training time lost: over the steps after the fault,
the sum of each step's time beyond a normal step — the median step before — so a stall that
comes later, once queued trajectories are used up, counts too), ``replayed`` (steps trained
again after a relaunch), ``traj`` (trajectory indices
missing / prompts trained twice in the final record; async only), ``stale`` (largest
staleness of a trained trajectory; async only).

Run everything (about 45 minutes on the 2-core VM with ``--parallel 2``)::

    python benchmark/fault_matrix.py --parallel 2 --write benchmark/results/faults.md

or a subset: ``--only async-kill`` (substring match on scenario names).
The last line printed is a JSON object with the counts of scenarios, hangs and mismatches.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))

import psutil  # noqa: E402

STEPS, CKPT_EVERY, B, ETA = 8, 2, 4, 1
COMMON = [
    f"train_batch_size={B}",
    "ppo.group_size=2",
    "ppo.gen.max_new_tokens=6",
    f"exp_ctrl.benchmark_steps={STEPS}",
    f"exp_ctrl.ckpt_freq_steps={CKPT_EVERY}",
    "eval=false",
    "recover_mode=auto",
    "recover_retries=2",
    "worker_timeout=120",
]
ASYNC = ["new_tokens_per_chunk=2", f"max_head_offpolicyness={ETA}"]
POINTS = {"early": 1, "mid": 4, "ckpt": 4}
RESTARTABLE = ("generation_server", "rollout_worker")


@dataclasses.dataclass
class Scenario:
    name: str
    exp: str
    #: kill | hang | env | etcd | helper
    kind: str
    #: defined outcome: partial | relaunch | rode out | error ("a|b": either)
    expect: str
    target: str = ""
    point: str = "mid"
    args: List[str] = dataclasses.field(default_factory=list)
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: for kind=etcd: seconds etcd is down; for kind=helper: the injection's name
    param: object = None


def scenarios() -> List[Scenario]:
    out = []
    kinds = {
        "async": [
            "generation_server",
            "rollout_worker",
            "gserver_manager",
            "model_worker",
            "master_worker",
        ],
        "sync": ["model_worker", "master_worker"],
    }
    for mode, workers in kinds.items():
        exp = "async-ppo-math" if mode == "async" else "ppo-math"
        for w in workers:
            for fault in ("kill", "hang"):
                for point in POINTS:
                    out.append(
                        Scenario(
                            f"{mode}-{fault}-{w}-{point}",
                            exp,
                            fault,
                            "partial" if w in RESTARTABLE else "relaunch",
                            target=w,
                            point=point,
                            # hold each checkpoint 3 s before its commit: a window to strike
                            env=(
                                {"REALHF_FAULTS": "master_worker/0:slow_checkpoint=3"}
                                if point == "ckpt"
                                else {}
                            ),
                        )
                    )
    two = ["allocation_mode=gen.d2p1m1+d1p1m1"]
    # The same losses with a spare: two servers / two rollout workers, one of them killed.
    for w, args in (
        ("generation_server", two),
        ("rollout_worker", ["n_rollout_workers=2"]),
    ):
        out.append(
            Scenario(f"async-2x-kill-{w}-mid", "async-ppo-math", "kill", "partial", w, args=args)
        )
    out += []
    # A server killed, hung or slow while it loads new weights, for each way of sending them:
    # it waits slow_update seconds in every load (logging it), and the harness strikes then.
    # The other server finishes the update; the run goes on; the lost one is replaced and
    # joins at the current version.
    for sync in ("disk", "shm", "broadcast"):
        slow = {"REALHF_FAULTS": "generation_server/0:slow_update=2"}
        sync_args = two + [f"weight_sync={sync}", "flush_request_timeout=15"]
        out += [
            Scenario(
                f"async-2x-{fault}-server-in-update-{sync}",
                "async-ppo-math",
                fault,
                "partial",
                "generation_server",
                point="update",
                args=sync_args,
                env=slow,
            )
            for fault in ("kill", "hang")
        ]
        out.append(
            Scenario(
                f"async-2x-slow-update-{sync}",
                "async-ppo-math",
                "env",
                "rode out",
                args=sync_args,
                env=slow,
            )
        )
    out += [
        Scenario(
            "async-slow-server",
            "async-ppo-math",
            "env",
            "rode out",
            env={"REALHF_FAULTS": "generation_server/0:slow_generate=0.5"},
        ),
        # A member whose calls fail max_server_failures + 1 = 4 times in a row fails its
        # rollout, and so its rollout worker, which is then restarted: with every 5th answer
        # cut off that happens in about a quarter of the runs.
        Scenario(
            "async-drop-responses",
            "async-ppo-math",
            "env",
            "rode out|partial",
            env={"REALHF_FAULTS": "generation_server/0:drop_generate=5"},
        ),
        Scenario(
            "async-update-fails-on-1-of-2",
            "async-ppo-math",
            "env",
            "rode out",
            args=two,
            env={"REALHF_FAULTS": "generation_server/1:fail_update=2"},
        ),
        Scenario(
            # the fault is in every process of the server, relaunched ones too: each attempt
            # stops at its first update, and the run ends naming the server and the step
            "async-update-fails-on-only-server",
            "async-ppo-math",
            "env",
            "error",
            env={"REALHF_FAULTS": "generation_server/0:fail_update=1"},
        ),
        Scenario("sync-etcd-down-10s", "ppo-math", "etcd", "rode out", param=10),
        Scenario("async-etcd-down-10s", "async-ppo-math", "etcd", "rode out", param=10),
        Scenario("sync-etcd-down-45s", "ppo-math", "etcd", "relaunch", param=45),
        # injected by tests/helpers/file_faults.py (param: its strike function)
        Scenario(
            "sync-full-disk-at-checkpoint", "ppo-math", "helper", "error", param="strike_full_disk"
        ),
        Scenario(
            "sync-corrupt-checkpoint-kept-1",
            "ppo-math",
            "helper",
            "error",
            param="strike_corrupt_checkpoint",
        ),
        Scenario(
            "sync-corrupt-checkpoint-kept-2",
            "ppo-math",
            "helper",
            "relaunch",
            args=["max_recover_checkpoints=2"],
            param="strike_corrupt_checkpoint",
        ),
        Scenario("sync-bad-dataset-row", "ppo-math", "badrow", "rode out"),
        Scenario("async-bad-dataset-row", "async-ppo-math", "badrow", "rode out"),
    ]
    return out


# ---- one run ---------------------------------------------------------------------------

_TS = re.compile(r"^(\d{8}-\d\d:\d\d:\d\d\.\d{3}) ")
_REACTIONS = (
    "restarting it",  # launcher and controller, partial restarts
    "LOST",
    "ERROR",
    "failed",
    "recovering from the last checkpoint",
    "is out of service",
    "waiting for a server",
    "rescheduling",
    "retrying",
    "outage",
)


def _log_times(run_dir: str, out: str, after: float) -> List[float]:
    """Timestamps (epoch s) of log lines reacting to a fault, written after ``after``."""
    texts = [out]
    logs = os.path.join(run_dir, "logs")
    if os.path.isdir(logs):
        for f in os.listdir(logs):
            with open(os.path.join(logs, f), errors="replace") as fh:
                texts.append(fh.read())
    times = []
    for text in texts:
        for line in text.splitlines():
            m = _TS.match(line)
            if not m or not any(r in line for r in _REACTIONS):
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y%m%d-%H:%M:%S.%f").timestamp()
            if t >= after - 0.5:
                times.append(t)
    return sorted(times)


def _rows(path: str) -> List[dict]:
    """The complete lines of a JSON-lines file a live run may be appending to."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        # A line without its newline is still being written (or was cut by a kill, which
        # the run drops on resume): not a record yet.
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


class _Run:
    """A quickstart run in a subprocess, with the wall time each metrics line appeared."""

    def __init__(self, sc: Scenario, root: str, extra_args: List[str], env: Dict[str, str]):
        self.sc = sc
        self.run_dir = os.path.join(root, sc.exp, "t")
        args = COMMON + (ASYNC if sc.exp == "async-ppo-math" else []) + sc.args + extra_args
        cmd = [sys.executable, "-m", "realhf.apps.quickstart", sc.exp, *args]
        cmd += [f"fileroot={root}", "trial_name=t"]
        self.out_path = os.path.join(root, "launcher.out")
        self._out = open(self.out_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=dict(os.environ, **env),
            start_new_session=True,
        )
        self.seen: List[tuple] = []  # (wall time, step) per metrics line
        self._n = 0

    def poll_steps(self) -> None:
        rows = _rows(os.path.join(self.run_dir, "metrics.jsonl"))
        now = time.time()
        for r in rows[self._n :]:
            self.seen.append((now, r["step"]))
        self._n = len(rows)

    def wait_step(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll_steps()
            if any(s >= step for _, s in self.seen):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def workers(self, worker_type: str) -> List[psutil.Process]:
        out = []
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in kids:
            try:
                argv = " ".join(p.cmdline()).split()  # a forked worker's title: one word
            except psutil.Error:
                continue
            if "realhf.apps.remote" in argv and worker_type in argv and "worker" in argv:
                out.append(p)
        return out

    def finish(self, timeout: float) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.poll_steps()
            time.sleep(0.1)
        self.poll_steps()
        rc = self.proc.poll()
        if rc is None:  # a hang: kill everything it started
            self.kill()
        self._out.close()
        return rc

    def kill(self) -> None:
        try:
            procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(
                recursive=True
            )
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait(30)

    def output(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()


def _strike_in_update(run: _Run, timeout: float) -> str:
    """Wait until server 0 starts a weight update after step 1 (its slow_update fault logs
    each one as it starts waiting); 'in update' or 'not reached'."""
    log = os.path.join(run.run_dir, "logs", "generation_server_0.log")

    def updates() -> int:
        try:
            with open(log, errors="replace") as f:
                return f.read().count("injected fault: update")
        except OSError:
            return 0

    if not run.wait_step(1, timeout):
        return "not reached"
    seen = updates()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        if updates() > seen:
            return "in update"
        time.sleep(0.05)
    return "not reached"


def _strike_at_checkpoint(run: _Run, step: int, timeout: float) -> str:
    """Wait until the recover checkpoint of ``step`` is being written; 'in ckpt' or 'at step'."""
    tmp = os.path.join(run.run_dir, "checkpoints", "recover", f"step{step}.tmp")
    if not run.wait_step(step - 1, timeout):
        return "not reached"
    deadline = time.monotonic() + timeout
    logged = None  # when the step's line appeared: its checkpoint follows at once
    while time.monotonic() < deadline and run.proc.poll() is None:
        if os.path.isdir(tmp):
            return "in ckpt"
        run.poll_steps()
        if logged is None and any(s >= step for _, s in run.seen):
            logged = time.monotonic()
        if logged is not None and time.monotonic() - logged > 10:
            return "at step"  # no .tmp seen within 10 s of the step
        time.sleep(0.002)
    return "not reached"


def run_scenario(sc: Scenario, timeout: float = 420.0, keep: bool = False) -> dict:
    root = tempfile.mkdtemp(prefix=f"faults-{sc.name}-")
    extra, env, etcd = [], dict(sc.env), None
    if sc.kind == "etcd":
        from restartable_etcd import RestartableEtcd

        etcd = RestartableEtcd(root).start()
        extra.append(f"name_resolve=etcd3://{etcd.address}")
    inject_helper = None
    if sc.kind in ("helper", "badrow"):
        import file_faults as fault_helpers  # tests/helpers/file_faults.py

        if sc.kind == "helper":
            inject_helper = getattr(fault_helpers, str(sc.param))
        else:
            # 16 rows: every row (the bad one too) is used within the run
            extra += fault_helpers.bad_row_args(os.path.join(root, "data"), n_rows=16)
    run = _Run(sc, root, extra, env)
    point_note, t_inject, before = "", None, 0
    try:
        at = POINTS.get(sc.point, 4)
        if sc.kind in ("kill", "hang"):
            if sc.point == "ckpt":
                point_note = _strike_at_checkpoint(run, at, timeout)
            elif sc.point == "update":
                point_note = _strike_in_update(run, timeout)
            else:
                point_note = "at step" if run.wait_step(at, timeout) else "not reached"
            victims = run.workers(sc.target)
            if point_note != "not reached" and victims:
                t_inject = time.time()
                for p in victims[:1]:
                    p.send_signal(signal.SIGKILL if sc.kind == "kill" else signal.SIGSTOP)
            elif point_note != "not reached":
                point_note = f"no {sc.target} process"
        elif sc.kind == "etcd":
            if run.wait_step(at, timeout):
                t_inject = time.time()
                etcd.stop()
                threading.Timer(float(sc.param), etcd.start).start()
        elif sc.kind == "helper":
            t_inject = time.time()
            point_note = inject_helper(run) or ""
        else:  # env, badrow: the fault is there from the start; measured from step 1
            run.wait_step(1, timeout)
            t_inject = time.time()
        run.poll_steps()
        before = max((s for t, s in run.seen if t_inject is None or t <= t_inject), default=0)
        rc = run.finish(timeout)
    finally:
        if run.proc.poll() is None:
            run.kill()
        if etcd is not None:
            time.sleep(max(0.0, float(sc.param or 0) + 1 - (time.time() - (t_inject or 0))))
            etcd.close()
    row = _measure(sc, run, rc, t_inject, before, point_note)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        row["dir"] = root
    return row


def _measure(sc, run: _Run, rc, t_inject, before, point_note) -> dict:
    out = run.output()
    relaunched = "recovering from the last checkpoint" in out
    partial = "restarting it" in out or any(
        "restarting it alone" in open(os.path.join(run.run_dir, "logs", f), errors="replace").read()
        for f in (
            os.listdir(os.path.join(run.run_dir, "logs"))
            if os.path.isdir(os.path.join(run.run_dir, "logs"))
            else []
        )
    )
    if rc is None:
        outcome = "HANG"
    elif rc != 0:
        tail = [ln for ln in out.splitlines() if ln.strip()][-3:]
        outcome = "error: " + " | ".join(tail)[:160]
    elif relaunched:
        outcome = "relaunch"
    elif partial:
        outcome = "partial"
    else:
        outcome = "rode out"
    steps_after = [(t, s) for t, s in run.seen if t_inject is not None and t > t_inject]
    intervals = [b[0] - a[0] for a, b in zip(run.seen, run.seen[1:]) if b[1] == a[1] + 1]
    step_s = sorted(intervals)[len(intervals) // 2] if intervals else None
    recover = next((t - t_inject for t, s in steps_after if s > before), None)
    # Training time lost: the stall of every step from the fault on beyond a normal step (a
    # restart may cost nothing at first while queued trajectories last, and stall later).
    lost = None
    if t_inject is not None and step_s is not None:
        new = [(t, s) for t, s in run.seen if s > before]
        marks = [t_inject] + [t for t, _ in new]
        lost = sum(max(0.0, b - a - step_s) for a, b in zip(marks, marks[1:]))
    detect_times = _log_times(run.run_dir, out, t_inject) if t_inject else []
    row = {
        "scenario": sc.name,
        "expect": sc.expect,
        "outcome": outcome,
        "ok": outcome.split(":")[0] in sc.expect.split("|"),
        "point": point_note or sc.point,
        "detect_s": round(detect_times[0] - t_inject, 1) if detect_times else None,
        "recover_s": round(recover, 1) if recover is not None else None,
        "lost_s": round(lost, 1) if lost is not None else None,
        "step_s": round(step_s, 2) if step_s else None,
        "replayed": sum(1 for _, s in steps_after if s <= before),
        "completed_steps": len({s for _, s in run.seen}),
    }
    row.update(_trajectory_check(run.run_dir) if sc.exp == "async-ppo-math" else {})
    return row


def _trajectory_check(run_dir: str) -> dict:
    batches: Dict[int, dict] = {}
    for b in _rows(os.path.join(run_dir, "trajectories.jsonl")):
        batches[b["step"]] = b
    metrics: Dict[int, dict] = {}
    for r in _rows(os.path.join(run_dir, "metrics.jsonl")):
        metrics[r["step"]] = r
    missing, seen, twice = 0, set(), 0
    for _, b in sorted(batches.items()):
        v = b["trained_version"]
        missing += len(set(range(v * B, (v + 1) * B)) - set(b["indices"]))
        for key in zip(b["workers"], b["data_epochs"], b["prompts"]):
            twice += key in seen
            seen.add(key)
    # every step the run logged must have trained its batch (a run may end before STEPS:
    # a small dataset's epoch)
    missing += B * len(set(metrics) - set(batches))
    stale = [m.get("rollout/staleness_max") for m in metrics.values()]
    dups = [m.get("rollout/duplicates_dropped", 0) for m in metrics.values()]
    return {
        "traj_missing": missing,
        "traj_twice": twice,
        "dup_dropped": int(max(dups, default=0)),
        "stale_max": max((x for x in stale if x is not None), default=None),
    }


# ---- the table -----------------------------------------------------------------------

COLUMNS = [
    ("scenario", "scenario"),
    ("outcome", "outcome"),
    ("ok", "ok"),
    ("point", "point"),
    ("detect_s", "detect s"),
    ("recover_s", "recover s"),
    ("lost_s", "lost s"),
    ("replayed", "replayed"),
    ("traj_missing", "traj missing"),
    ("traj_twice", "twice"),
    ("stale_max", "stale max"),
]


def markdown(rows: List[dict]) -> str:
    def cell(v):
        if v is None:
            return "–"
        if v is True:
            return "✓"
        if v is False:
            return "✗"
        return str(v).replace("|", "/")

    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="substring of scenario names")
    ap.add_argument("--list", action="store_true", help="print the scenarios and exit")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--timeout", type=float, default=420.0, help="a run longer is a HANG")
    ap.add_argument("--write", help="write the table (markdown, with date) to this file")
    ap.add_argument("--keep", action="store_true", help="keep each run's directory")
    args = ap.parse_args(argv)
    chosen = [s for s in scenarios() if not args.only or any(o in s.name for o in args.only)]
    if args.list:
        for s in chosen:
            print(f"{s.name:40s} expect {s.expect}")
        return 0
    print(f"{len(chosen)} scenarios, {args.parallel} at a time", flush=True)
    rows: List[dict] = []
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        futs = {pool.submit(run_scenario, s, args.timeout, args.keep): s for s in chosen}
        for fut in concurrent.futures.as_completed(futs):
            s = futs[fut]
            try:
                row = fut.result()
            except Exception as e:  # noqa: BLE001 — a harness error is a row, not a crash
                row = {
                    "scenario": s.name,
                    "expect": s.expect,
                    "outcome": f"harness: {e!r}",
                    "ok": False,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    order = {s.name: i for i, s in enumerate(chosen)}
    rows.sort(key=lambda r: order[r["scenario"]])
    table = markdown(rows)
    print(table)
    summary = {
        "scenarios": len(rows),
        "hangs": sum(r["outcome"] == "HANG" for r in rows),
        "not_as_defined": [r["scenario"] for r in rows if not r.get("ok")],
        "minutes": round((time.monotonic() - t0) / 60, 1),
    }
    if args.write:
        with open(args.write, "w") as f:
            f.write(_report(table, summary, args))
    print(json.dumps(summary))
    return 0 if not summary["hangs"] and not summary["not_as_defined"] else 1


def _report(table: str, summary: dict, args) -> str:
    return (
        f"# Fault matrix — {datetime.date.today().isoformat()}\n\n"
        f"`python benchmark/fault_matrix.py --parallel {args.parallel}` on the 2-core CPU VM "
        f"({summary['scenarios']} runs, {summary['minutes']} min; {summary['hangs']} hangs; "
        f"not as defined: {summary['not_as_defined'] or 'none'}).  Each run: {STEPS} steps, "
        f"batch {B}, checkpoint every {CKPT_EVERY} steps, recover_mode=auto; async with "
        f"max_head_offpolicyness={ETA}.  Columns: see the script's docstring.\n\n"
        f"{table}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
