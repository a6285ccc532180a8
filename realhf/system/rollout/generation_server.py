"""A generation server as a worker: serve one model over SGLang's HTTP protocol.

Worker type ``generation_server``.  On ``configure`` it starts its backend —

* ``builtin``: our engine (:mod:`realhf.impl.model.gen`, CPU or GPU) behind its FastAPI app
  in a thread of this process;
* ``sglang``: ``python -m sglang.launch_server`` as a child process
  (:mod:`realhf.system.rollout.sglang_launcher`), token ids only;
* ``vllm``: vLLM's OpenAI server as a child process (often from a venv of its own), behind
  the adapter of :mod:`realhf.system.rollout.vllm_backend` in a thread of this process,
  which speaks the same protocol;
* ``auto``: SGLang when the package and a CUDA device are present, else builtin —

waits until ``/health`` answers, and registers its URL under ``names.gen_servers`` with a
keepalive TTL (so the gserver manager stops routing to it soon after it dies).  While
running it checks that the backend is alive (a dead backend fails the worker, naming it) and
ends (COMPLETED) when ``names.experiment_status`` leaves RUNNING.  Weight updates and
pauses come from the gserver manager over HTTP, with the run's token; the server loads
weights from under ``weights_root`` only (the run's publication directory by default) and,
the built-in engine with ``weight_sync=shm``, flat files from the run's
:func:`~realhf.base.constants.weight_shm_root` only; its generation routes want
``api_key`` (see :class:`GenerationServerConfig`).
"""

from __future__ import annotations

import importlib.util
import time
from typing import TYPE_CHECKING, List, Optional

from realhf.api.core.rollout_config import GenerationBackend, GenerationServerConfig
from realhf.base import constants, name_resolve, names, worker_faults
from realhf.base.gcutil import freeze_startup_objects
from realhf.base.net import network
from realhf.base.net.http_server import ServerThread, generation_api_keys
from realhf.system.rollout.sglang_launcher import (
    ServerProcess,
    SGLangConfig,
    SGLangServer,
    wait_healthy,
)
from realhf.system.worker.base import PollResult, Worker, experiment_ended, register_worker

if TYPE_CHECKING:  # the built-in backend is imported only when it is used
    from realhf.impl.model.gen.engine import GenerationEngine

__all__ = ["resolve_backend", "GenerationServer"]


def resolve_backend(backend: GenerationBackend | str) -> GenerationBackend:
    """``builtin`` or ``sglang`` for a configured ``backend`` (``auto`` decides by what is
    installed)."""
    backend = GenerationBackend(backend)
    has_sglang = importlib.util.find_spec("sglang") is not None
    if backend is GenerationBackend.AUTO:
        import torch

        if has_sglang and torch.cuda.is_available():
            return GenerationBackend.SGLANG
        return GenerationBackend.BUILTIN
    if backend is GenerationBackend.SGLANG and not has_sglang:
        raise ValueError(
            "GenerationServerConfig.backend='sglang' but the sglang package is not installed; "
            "install it (GPU machines) or use backend='builtin'"
        )
    return backend


