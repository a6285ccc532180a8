"""Launch a quickstart experiment and recover it after failures; see or stop a run.

`run(name, cfg)` is what `python -m realhf.apps.quickstart <name>` calls:

1. resolve names and paths, create ``{fileroot}/{experiment}/{trial}/`` and save the
   resolved config there as ``config.yaml``;
2. compile the config into workers and launch them with the launcher of ``cfg.mode``
   (local, ray or slurm: :func:`realhf.scheduler.launcher`);
3. on a failure with ``recover_mode=auto``, relaunch up to ``recover_retries`` times —
   the workers resume from the last complete recover checkpoint in the run directory
   (not after a stop request: that run ends with exit code 3).

From another shell, whatever the launcher::

    python -m realhf.apps.main status EXPERIMENT TRIAL [--fileroot DIR] [--name-resolve SPEC]
    python -m realhf.apps.main stop EXPERIMENT TRIAL [--fileroot DIR] [--name-resolve SPEC]

``status`` prints the experiment's and every worker's status and the last step logged;
``stop`` asks the controller to stop every worker and waits until it has.  Both find the
run through the same name-resolve backend the run uses (default: the file backend under
the file root).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import shutil
import socket
import sys
import time
from typing import List, Optional, Sequence

from realhf.api.cli_args import RecoverMode
from realhf.api.cli_parser import to_yaml
from realhf.apps import memory_plan
from realhf.apps.console import RunConsole, format_summary, summarize
from realhf.apps.remote import STOPPED_EXIT_CODE
from realhf.base import constants, logging, name_resolve, names
from realhf.base.storage import recover
from realhf.base.storage.atomic_file import write_atomic
from realhf.experiments.registry import get_quickstart_exp
from realhf.scheduler import LaunchError, forkserver, launcher
from realhf.scheduler.local import JobFailure

logger = logging.getLogger("main")


def _spec(fileroot: str, name_resolve_spec: str) -> str:
    return name_resolve_spec or f"file://{os.path.join(fileroot, 'name_resolve')}"


def resolve_names(name: str, cfg) -> tuple[str, str, str, str]:
    """(experiment, trial, fileroot, name-resolve spec) with defaults filled in.

    ``name_resolve=ray`` (the Ray cluster's own key-value store, the default of
    ``mode=ray``) becomes ``ray://ADDRESS`` when ``ray.address`` names the cluster; with a
    cluster the launcher starts itself it stays ``ray`` and the launcher fills in the address.
    """
    experiment = cfg.experiment_name or name
    fileroot = os.path.abspath(os.path.expanduser(cfg.fileroot or constants.get_fileroot()))
    constants.ensure_writable(fileroot)
    chosen = cfg.name_resolve or ("ray" if cfg.mode == "ray" else "")
    spec = _spec(fileroot, chosen)
    if spec.strip() == "ray":
        if cfg.mode != "ray":
            raise ValueError(
                f"name_resolve=ray uses the Ray cluster's key-value store, but mode={cfg.mode}; "
                "use mode=ray, or a file:// or etcd3:// name_resolve"
            )
        address = cfg.ray.address.strip()
        if address and address != "auto":
            spec = f"ray://{address}"
    return experiment, cfg.trial_name, fileroot, spec


#: seconds a relaunch waits for the name-resolve store to answer again
STORE_WAIT_S = 120.0


def _wait_for_store(spec: str, timeout: float) -> None:
    """Block until the name-resolve store of ``spec`` answers (logged), at most
    ``timeout`` seconds; then ConnectionError (the relaunch fails with that reason)."""
    t0, warned = time.monotonic(), False
    while True:
        try:
            name_resolve.from_spec(spec).close()
        except ConnectionError as e:
            waited = time.monotonic() - t0
            if waited >= timeout:
                raise ConnectionError(
                    f"the name-resolve store {spec} did not come back within {timeout:g}s: {e}"
                ) from e
            if not warned:
                logger.warning(f"waiting up to {timeout:g}s for the name-resolve store {spec}: {e}")
                warned = True
            time.sleep(1.0)
            continue
        if warned:
            logger.info(f"name-resolve store {spec} is back after {time.monotonic() - t0:.0f}s")
        return


def _get(spec: str, key: str) -> Optional[str]:
    """The value of ``key`` in the store of ``spec``; None when absent or the store is
    unreachable."""
    if spec.strip() == "ray":  # a cluster the launcher started (and has shut down)
        return None
    try:
        repo = name_resolve.from_spec(spec)
    except ConnectionError:
        return None
    try:
        return repo.get(key)
    except name_resolve.NameEntryNotFoundError:
        return None
    finally:
        repo.close()


def _stopped_on_request(e: Exception, spec: str, experiment: str, trial: str) -> bool:
    """Whether the launch ended because ``stop`` asked it to: the controller exited with
    STOPPED_EXIT_CODE, or the store says STOPPED."""
    for job in getattr(e, "failed", ()):
        if job.name == "controller/0" and job.returncode == STOPPED_EXIT_CODE:
            return True
    return _get(spec, names.experiment_status(experiment, trial)) == "STOPPED"


def run(name: str, cfg, timeout: Optional[float] = None, imports: Sequence[str] = ()) -> int:
    """Run quickstart experiment `name` with config `cfg`; return a process exit code.

    ``imports`` are plugin modules (:mod:`realhf.apps.plugins`) that the controller and
    every worker import before anything else."""
    qs = get_quickstart_exp(name)
    refused = _defined_in_script(qs)
    if refused:
        print(f"{name}: {refused}", file=sys.stderr)
        return 2
    try:
        experiment, trial, fileroot, spec = resolve_names(name, cfg)
    except ValueError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    run_dir = os.path.join(fileroot, experiment, trial)
    refused = _earlier_run(run_dir, cfg)
    if refused:
        print(f"{name}: {refused}", file=sys.stderr)
        return 2
    if cfg.mode == "local":  # its imports overlap the build below (realhf.scheduler.forkserver)
        forkserver.prestart()
    try:
        first_build, chosen = memory_plan.choose_unset(cfg, qs.build)
        for note in chosen:
            logger.info(f"{name}: {note}")
        memory_plan.check_fits(name, cfg, first_build, qs.build)
    except (ValueError, FileNotFoundError) as e:  # bad paths, rows, allocation, too big
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    os.makedirs(run_dir, exist_ok=True)
    # weight_sync=shm versions are memory until deleted: none of a killed run's stays, and
    # none of this one outlives it (a resumed run publishes its version again).
    shm = constants.weight_shm_root(experiment, trial, fileroot)
    shutil.rmtree(shm, ignore_errors=True)
    # Written before anything runs, so a run that fails still records the
    # config it failed with; a recovered attempt reuses the same directory.
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(f"# quickstart {name}\n" + to_yaml(cfg))
    attempts = 1 + (cfg.recover_retries if RecoverMode(cfg.recover_mode) is RecoverMode.AUTO else 0)
    t0 = time.monotonic()
    status, code, error = "finished", 0, None
    # One console for every attempt: a relaunch continues the same progress view.
    with _removed_at_exit(shm), RunConsole(name, run_dir) as console:
        for attempt in range(attempts):
            try:
                experiment_cfg = first_build if attempt == 0 else qs.build(cfg)
            except (
                ValueError,
                FileNotFoundError,
            ) as e:  # bad paths, rows, allocation: the user's to fix
                print(f"{name}: {e}", file=sys.stderr)
                return 2
            if attempt > 0 and spec.strip() != "ray":  # the store may be what failed: wait for it
                try:
                    _wait_for_store(spec, STORE_WAIT_S)
                except ConnectionError as e:
                    print(
                        f"{name}: FAILED after {time.monotonic() - t0:.0f}s\n{e}", file=sys.stderr
                    )
                    return 1
            logger.info(
                f"{name}: launching {len(experiment_cfg.worker_names()) + 1} processes "
                f"(attempt {attempt + 1}/{attempts}); run dir {run_dir}"
            )
            try:
                launch = launcher(cfg.mode)
                extra = {} if cfg.mode == "local" else {"options": getattr(cfg, cfg.mode)}
                launch(
                    experiment_cfg,
                    experiment,
                    trial,
                    run_dir=run_dir,
                    name_resolve_spec=spec,
                    # The controller runs this experiment_cfg (pickled in the run dir);
                    # every process imports the builder's module and the plugins.
                    imports=list(dict.fromkeys([qs.build.__module__, *imports])),
                    timeout=timeout,
                    fileroot=fileroot,
                    **extra,
                )
                break
            except LaunchError as e:  # the cluster cannot run it as configured: the user's to fix
                print(f"{name}: {e}", file=sys.stderr)
                return 2
            except (JobFailure, TimeoutError) as e:
                if _stopped_on_request(e, spec, experiment, trial):
                    status, code = "stopped", STOPPED_EXIT_CODE
                    break
                if attempt + 1 < attempts:
                    logger.warning(f"{name}: run failed; recovering from the last checkpoint:\n{e}")
                    continue
                status, code, error = "failed", 1, e
                break
    # After the console has shown the last steps: the verdict, also of a failed run.
    print(_summary(name, run_dir, t0, cfg, status, console))
    took = f"{time.monotonic() - t0:.0f}s"
    if status == "failed":
        print(f"{name}: FAILED after {took}\n{error}", file=sys.stderr)
    else:
        print(f"{name}: " + ("stopped on request after" if code else "finished in") + f" {took}")
    return code


@contextlib.contextmanager
def _removed_at_exit(path: str):
    """Remove the run's shared-memory directory ``{base}/realhf-{key}/{exp}/{trial}`` at
    exit, and its parents while they are empty."""
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)
        for parent in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            try:
                os.rmdir(parent)
            except OSError:  # another run's, or absent
                break


def _defined_in_script(qs) -> Optional[str]:
    """Why experiment ``qs`` cannot be launched from here (None: it can): a config class
    or build function defined in the script being run (``__main__``) cannot be unpickled or
    imported by the launched processes, whose ``__main__`` is realhf.apps.remote."""
    for what, obj in (("build function", qs.build), ("config class", qs.config_cls)):
        if getattr(obj, "__module__", None) == "__main__":
            return (
                f"the {what} {obj.__qualname__} of experiment {qs.name!r} is defined in the "
                "script being run (__main__); the launched processes cannot import it (they "
                f"would fail with \"Can't get attribute '{obj.__qualname__}' on <module "
                "'realhf.apps.remote'>\"). Move it into a module, e.g. my_exp.py, and run "
                f"`python -m realhf.apps.quickstart {qs.name} --import my_exp` from the "
                "directory that holds it (or with it on PYTHONPATH)"
            )
    return None


def _summary(name: str, run_dir: str, t0: float, cfg, status: str, console: RunConsole) -> str:
    """Write ``summary.json`` for the run that just ended; return its text block."""
    s = summarize(name, run_dir, time.monotonic() - t0, cfg, console.incidents)
    s["status"] = status
    write_atomic(os.path.join(run_dir, "summary.json"), json.dumps(s, indent=1) + "\n")
    return format_summary(s)


def _has_files(path: str) -> bool:
    """Whether ``path`` is a file, or a directory with a file somewhere below it."""
    if os.path.isfile(path):
        return True
    return any(files for _, _, files in os.walk(path))


#: what an earlier run leaves in its trial directory
_RUN_OUTPUTS = ("metrics.jsonl", "checkpoints", "progress.json", "summary.json")


def _earlier_run(run_dir: str, cfg) -> Optional[str]:
    """Why the run must not start in ``run_dir`` (None: it may).

    A directory holding an earlier run's outputs is resumed (``recover_mode=resume``, or
    ``auto`` with a recover checkpoint there), replaced (``overwrite=true``), or refused:
    a second run never silently writes over the first one's metrics and checkpoints.
    """
    found = [f for f in _RUN_OUTPUTS if _has_files(os.path.join(run_dir, f))]
    if not found:
        return None
    mode = RecoverMode(cfg.recover_mode)
    has_ckpt = recover.has_checkpoint(os.path.join(run_dir, "checkpoints", "recover"))
    if mode is RecoverMode.RESUME or (mode is RecoverMode.AUTO and has_ckpt):
        return None
    if cfg.overwrite:
        logger.warning(f"overwrite=true: removing the earlier run in {run_dir}")
        shutil.rmtree(run_dir)
        return None
    choices = (
        "trial_name=NEW for a new run beside it, recover_mode=auto to resume it from its "
        "last recover checkpoint, or overwrite=true to replace it"
        if has_ckpt
        else "trial_name=NEW for a new run beside it or overwrite=true to replace it (it has "
        "no recover checkpoint to resume from)"
    )
    return f"{run_dir} already holds a run ({', '.join(found)}). Choose {choices}."


# ---- status / stop from another shell ------------------------------------------------


def status(experiment: str, trial: str, fileroot: str, spec: str) -> int:
    """Print the run's status; 0 when found, 1 when the name-resolve backend knows no such
    run."""
    run_dir = os.path.join(fileroot, experiment, trial)
    repo = name_resolve.from_spec(spec)
    try:
        keys = repo.find_subtree(names.trial_root(experiment, trial))
        root = names.worker_status_root(experiment, trial)
        workers = {}
        for k in keys:
            if k.startswith(root + "/"):
                try:
                    workers[k[len(root) + 1 :]] = repo.get(k)
                except name_resolve.NameEntryNotFoundError:
                    pass  # exited meanwhile
    finally:
        repo.close()
    state = _get(spec, names.experiment_status(experiment, trial))
    if state is None and not keys:
        print(f"no run {experiment!r} trial {trial!r} known to {spec}", file=sys.stderr)
        return 1
    print(f"experiment {experiment!r} trial {trial!r}: {state or 'NOT STARTED'}; run dir {run_dir}")
    for w in sorted(workers, key=_worker_order):
        print(f"  {w:<28} {workers[w]}")
    last = _last_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if last:
        print(
            f"  last step {last.get('step')} (epoch {last.get('epoch')}), "
            f"{last.get('elapsed', 0):.0f}s of training"
        )
    return 0


def _worker_order(name: str):
    wtype, _, index = name.partition("/")
    return (wtype, int(index) if index.isdigit() else 0)


def _last_metrics(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def stop(experiment: str, trial: str, spec: str, wait_s: float = 120.0) -> int:
    """Ask the run's controller to stop every worker; wait until it has (0), or until
    ``wait_s`` passed (1); 1 as well when the run is not running."""
    key = names.experiment_status(experiment, trial)
    state = _get(spec, key)
    if state != "RUNNING":
        print(
            f"{experiment!r} trial {trial!r} is not running ({state or 'unknown'})", file=sys.stderr
        )
        return 1
    who = f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()}"
    repo = name_resolve.from_spec(spec)
    try:
        repo.add(names.stop_request(experiment, trial), who, replace=True, delete_on_exit=False)
    finally:
        repo.close()
    print(f"asked {experiment!r} trial {trial!r} to stop; waiting up to {wait_s:g}s")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        state = _get(spec, key)
        if state != "RUNNING":
            print(f"{experiment!r} trial {trial!r}: {state}")
            return 0
        time.sleep(0.5)
    print(
        f"{experiment!r} trial {trial!r} still RUNNING after {wait_s:g}s: its controller did "
        "not act on the stop request (is it alive? `status` shows its key)",
        file=sys.stderr,
    )
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m realhf.apps.main", description="See or stop a realhf run."
    )
    p.add_argument("command", choices=("status", "stop"))
    p.add_argument("experiment")
    p.add_argument("trial")
    p.add_argument(
        "--fileroot",
        default="",
        help="the run's file root (default: $REALHF_FILEROOT or ~/.cache/realhf)",
    )
    p.add_argument(
        "--name-resolve",
        default="",
        help="the run's name-resolve spec (default: the file backend under the file root)",
    )
    p.add_argument("--wait", type=float, default=120.0, help="stop: seconds to wait")
    a = p.parse_args(argv)
    fileroot = os.path.abspath(os.path.expanduser(a.fileroot or constants.get_fileroot()))
    spec = _spec(fileroot, a.name_resolve)
    if a.command == "status":
        return status(a.experiment, a.trial, fileroot, spec)
    return stop(a.experiment, a.trial, spec, a.wait)


if __name__ == "__main__":
    sys.exit(main())
