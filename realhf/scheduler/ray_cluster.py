"""Connecting the Ray launcher to a cluster (see :mod:`realhf.scheduler.ray`).

:func:`connect` joins the cluster at ``ray.address`` (probed first, so that a wrong
address is named instead of hanging) or starts a local one for the run: its temp dir in
the run dir (or a fresh one removed at the end, when socket paths there would be too
long), token authentication with a fresh token kept out of ``~/.ray``, shut down at the
end.  :func:`write_placement` records which node every process ran on.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import socket
import tempfile
from typing import Dict, Iterator, Tuple

from realhf.api.ray_args import RayConfig
from realhf.base import logging
from realhf.base.storage.atomic_file import write_json_atomic
from realhf.scheduler import LaunchError

logger = logging.getLogger("ray_scheduler", "system")

__all__ = [
    "NAMESPACE",
    "RayClusterError",
    "connect",
    "first_line",
    "ray_environ",
    "warn_if_file_backend_on_many_nodes",
    "write_placement",
]

NAMESPACE = "realhf"
#: the longest session-dir suffix Ray appends to its temp dir for a socket path
# ("/session_2026-11-25_17-53-31_957620_10493/sockets/plasma_store"), and the AF_UNIX limit
_SOCKET_SUFFIX_LEN = 72
_SOCKET_PATH_MAX = 107


class RayClusterError(LaunchError):
    """The Ray cluster is unreachable, or cannot place or start the run's processes."""


def check_capacity(wanted: Dict[str, float]) -> None:
    """Fail at once when the connected cluster has fewer CPUs or GPUs in all than the run
    asks for (waiting for placement could never succeed)."""
    import ray

    have = ray.cluster_resources()
    short = {r: (n, have.get(r, 0.0)) for r, n in wanted.items() if n > have.get(r, 0.0) + 1e-9}
    if short:
        parts = ", ".join(f"{n:g} {r} (the cluster has {h:g})" for r, (n, h) in short.items())
        raise RayClusterError(
            f"the run asks Ray for {parts}; add nodes, lower ray.cpus_per_worker, or use a "
            "smaller allocation_mode"
        )


