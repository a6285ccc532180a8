"""Smoke run of the system plumbing: real processes, ZMQ streams, name resolution.

    python -m realhf.apps.smoke                      # what `make demo` runs
    python -m realhf.apps.smoke --name-resolve etcd3://127.0.0.1:2379
    python -m realhf.apps.smoke --fileroot /tmp/smoke --n-rounds 5 --n-messages 100

Launches (with the local scheduler) a controller, a master-like worker, two
model-like workers, a producer and a consumer of the ``smoke`` experiment
(:mod:`realhf.experiments.smoke`).  The controller configures them in order
and starts them; the master exchanges typed requests and replies with the model
workers (one round with syn/ack, one remote error on purpose); the producer
streams messages to the consumer.  All of them find each other through name
resolution (the file backend under the run directory by default).  Prints
what happened and exits 0, or prints which process failed and why and exits 1.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from typing import List, Optional

from realhf.api.core import system_api
from realhf.base import name_resolve
from realhf.experiments import smoke as smoke_exp
from realhf.scheduler.local import JobFailure, launch_experiment

EXPERIMENT = "smoke"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m realhf.apps.smoke", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--fileroot",
        default=None,
        help="where the run directory goes (default: a new temporary directory)",
    )
    p.add_argument("--trial", default="demo", help="trial name (default: demo)")
    p.add_argument(
        "--name-resolve",
        default=None,
        help="name-resolve spec (default: file:///{fileroot}/name_resolve)",
    )
    p.add_argument("--n-rounds", type=int, default=3, help="request/reply rounds")
    p.add_argument("--n-messages", type=int, default=20, help="messages per producer")
    p.add_argument("--n-model-workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="fail after this many seconds")
    return p


def _load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summarize(run_dir: str, result_dir: str, elapsed: float, spec: str) -> List[str]:
    """Readable lines about what each process of the run did."""
    ctl = _load(os.path.join(run_dir, "controller_summary.json")) or {}
    lines = [f"realhf smoke run finished in {elapsed:.1f}s (name resolve: {spec})"]
    if ctl.get("ok"):
        lines.append(
            f"  controller      configured {' -> '.join(ctl['configure_order'])} in "
            f"{ctl['configure_seconds']:.2f}s; all {len(ctl['statuses'])} workers COMPLETED"
        )
    master = _load(os.path.join(result_dir, "smoke_master_0.json"))
    if master:
        lines.append(
            f"  smoke_master/0  {master['rounds']} rounds of typed SquareRequest -> "
            f"{', '.join(master['handlers'])}; every reply checked (round 0 with syn/ack)"
        )
        err = master["remote_error"]
        lines.append(
            f"                  remote error delivered: {err['error']} from {err['worker']} "
            f"(handle {err['handle']!r}, with remote traceback)"
        )
        for h, served in master["served"].items():
            lines.append(f"  {h:<15} served {served}")
    for path in sorted(glob.glob(os.path.join(result_dir, "smoke_producer_*.json"))):
        r = _load(path) or {}
        who = "smoke_producer/" + path[:-5].rsplit("_", 1)[1]
        lines.append(
            f"  {who:<15} pushed {r.get('pushed')} typed Rollout messages "
            f"to consumer(s) {r.get('consumers')}"
        )
    for path in sorted(glob.glob(os.path.join(result_dir, "smoke_consumer_*.json"))):
        r = _load(path) or {}
        who = "smoke_consumer/" + path[:-5].rsplit("_", 1)[1]
        lines.append(
            f"  {who:<15} received {r.get('received')} from producer(s) "
            f"{r.get('producers')}, in order per producer"
        )
    lines.append(f"  logs            {os.path.join(run_dir, 'logs')}")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    """Run the smoke experiment; print a summary; return the exit code."""
    args = _parser().parse_args(argv)
    fileroot = os.path.abspath(args.fileroot or tempfile.mkdtemp(prefix="realhf-smoke-"))
    run_dir = os.path.join(fileroot, EXPERIMENT, args.trial)
    result_dir = os.path.join(run_dir, "results")
    spec = args.name_resolve or f"file://{os.path.join(fileroot, 'name_resolve')}"
    try:
        name_resolve.from_spec(spec).close()
    except Exception as e:
        print(f"smoke: name resolution {spec!r} is unusable: {e}", file=sys.stderr)
        return 1
    exp_args = dict(
        result_dir=result_dir,
        n_model_workers=args.n_model_workers,
        n_rounds=args.n_rounds,
        n_messages=args.n_messages,
    )
    try:
        experiment = system_api.make_experiment(EXPERIMENT, **exp_args)
    except ValueError as e:
        print(f"smoke: {e}", file=sys.stderr)
        return 2
    print(f"smoke: launching {len(experiment.worker_names()) + 1} processes, run dir {run_dir}")
    t0 = time.monotonic()
    try:
        launch_experiment(
            experiment,
            EXPERIMENT,
            args.trial,
            run_dir=run_dir,
            fileroot=fileroot,
            name_resolve_spec=spec,
            imports=[smoke_exp.__name__],
            timeout=args.timeout,
        )
    except (JobFailure, TimeoutError) as e:
        print(f"smoke: FAILED after {time.monotonic() - t0:.1f}s\n{e}", file=sys.stderr)
        return 1
    for line in summarize(run_dir, result_dir, time.monotonic() - t0, spec):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
