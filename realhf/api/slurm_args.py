"""Options of the SLURM launcher (``mode=slurm``): ``cfg.slurm.*``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Dict, List

# sbatch options the launcher sets itself for every job; passing them in sbatch_args would
# silently fight with the launcher's own choice, so they are refused with a pointer.
_RESERVED_SBATCH = {
    "--partition": "partition",
    "-p": "partition",
    "--nodelist": "nodelist",
    "-w": "nodelist",
    "--exclude": "nodelist",
    "-x": "nodelist",
    "--ntasks": "(the experiment's worker counts)",
    "-n": "(the experiment's worker counts)",
    "--cpus-per-task": "worker_cpus",
    "-c": "worker_cpus",
    "--gpus-per-task": "worker_gpus",
    "--mem": "worker_mem_mb",
    "--mem-per-cpu": "worker_mem_mb",
    "--output": "(logs go to {run_dir}/logs)",
    "-o": "(logs go to {run_dir}/logs)",
    "--error": "(logs go to {run_dir}/logs)",
    "-e": "(logs go to {run_dir}/logs)",
    "--job-name": "(jobs are named realhf:{experiment}:{trial}:{worker_type})",
    "-J": "(jobs are named realhf:{experiment}:{trial}:{worker_type})",
    "--parsable": "(the launcher parses sbatch's output)",
    "--wrap": "(the launcher writes the batch scripts)",
}


def _check_per_type(name: str, values: Dict[str, int], minimum: int) -> None:
    if not isinstance(values, dict):
        raise ValueError(f"slurm.{name} must map worker type -> int, got {values!r}.")
    for wtype, v in values.items():
        if not isinstance(wtype, str) or not wtype:
            raise ValueError(f"slurm.{name}: keys must be worker type names, got {wtype!r}.")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(
                f"slurm.{name}.{wtype} must be an int >= {minimum}, got {v!r} "
                f"(e.g. slurm.{name}.{wtype}={max(minimum, 1)})."
            )


@dataclasses.dataclass
class SlurmConfig:
    """How ``mode=slurm`` submits the workers.

    The launcher submits one batch job per worker type (and one for the controller); each
    job runs one ``srun`` step with a task per worker, whose index is its ``SLURM_PROCID``.
    Resources per process come from the experiment (``Scheduling``: cpu, gpu, mem_mb); the
    ``worker_*`` maps override them by worker type (``controller`` included).
    """

    partition: str = field(default="", metadata={"help": "partition; empty = the default"})
    nodelist: str = field(
        default="",
        metadata={
            "help": "run only on these nodes (SLURM hostlist, e.g. 'node[1-4],gpu7'); "
            "empty = any node of the partition"
        },
    )
    worker_cpus: Dict[str, int] = field(
        default_factory=dict,
        metadata={
            "help": "CPUs per process by worker type (e.g. slurm.worker_cpus.model_worker=8); "
            "default: the experiment's"
        },
    )
    worker_gpus: Dict[str, int] = field(
        default_factory=dict,
        metadata={"help": "GPUs per process by worker type; default: the experiment's"},
    )
    worker_mem_mb: Dict[str, int] = field(
        default_factory=dict,
        metadata={
            "help": "memory (MiB) per process by worker type; 0 = no memory request; "
            "default: the experiment's"
        },
    )
    sbatch_args: List[str] = field(
        default_factory=list,
        metadata={
            "help": "extra sbatch arguments for every job, e.g. ['--account=rl', "
            "'--time=24:00:00', '--qos=high']"
        },
    )
    slurm_conf: str = field(
        default="",
        metadata={
            "help": "slurm.conf for the client commands (becomes $SLURM_CONF); "
            "empty = the environment's / the system's"
        },
    )
    submit_timeout: float = field(
        default=30.0, metadata={"help": "seconds one sbatch/squeue/scancel call may take"}
    )
    start_timeout: float = field(
        default=600.0,
        metadata={
            "help": "seconds the jobs may stay pending before the launch fails "
            "(a busy or too small cluster must not hang the launcher)"
        },
    )
    poll_interval: float = field(
        default=1.0, metadata={"help": "seconds between two looks at the jobs (squeue)"}
    )

    def __post_init__(self):
        for name in ("partition", "nodelist", "slurm_conf"):
            v = getattr(self, name)
            if not isinstance(v, str) or any(c.isspace() for c in v):
                raise ValueError(f"slurm.{name} must be a string without spaces, got {v!r}.")
        _check_per_type("worker_cpus", self.worker_cpus, 1)
        _check_per_type("worker_gpus", self.worker_gpus, 0)
        _check_per_type("worker_mem_mb", self.worker_mem_mb, 0)
        if not isinstance(self.sbatch_args, (list, tuple)) or not all(
            isinstance(a, str) and a for a in self.sbatch_args
        ):
            raise ValueError(
                f"slurm.sbatch_args must be a list of non-empty strings, got {self.sbatch_args!r}."
            )
        self.sbatch_args = list(self.sbatch_args)
        for a in self.sbatch_args:
            opt = a.split("=", 1)[0]
            if opt in _RESERVED_SBATCH:
                raise ValueError(
                    f"slurm.sbatch_args: {a!r} is set by the launcher; use "
                    f"{_RESERVED_SBATCH[opt]} instead."
                )
        if self.slurm_conf and not os.path.isfile(self.slurm_conf):
            raise ValueError(
                f"slurm.slurm_conf={self.slurm_conf!r} is not a file; give the path of the "
                "cluster's slurm.conf or leave it empty."
            )
        for name in ("submit_timeout", "start_timeout", "poll_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"slurm.{name} must be a number > 0, got {v!r}.")
