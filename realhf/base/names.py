"""Every name-resolve key realhf uses, built in one place.

Keys are ``/``-separated paths, all under ``trial_root(experiment, trial)`` =
``{user}/{experiment}/{trial}``, so one trial's keys can be listed or cleared
with ``name_resolve.clear_subtree(names.trial_root(exp, trial))`` and two trials
(or two users on one etcd) never collide.  Other modules call these functions;
they never spell a key as a string literal.

Keys that many processes register under (e.g. every rollout worker's puller
address) are *roots*: register with ``name_resolve.add_subentry(root, value)``
and read all with ``name_resolve.get_subtree(root)``.
"""

from __future__ import annotations

from realhf.base import constants

__all__ = [
    "trial_root",
    "worker_status",
    "worker_status_root",
    "worker_root",
    "worker",
    "worker_key",
    "request_reply_stream_root",
    "request_reply_stream",
    "push_pull_stream_root",
    "push_pull_stream",
    "push_pull_stream_peers",
    "distributed_root",
    "distributed_peer",
    "distributed_local_peer",
    "distributed_master",
    "model_version",
    "metrics",
    "metric_server",
    "gen_servers",
    "gen_server_manager",
    "training_samples",
    "used_data_ids",
    "experiment_status",
    "restart_request",
    "restart_requests",
    "stream_missing",
    "rollout_worker_state",
    "update_weights_from_disk",
]


def _seg(kind: str, value) -> str:
    """Validate a key segment: a non-empty string/int without empty parts."""
    # name_resolve.normalize_key() would reject "a//b" later, but without
    # saying which name was wrong, and it silently strips a trailing "/", so
    # a segment "x/" at the end of a key would alias the key of "x".
    s = str(value)
    if not s or s.startswith("/") or s.endswith("/") or "//" in s:
        raise ValueError(
            f"{kind} {value!r} is not a valid name-resolve key segment: it must be "
            "non-empty and not start/end with '/' or contain '//'."
        )
    return s


def trial_root(experiment_name: str, trial_name: str) -> str:
    """``{user}/{experiment}/{trial}``: the prefix of all of a trial's keys."""
    return "/".join(
        (
            _seg("user", constants.user()),
            _seg("experiment_name", experiment_name),
            _seg("trial_name", trial_name),
        )
    )


def worker_status_root(experiment_name: str, trial_name: str) -> str:
    """Root of all workers' status entries."""
    return f"{trial_root(experiment_name, trial_name)}/status"


def worker_status(experiment_name: str, trial_name: str, worker_name: str) -> str:
    """Status (a WorkerServerStatus value) of worker ``worker_name``."""
    return f"{worker_status_root(experiment_name, trial_name)}/{_seg('worker_name', worker_name)}"


def worker_root(experiment_name: str, trial_name: str) -> str:
    """Root of all workers' control-socket addresses."""
    return f"{trial_root(experiment_name, trial_name)}/worker"


def worker(experiment_name: str, trial_name: str, worker_name: str) -> str:
    """Control-socket address of worker ``worker_name`` (e.g. ``model_worker/0``)."""
    return f"{worker_root(experiment_name, trial_name)}/{_seg('worker_name', worker_name)}"


def worker_key(experiment_name: str, trial_name: str, key: str) -> str:
    """A free-form per-trial key that workers use to exchange small facts."""
    return f"{trial_root(experiment_name, trial_name)}/worker_key/{_seg('key', key)}"


def request_reply_stream_root(experiment_name: str, trial_name: str) -> str:
    """Root of all request/reply stream addresses."""
    return f"{trial_root(experiment_name, trial_name)}/request_reply_stream"


def request_reply_stream(experiment_name: str, trial_name: str, stream_name: str) -> str:
    """Address of the request/reply stream ``stream_name`` (master <-> model workers)."""
    root = request_reply_stream_root(experiment_name, trial_name)
    return f"{root}/{_seg('stream_name', stream_name)}"


def push_pull_stream_root(experiment_name: str, trial_name: str) -> str:
    """Root of all push/pull stream (puller) addresses."""
    return f"{trial_root(experiment_name, trial_name)}/push_pull_stream"


def push_pull_stream(experiment_name: str, trial_name: str, stream_name: str) -> str:
    """Puller address(es) of push/pull stream ``stream_name`` (rollouts -> trainer)."""
    return (
        f"{push_pull_stream_root(experiment_name, trial_name)}/{_seg('stream_name', stream_name)}"
    )


def push_pull_stream_peers(experiment_name: str, trial_name: str, stream_name: str) -> str:
    """Root under which pushers of ``stream_name`` register (one subentry each)."""
    return (
        f"{trial_root(experiment_name, trial_name)}/push_pull_stream_peers/"
        f"{_seg('stream_name', stream_name)}"
    )


def distributed_root(experiment_name: str, trial_name: str) -> str:
    """Root of torch.distributed rendezvous keys."""
    return f"{trial_root(experiment_name, trial_name)}/distributed"


def distributed_peer(experiment_name: str, trial_name: str, model_name: str) -> str:
    """Root where every rank of ``model_name``'s group registers (subentries)."""
    return f"{distributed_root(experiment_name, trial_name)}/peer/{_seg('model_name', model_name)}"


