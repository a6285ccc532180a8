"""A generation server worker configured and started in this process, for rollout tests."""

from __future__ import annotations

from realhf.api.core.rollout_config import GenerationServerConfig
from realhf.api.core.system_api import WorkerInformation
from realhf.system.rollout.generation_server import GenerationServer

#: small and quick: our engine with one thread and two running requests
DEFAULTS = dict(
    backend="builtin",
    host="127.0.0.1",
    max_running_requests=2,
    num_threads=1,
    health_timeout_s=60,
    poll_interval_s=0.01,
)


def start_generation_server(trial: str, model_dir: str, **overrides) -> GenerationServer:
    """Worker ``generation_server/0`` of experiment ``exp``, ``trial``, serving
    ``model_dir``, configured (``DEFAULTS`` updated by ``overrides``) and started."""
    w = GenerationServer("exp", trial, "generation_server", 0)
    cfg = GenerationServerConfig(model_path=model_dir, **{**DEFAULTS, **overrides})
    w.handle_control(
        "configure",
        worker_info=WorkerInformation("exp", trial, "generation_server", 0, 1),
        config=cfg,
    )
    w.handle_control("start")
    return w
