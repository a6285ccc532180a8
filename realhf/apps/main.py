"""Launch a quickstart experiment locally and recover it after failures.

`run(name, cfg)` is what `python -m realhf.apps.quickstart <name>` calls:

1. resolve names and paths, create ``{fileroot}/{experiment}/{trial}/`` and save the
   resolved config there as ``config.yaml``;
2. compile the config into workers and launch them with the local scheduler;
3. on a failure with ``recover_mode=auto``, relaunch up to ``recover_retries`` times —
   the workers resume from the last complete recover checkpoint in the run directory;
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

from realhf.api.cli_args import RecoverMode
from realhf.api.cli_parser import to_yaml
from realhf.base import constants, logging
from realhf.experiments.registry import get_quickstart_exp
from realhf.scheduler.local import JobFailure, launch_experiment

logger = logging.getLogger("main")


def resolve_names(name: str, cfg) -> tuple[str, str, str, str]:
    """(experiment, trial, fileroot, name-resolve spec) with defaults filled in."""
    experiment = cfg.experiment_name or name
    fileroot = os.path.abspath(os.path.expanduser(cfg.fileroot or constants.get_fileroot()))
    constants.ensure_writable(fileroot)
    spec = cfg.name_resolve or f"file://{os.path.join(fileroot, 'name_resolve')}"
    return experiment, cfg.trial_name, fileroot, spec


def run(name: str, cfg, timeout: Optional[float] = None) -> int:
    """Run quickstart experiment `name` with config `cfg`; return a process exit code."""
    qs = get_quickstart_exp(name)
    experiment, trial, fileroot, spec = resolve_names(name, cfg)
    run_dir = os.path.join(fileroot, experiment, trial)
    os.makedirs(run_dir, exist_ok=True)
    # Written before anything runs, so a run that fails still records the
    # config it failed with; a recovered attempt reuses the same directory.
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(f"# quickstart {name}\n" + to_yaml(cfg))
    attempts = 1 + (cfg.recover_retries if RecoverMode(cfg.recover_mode) is RecoverMode.AUTO else 0)
    t0 = time.monotonic()
    for attempt in range(attempts):
        try:
            experiment_cfg = qs.build(cfg)
        except (
            ValueError,
            FileNotFoundError,
        ) as e:  # bad paths, rows, allocation: the user's to fix
            print(f"{name}: {e}", file=sys.stderr)
            return 2
        logger.info(
            f"{name}: launching {len(experiment_cfg.worker_names()) + 1} processes "
            f"(attempt {attempt + 1}/{attempts}); run dir {run_dir}"
        )
        try:
            launch_experiment(
                experiment_cfg,
                experiment,
                trial,
                run_dir=run_dir,
                name_resolve_spec=spec,
                experiment_type=name,
                experiment_args={"cfg": cfg},
                # The controller process gets the config, not the compiled
                # workers: importing the builder's module registers the
                # experiment there, and it rebuilds the run from `cfg`.
                imports=[qs.build.__module__],
                timeout=timeout,
                fileroot=fileroot,
            )
            break
        except (JobFailure, TimeoutError) as e:
            if attempt + 1 < attempts:
                logger.warning(f"{name}: run failed; recovering from the last checkpoint:\n{e}")
                continue
            print(f"{name}: FAILED after {time.monotonic() - t0:.0f}s\n{e}", file=sys.stderr)
            return 1
    print(
        f"{name}: finished in {time.monotonic() - t0:.0f}s; "
        f"outputs (metrics.jsonl, curves.png, checkpoints/) in {run_dir}"
    )
    return 0
