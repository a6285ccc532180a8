"""Options of the Ray launcher (``mode=ray``): ``cfg.ray.*``."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Dict, List, Optional

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass
class RayConfig:
    """How ``mode=ray`` places the workers on a Ray cluster."""

    address: str = field(
        default="",
        metadata={
            "help": "an existing Ray cluster (host:port of its GCS, or 'auto'); "
            "empty = start a local one for the run"
        },
    )
    cpus_per_worker: Optional[float] = field(
        default=None,
        metadata={
            "help": "CPUs every process (controller included) asks Ray for; fractions allowed "
            "(e.g. 0.5 to fit 6 processes on a 4-CPU cluster); empty = each worker type's "
            "own cpu count (1 for the controller)"
        },
    )
    placement_strategy: str = field(
        default="PACK",
        metadata={
            "help": f"strategy of each worker type's placement group, one of "
            f"{PLACEMENT_STRATEGIES}; PACK keeps a type's processes (e.g. a model's ranks) on "
            "as few nodes as fit them"
        },
    )
    local_num_cpus: Optional[int] = field(
        default=None,
        metadata={
            "help": "CPUs the local cluster (empty address) advertises; empty = this "
            "machine's count, raised to what the experiment asks for (as mode=local "
            "oversubscribes)"
        },
    )
    temp_dir: str = field(
        default="",
        metadata={
            "help": "temp/log dir of the local cluster; empty = {run_dir}/ray when short "
            "enough for Ray's socket paths, else a fresh dir under the system temp dir, "
            "removed at the end"
        },
    )
    connect_timeout_s: float = field(
        default=10.0,
        metadata={"help": "seconds to reach the cluster at `address` before failing"},
    )
    startup_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "seconds for the placement groups to be placed and the worker actors to "
            "start before the launch fails"
        },
    )
    worker_resources: Dict[str, str] = field(
        default_factory=dict,
        metadata={
            "help": "custom Ray resources each process of a worker type asks for, as "
            "'name:amount,...' (e.g. ray.worker_resources.generation_server=inference_node:1 "
            "keeps generation servers on nodes started with --resources "
            "'{\"inference_node\": 8}')"
        },
    )
    forward_env: str = field(
        default="PYTHONPATH",
        metadata={
            "help": "comma-separated names of launcher environment variables copied to "
            "every process (REALHF_* always are); the rest comes from the node"
        },
    )

    def resources_of(self, worker_type: str) -> Dict[str, float]:
        """The custom resources each process of ``worker_type`` asks for."""
        out: Dict[str, float] = {}
        spec = self.worker_resources.get(worker_type, "")
        for part in filter(None, (p.strip() for p in str(spec).split(","))):
            name, _, amount = part.rpartition(":")
            out[name.strip()] = float(amount)
        return out

    def __post_init__(self):
        for wtype, spec in self.worker_resources.items():
            for part in filter(None, (p.strip() for p in str(spec).split(","))):
                name, colon, amount = part.rpartition(":")
                try:
                    ok = bool(colon and name.strip()) and float(amount) > 0
                except ValueError:
                    ok = False
                _check(
                    ok and name.strip() not in ("CPU", "GPU", "memory"),
                    f"ray.worker_resources.{wtype}={spec!r}: give 'name:amount,...' with "
                    "amounts > 0 of custom resources (CPUs and GPUs come from the experiment "
                    "and ray.cpus_per_worker)",
                )
        addr = self.address.strip()
        _check(
            not addr.startswith("ray://"),
            f"ray.address={self.address!r}: Ray Client addresses (ray://) are not supported; "
            "run the launcher on a cluster node and give the GCS address host:port (or 'auto')",
        )
        _check(
            addr in ("", "auto") or bool(_HOST_PORT.match(addr)),
            f"ray.address={self.address!r}: give the GCS address as host:port (e.g. "
            "10.0.0.1:6379), 'auto', or leave it empty to start a local cluster",
        )
        _check(
            self.cpus_per_worker is None or self.cpus_per_worker > 0,
            f"ray.cpus_per_worker must be > 0 (or empty), got {self.cpus_per_worker}",
        )
        _check(
            self.placement_strategy in PLACEMENT_STRATEGIES,
            f"ray.placement_strategy={self.placement_strategy!r}; use one of "
            f"{PLACEMENT_STRATEGIES}",
        )
        _check(
            self.local_num_cpus is None or self.local_num_cpus >= 1,
            f"ray.local_num_cpus must be >= 1 (or empty), got {self.local_num_cpus}",
        )
        _check(
            self.connect_timeout_s > 0,
            f"ray.connect_timeout_s must be > 0, got {self.connect_timeout_s}",
        )
        _check(
            self.startup_timeout_s > 0,
            f"ray.startup_timeout_s must be > 0, got {self.startup_timeout_s}",
        )
        bad = [n for n in self.forwarded_env_names if not _ENV_NAME.match(n)]
        _check(
            not bad,
            f"ray.forward_env={self.forward_env!r}: {bad} are not environment variable "
            "names; give names separated by commas, e.g. PYTHONPATH,HF_HOME",
        )

    @property
    def forwarded_env_names(self) -> List[str]:
        """The names in :attr:`forward_env`."""
        return [n.strip() for n in self.forward_env.split(",") if n.strip()]