def first_line(e: BaseException) -> str:
    """``Type: first line`` of an error, plus Ray's "... because ..." line if any."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = [ln for ln in lines[1:] if "because" in ln][:1]
    return f"{type(e).__name__}: {' '.join(lines[:1] + why)}"[:400]


def warn_if_file_backend_on_many_nodes(spec: str) -> None:
    import ray

    n_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if spec.strip().startswith("file") and n_nodes > 1:
        logger.warning(
            f"name_resolve={spec} on a {n_nodes}-node cluster: workers on other nodes find "
            "each other only if that directory is on a file system all nodes share; "
            "otherwise give name_resolve=ray (this cluster's GCS) or etcd3://host:port."
        )


def write_placement(run_dir: str, placements: Dict[str, dict], gcs_address: str) -> None:
    import ray

    nodes = {
        n["NodeID"]: {
            "ip": n["NodeManagerAddress"],
            "hostname": n["NodeManagerHostname"],
            "resources": n["Resources"],
        }
        for n in ray.nodes()
        if n.get("Alive")
    }
    used = {p["node_id"] for p in placements.values()}
    write_json_atomic(
        os.path.join(run_dir, "placement.json"),
        {
            "gcs_address": gcs_address,
            "workers": placements,
            "nodes": {k: v for k, v in nodes.items() if k in used},
        },
    )
    lines = [
        f"  {name:<24} node {p['node_id'][:12]} ({p['node_ip']}) pid {p['pid']}"
        for name, p in placements.items()
    ]
    logger.info(
        f"placement on {len(used)} node(s), written to {run_dir}/placement.json:\n"
        + "\n".join(lines)
    )


@contextlib.contextmanager
def connect(options: RayConfig, *, run_dir: str, wanted_cpus: float = 1.0) -> Iterator[str]:
    """Connect this process to the Ray cluster of ``options``; yield its GCS address.

    An existing connection (``ray.is_initialized()``) is used and left open.  Otherwise
    ``options.address`` is probed within ``connect_timeout_s`` and joined, or, when it is
    empty, a local cluster is started with at least ``wanted_cpus`` CPUs; either is
    disconnected (the local one shut down) at the end.

    Raises:
        RayClusterError: naming the address, when nothing answers there.
    """
    try:
        import ray
    except ImportError as e:
        raise RayClusterError(f"mode=ray needs Ray: pip install 'ray==2.60.0' ({e})") from e
    if ray.is_initialized():
        yield ray.get_runtime_context().gcs_address
        return
    if not options.address.strip():
        with _local_cluster(options, run_dir, wanted_cpus) as gcs_address:
            yield gcs_address
        return
    address = _reachable_address(options)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except Exception as e:
        raise RayClusterError(
            f"Cannot join the Ray cluster at {address} (ray.address={options.address!r}): "
            f"{first_line(e)}"
        ) from e
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _reachable_address(options: RayConfig) -> str:
    """``options.address`` with ``auto`` resolved, after a TCP probe of it."""
    address = options.address.strip()
    if address == "auto":
        try:  # how ray.init finds it: $RAY_ADDRESS, else the last cluster started here
            from ray._private.services import canonicalize_bootstrap_address_or_die

            address = canonicalize_bootstrap_address_or_die("auto")
        except Exception as e:
            raise RayClusterError(
                f"ray.address=auto found no running Ray cluster ({first_line(e)}); start one "
                "with `ray start --head`, give its host:port, or leave ray.address empty for "
                "a local cluster."
            ) from e
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=options.connect_timeout_s):
            pass
    except OSError as e:
        raise RayClusterError(
            f"Cannot reach the Ray cluster at {address} (ray.address={options.address!r}) "
            f"within {options.connect_timeout_s:g}s: {e}. Start it (`ray start --head "
            f"--port {port}`), fix ray.address, or leave it empty to start a local cluster."
        ) from e
    return address


@contextlib.contextmanager
def _local_cluster(options: RayConfig, run_dir: str, wanted_cpus: float) -> Iterator[str]:
    """A one-node cluster for this run, in a temp dir of its own, with a fresh auth token."""
    import ray

    temp_dir, remove_after = _local_temp_dir(options, run_dir)
    # Ray >= 2.5x enables token auth for local clusters and would write the token to
    # ~/.ray/auth_token; a token in the environment is used instead and reaches every
    # process of the cluster (and the name-resolve clients of the workers) by inheritance.
    env = {}
    if "RAY_AUTH_MODE" not in os.environ and not os.environ.get("RAY_AUTH_TOKEN"):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env["RAY_USAGE_STATS_ENABLED"] = os.environ.get("RAY_USAGE_STATS_ENABLED", "0")
    num_cpus = options.local_num_cpus or max(os.cpu_count() or 1, math.ceil(wanted_cpus))
    try:
        with ray_environ(env):
            logger.info(f"starting a local Ray cluster ({num_cpus} CPUs) in {temp_dir}")
            try:
                ray.init(
                    address="local",
                    num_cpus=num_cpus,
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    log_to_driver=False,
                    _temp_dir=temp_dir,
                )
            except Exception as e:
                raise RayClusterError(
                    f"Could not start a local Ray cluster in {temp_dir}: {first_line(e)}"
                ) from e
            try:
                yield ray.get_runtime_context().gcs_address
            finally:
                ray.shutdown()
    finally:
        if remove_after:
            shutil.rmtree(temp_dir, ignore_errors=True)


def _local_temp_dir(options: RayConfig, run_dir: str) -> Tuple[str, bool]:
    """(temp dir of the local cluster, whether to remove it at the end)."""
    if options.temp_dir:
        path = os.path.abspath(os.path.expanduser(options.temp_dir))
        os.makedirs(path, exist_ok=True)
        return path, False
    in_run = os.path.join(run_dir, "ray")
    if len(in_run) + _SOCKET_SUFFIX_LEN <= _SOCKET_PATH_MAX:
        os.makedirs(in_run, exist_ok=True)
        return in_run, False
    # Ray's socket paths under the run dir would exceed the AF_UNIX limit.
    return tempfile.mkdtemp(prefix="realhf-ray-"), True


@contextlib.contextmanager
def ray_environ(values: Dict[str, str]) -> Iterator[None]:
    """Within: ``os.environ`` with ``values`` set, and this process's Ray core reading
    its auth mode and token from it; after: ``values``' variables and the auth ones
    (``ray.init`` may set ``RAY_AUTH_MODE``) as they were, and re-read."""
    saved = {k: os.environ.get(k) for k in (*values, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(values)
    _reload_ray_auth_config()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_auth_config()


def _reload_ray_auth_config() -> None:
    """Make this process's Ray core re-read RAY_AUTH_* (it caches them: ``ray.init``
    may have switched it to token mode, or the environment changed)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception as e:  # private API of Ray; a later ray.init would say what is wrong
        logger.debug(f"could not reload Ray's auth config: {e!r}")