@register_worker("generation_server")
class GenerationServer(Worker):
    """See the module docstring."""

    config_class = GenerationServerConfig

    # What _exit_hook releases, None until built: shutdown must work from any state,
    # also before configure or after a configure that raised half-way (e.g. a backend
    # that started but never became healthy).
    engine: Optional[GenerationEngine] = None
    http: Optional[ServerThread] = None
    sglang: Optional[SGLangServer] = None
    vllm: Optional[ServerProcess] = None
    _key: Optional[str] = None

    def _configure(self, config: GenerationServerConfig) -> None:
        self.backend = resolve_backend(config.backend)
        self.engine = self.http = self.sglang = self.vllm = None
        self._key: Optional[str] = None
        host = config.host or network.gethostip()
        start = {
            GenerationBackend.BUILTIN: self._start_builtin,
            GenerationBackend.SGLANG: self._start_sglang,
            GenerationBackend.VLLM: self._start_vllm,
        }[self.backend]
        t0 = time.monotonic()
        self.url = start(config, host)
        wait_healthy(self.url, config.health_timeout_s)
        waited = time.monotonic() - t0
        self._key = name_resolve.add_subentry(
            names.gen_servers(self.experiment_name, self.trial_name),
            self.url,
            keepalive_ttl=config.registration_ttl_s,
        )
        self._next_check = 0.0
        self.logger.info(
            f"{self.backend} generation server for {config.model_path} at {self.url} "
            f"(started and healthy in {waited:.1f}s)"
        )

    def _start_builtin(self, config: GenerationServerConfig, host: str) -> str:
        from realhf.api.core.gen_api import GenerateRequest, SamplingParams
        from realhf.impl.model.gen.engine_config import EngineConfig
        from realhf.impl.model.gen.http_app import create_app
        from realhf.impl.model.gen.loading import load_engine, load_tokenizer

        engine_config = EngineConfig(
            max_running_requests=config.max_running_requests,
            context_length=config.context_length,
            kv_cache_tokens=config.kv_cache_tokens,
            dtype=config.dtype,
            device=config.device,
            seed=config.seed,
            num_threads=config.num_threads,
            pack_weights=config.pack_weights,
            request_timeout_s=config.request_timeout_s,
        )
        tokenizer = load_tokenizer(config.model_path)
        if engine_config.torch_device.type == "cuda":  # a GPU shared with trainers
            constants.apply_cuda_memory_fraction(engine_config.torch_device)
        self.engine = load_engine(
            config.model_path, engine_config, tokenizer=tokenizer, lora=config.lora
        ).start()
        # One tiny request first: compiling kernels should not land on a rollout's latency.
        warm = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        self.engine.generate(
            [GenerateRequest(input_ids=(0,), sampling=warm)], timeout=config.health_timeout_s
        )
        app = create_app(
            self.engine,
            tokenizer=tokenizer,
            model_path=config.model_path,
            served_model_name=self.worker_name.replace("/", "-"),
            max_concurrent_requests=config.max_concurrent_requests,
            weights_root=self._weights_root(config),
            api_keys=generation_api_keys(config.api_key, host),
            shm_root=constants.weight_shm_root(self.experiment_name, self.trial_name),
        )
        url = self._serve(app, host, config)
        freeze_startup_objects()  # the collector walks only what serving makes
        return url

    def _weights_root(self, config: GenerationServerConfig) -> str:
        """Where weight updates may load from: the configured root, else the run's
        publication directory (where the trainer publishes every version)."""
        return config.weights_root or constants.weight_publication_root(
            self.experiment_name, self.trial_name
        )

    def _serve(self, app, host: str, config: GenerationServerConfig) -> str:
        """Serve ``app`` (our servers' protocol) on ``host:config.port``; its URL."""
        # Reliability tests inject faults into this server's answers ($REALHF_FAULTS).
        app = worker_faults.wrap_asgi(
            app, worker_faults.faults_of(self.worker_name), self.worker_name
        )
        self.http = ServerThread(app, host=host, port=config.port).start(
            timeout=config.health_timeout_s
        )
        return self.http.url

    def _start_sglang(self, config: GenerationServerConfig, host: str) -> str:
        if config.api_key:
            # SGLang takes its key on its command line, which every user of the machine can
            # read: refused rather than leaked or silently ignored.
            raise ValueError(
                "GenerationServerConfig.api_key is not supported with backend='sglang' "
                "(SGLang reads its key from its command line, visible to every local user); "
                "use backend='builtin' or 'vllm', or leave api_key unset"
            )
        port = config.port or network.find_free_port(host=host)
        cfg = SGLangConfig(
            model_path=config.model_path,
            host=host,
            port=port,
            skip_tokenizer_init=True,
            dtype=config.dtype,
            context_length=config.context_length,
            random_seed=config.seed,
            max_running_requests=config.max_running_requests,
            **dict(config.sglang_args),
        )
        log = constants.worker_log_path(
            f"{self.worker_name}.sglang", self.experiment_name, self.trial_name
        )
        self.sglang = SGLangServer(cfg, log_path=log).start(health_timeout=config.health_timeout_s)
        return cfg.url

    def _start_vllm(self, config: GenerationServerConfig, host: str) -> str:
        from realhf.impl.model.gen.loading import load_tokenizer
        from realhf.system.rollout import vllm_backend

        cfg = vllm_backend.server_config(config, self.worker_name.replace("/", "-"))
        python = vllm_backend.find_vllm_python(config.vllm_python)
        log = constants.worker_log_path(
            f"{self.worker_name}.vllm", self.experiment_name, self.trial_name
        )
        self.logger.info(f"starting vLLM ({python}) for {config.model_path}; log: {log}")
        self.vllm = vllm_backend.VLLMServer(cfg, python=python, log_path=log).start(
            health_timeout=config.health_timeout_s
        )
        tok = load_tokenizer(config.model_path)
        stops = tuple(t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None)
        app = vllm_backend.create_adapter_app(
            cfg.url,
            cfg.served_model_name,
            stop_token_ids=stops,
            request_timeout_s=config.request_timeout_s,
            weights_root=self._weights_root(config),
            shm_root=constants.weight_shm_root(self.experiment_name, self.trial_name),
            model_dir=config.model_path,
            api_keys=generation_api_keys(config.api_key, host),
            max_concurrent_requests=config.max_concurrent_requests,
        )
        return self._serve(app, host, config)

    def _backend_problem(self) -> Optional[str]:
        if self.engine is not None and not self.engine.alive:
            return (
                f"its engine thread died (last error: {self.engine.last_error or 'none recorded'})"
            )
        if self.http is not None and not self.http._thread.is_alive():
            return "its HTTP thread exited"
        for server in self._server_processes():
            if server.process.poll() is not None:
                problem = (
                    f"the {server.name} process exited with code {server.process.returncode} "
                    f"(log: {server.log_path})"
                )
                # Now, not in the exit hook: the launcher may SIGKILL this worker to restart
                # it, and what the server left (its children, vLLM's socket directory) would
                # stay behind.
                try:
                    server.stop(timeout=5.0)
                except TimeoutError as e:
                    problem += f"; {e}"
                return problem
        return None

    def _server_processes(self) -> List[ServerProcess]:
        """The external engines this worker started (SGLang or vLLM), if any."""
        return [p for p in (self.sglang, self.vllm) if p is not None]

    def _poll(self) -> PollResult:
        now = time.monotonic()
        if now < self._next_check:
            time.sleep(min(0.05, self._next_check - now))
            return PollResult()
        self._next_check = now + self.config.poll_interval_s
        problem = self._backend_problem()
        if problem is not None:
            raise RuntimeError(f"generation server {self.url} ({self.backend}) is down: {problem}")
        if experiment_ended(self.experiment_name, self.trial_name):
            self._withdraw()
            self.logger.info("the experiment ended; the generation server stops")
            return PollResult(completed=True)
        return PollResult()

    def _withdraw(self) -> None:
        if self._key is not None:
            try:
                name_resolve.delete(self._key)
            except name_resolve.NameEntryNotFoundError:
                pass
            self._key = None

    def _exit_hook(self) -> None:
        # Each resource is None until built (class attributes above).
        self._withdraw()
        if self.http is not None:
            self.http.stop()
        if self.engine is not None:
            self.engine.close()
        for server in self._server_processes():
            server.stop()