def distributed_local_peer(
    experiment_name: str, trial_name: str, host_name: str, model_name: str
) -> str:
    """Root where ranks of ``model_name`` on host ``host_name`` register."""
    return (
        f"{distributed_root(experiment_name, trial_name)}/local_peer/"
        f"{_seg('host_name', host_name)}/{_seg('model_name', model_name)}"
    )


def distributed_master(experiment_name: str, trial_name: str, model_name: str) -> str:
    """``host:port`` of the rendezvous master of ``model_name``'s process group."""
    return (
        f"{distributed_root(experiment_name, trial_name)}/master/{_seg('model_name', model_name)}"
    )


def model_version(experiment_name: str, trial_name: str, model_role: str) -> str:
    """Latest published weight version (an int as text) of model ``model_role``."""
    return (
        f"{trial_root(experiment_name, trial_name)}/model_version/{_seg('model_role', model_role)}"
    )


def weight_sender(experiment_name: str, trial_name: str, model_role: str) -> str:
    """``host:port`` of the trainer's weight sender of ``model_role``
    (``weight_sync=broadcast``: generation servers pull new versions from it)."""
    return (
        f"{trial_root(experiment_name, trial_name)}/weight_sender/{_seg('model_role', model_role)}"
    )


def metrics(experiment_name: str, trial_name: str) -> str:
    """Root of metric-server entries (subentries)."""
    return f"{trial_root(experiment_name, trial_name)}/metrics"


def metric_server(experiment_name: str, trial_name: str, group: str, name: str) -> str:
    """Address of metric server ``name`` of ``group`` (e.g. tensorboard exporter)."""
    return f"{metrics(experiment_name, trial_name)}/{_seg('group', group)}/{_seg('name', name)}"


def gen_servers(experiment_name: str, trial_name: str) -> str:
    """Root where each generation server registers its ``host:port`` (subentries)."""
    return f"{trial_root(experiment_name, trial_name)}/gen_servers"


def gen_server_manager(experiment_name: str, trial_name: str) -> str:
    """``host:port`` of the gserver manager's HTTP endpoint."""
    return f"{trial_root(experiment_name, trial_name)}/gen_server_manager"


def training_samples(experiment_name: str, trial_name: str) -> str:
    """Count of samples the trainer has consumed (read by the gserver manager)."""
    return f"{trial_root(experiment_name, trial_name)}/training_samples"


def trainer_start(experiment_name: str, trial_name: str) -> str:
    """Set once by the master when the trainer is ready to consume trajectories: JSON
    ``{"trained_samples", "version", "checkpoint"}`` (the recover checkpoint it resumed
    from, or null).  The gserver manager and rollout workers wait for it, so they start
    counting and reading prompts from the trainer's position, never from a guess."""
    return f"{trial_root(experiment_name, trial_name)}/trainer_start"


def used_data_ids(experiment_name: str, trial_name: str) -> str:
    """Ids of dataset items already used in the current epoch (for recovery)."""
    return f"{trial_root(experiment_name, trial_name)}/used_data_ids"


def experiment_status(experiment_name: str, trial_name: str) -> str:
    """Lifecycle status of the whole experiment (e.g. RUNNING, COMPLETE, ABORTED)."""
    return f"{trial_root(experiment_name, trial_name)}/experiment_status"


def stop_request(experiment_name: str, trial_name: str) -> str:
    """Set (by ``python -m realhf.apps.main stop``) to ask the controller to stop the run."""
    return f"{trial_root(experiment_name, trial_name)}/stop_request"


def restart_request(experiment_name: str, trial_name: str, worker_name: str) -> str:
    """Set by the controller to have the launcher kill (and so restart) a restartable worker
    that is lost or failed: JSON ``{"pid", "reason"}``; the launcher deletes it."""
    return f"{restart_requests(experiment_name, trial_name)}/{worker_name}"


def restart_requests(experiment_name: str, trial_name: str) -> str:
    """Root of :func:`restart_request` keys."""
    return f"{trial_root(experiment_name, trial_name)}/restart_request"


def stream_missing(experiment_name: str, trial_name: str, stream_name: str) -> str:
    """JSON list of trajectory indices the trainer waits for (of its next batch), set while
    it waits: the gserver manager reissues those whose rollout worker died."""
    return (
        f"{trial_root(experiment_name, trial_name)}/stream_missing/"
        f"{_seg('stream_name', stream_name)}"
    )


def rollout_worker_state(experiment_name: str, trial_name: str, worker_name: str) -> str:
    """A rollout worker's data position in this launch (epoch and prompts pushed), so a
    restarted process of it continues there."""
    return f"{trial_root(experiment_name, trial_name)}/rollout_state/{worker_name}"


def update_weights_from_disk(experiment_name: str, trial_name: str, model_version: int) -> str:
    """Set when weights of ``model_version`` are on disk for servers to load."""
    return (
        f"{trial_root(experiment_name, trial_name)}/update_weights_from_disk/"
        f"{_seg('model_version', model_version)}"
    )
