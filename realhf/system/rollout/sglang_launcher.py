"""Launch an SGLang server as a subprocess and wait until it is healthy.

:class:`SGLangConfig` holds the ``python -m sglang.launch_server`` options that
realhf sets (SGLang's own names, underscores for dashes);
:func:`build_command` turns it into the command line: ``True`` booleans become
bare flags, ``False`` and ``None`` values are left out, everything else becomes
``--flag value``. :class:`SGLangServer` starts the process, waits for
``GET /health`` with a timeout (failing with the exit code and the log tail if
the process dies first) and stops it.  The server runs in its own session, and
stopping it signals that whole process group: SGLang's scheduler and
detokenizer processes hold GPU memory and must not outlive it.

SGLang needs a CUDA GPU; on CPU-only machines the built-in engine
(:mod:`realhf.apps.serve`) serves the same protocol.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Tuple

from realhf.base.distributed import proc_group
from realhf.base.net import auth

_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_POLICIES = ("lpm", "random", "fcfs", "dfs-weight", "lof")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _fail(field: str, value, fix: str):
    raise ValueError(f"SGLangConfig.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass
class SGLangConfig:
    """Options of ``sglang.launch_server`` (see SGLang's ``server_args.py``).

    Attributes:
        model_path: HuggingFace directory or hub id.
        host, port: where the HTTP server listens.
        tokenizer_path: defaults to ``model_path`` inside SGLang.
        skip_tokenizer_init: serve token ids only (AReaL's rollouts do).
        dtype: weight dtype (``auto``, ``bfloat16``, ...).
        context_length: override the model's context length.
        tp_size: tensor-parallel GPUs of this server.
        dp_size: must be 1 — the gserver manager balances across servers.
        base_gpu_id: first GPU index the server uses.
        dist_init_addr: ``host:port`` for multi-node tensor parallelism.
        nnodes, node_rank: multi-node layout.
        random_seed: SGLang's sampling seed.
        mem_fraction_static: GPU memory fraction for weights and KV cache.
        max_running_requests, max_prefill_tokens, chunked_prefill_size:
            scheduler limits (``None`` keeps SGLang's defaults).
        schedule_policy: SGLang's queue policy.
        disable_radix_cache, disable_cuda_graph: switch those features off.
        attention_backend: e.g. ``flashinfer``, ``triton``; ``None`` = default.
        enable_metrics: expose ``/metrics`` (the manager's ``least_token_usage``
            policy reads ``sglang:num_used_tokens``).
        served_model_name: name in ``/v1/models``.
        trust_remote_code: allow custom model code.
        log_level: SGLang's log level.
        extra_args: appended verbatim for options not listed here.
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    tokenizer_path: Optional[str] = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    context_length: Optional[int] = None
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    dist_init_addr: Optional[str] = None
    nnodes: int = 1
    node_rank: int = 0
    random_seed: int = 1
    mem_fraction_static: Optional[float] = 0.8
    max_running_requests: Optional[int] = None
    max_prefill_tokens: Optional[int] = None
    chunked_prefill_size: Optional[int] = None
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    disable_cuda_graph: bool = False
    attention_backend: Optional[str] = None
    enable_metrics: bool = True
    served_model_name: Optional[str] = None
    trust_remote_code: bool = False
    log_level: str = "warning"
    extra_args: Tuple[str, ...] = ()

    def __post_init__(self):
        if not self.model_path:
            _fail("model_path", self.model_path, "give a model directory or hub id")
        if not (isinstance(self.port, int) and 0 < self.port < 65536):
            _fail("port", self.port, "use a port in 1..65535")
        for name in ("tp_size", "nnodes"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                _fail(name, getattr(self, name), "use an integer >= 1")
        if self.dp_size != 1:
            _fail(
                "dp_size",
                self.dp_size,
                "run one SGLang server per data-parallel replica (dp_size=1)",
            )
        if not 0 <= self.node_rank < self.nnodes:
            _fail("node_rank", self.node_rank, f"use 0..{self.nnodes - 1}")
        if self.base_gpu_id < 0:
            _fail("base_gpu_id", self.base_gpu_id, "use a GPU index >= 0")
        if self.nnodes > 1 and not self.dist_init_addr:
            _fail("dist_init_addr", self.dist_init_addr, "multi-node servers need host:port")
        if self.dtype not in _DTYPES:
            _fail("dtype", self.dtype, f"use one of {_DTYPES}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            _fail("mem_fraction_static", self.mem_fraction_static, "use a fraction in (0, 1)")
        if self.schedule_policy not in _POLICIES:
            _fail("schedule_policy", self.schedule_policy, f"use one of {_POLICIES}")
        if self.log_level not in _LOG_LEVELS:
            _fail("log_level", self.log_level, f"use one of {_LOG_LEVELS}")
        for name in (
            "context_length",
            "max_running_requests",
            "max_prefill_tokens",
            "chunked_prefill_size",
        ):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):
                _fail(name, v, "use an integer >= 1 or None")
        if isinstance(self.extra_args, str):
            _fail("extra_args", self.extra_args, "use a list of separate arguments")
        self.extra_args = tuple(str(a) for a in self.extra_args)

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"


def build_command(config: SGLangConfig, python: str = sys.executable) -> List[str]:
    """The ``python -m sglang.launch_server ...`` argument list for ``config``."""
    cmd = [python, "-m", "sglang.launch_server"]
    for f in dataclasses.fields(config):
        if f.name == "extra_args":
            continue
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cmd.append(flag)
        else:
            cmd += [flag, str(value)]
    return cmd + list(config.extra_args)


def _tail(path: Optional[str], n: int = 2000) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace")


def wait_healthy(
    url: str,
    timeout: float,
    *,
    process: Optional[subprocess.Popen] = None,
    log_path: Optional[str] = None,
    path: str = "/health",
    interval: float = 0.5,
) -> float:
    """Poll ``GET url + path`` until it answers 200; returns the seconds waited.

    Raises ``RuntimeError`` (with the exit code and log tail) if ``process``
    exits first, ``TimeoutError`` after ``timeout`` seconds.
    """
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server process for {url} exited with code {process.returncode} before "
                f"it became healthy; log tail:\n{_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(url + path, timeout=max(interval, 1.0)) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(
                f"{url}{path} did not answer 200 within {timeout} s; log tail:\n{_tail(log_path)}"
            )
        time.sleep(interval)


class ServerProcess:
    """One HTTP server process started in its own session and stopped as a process group.

    Args:
        name: what it is, for messages (``SGLang``, ``vLLM``).
        command: its argument list.
        url: its base URL (``/health`` is polled there).
        log_path: file receiving its stdout and stderr.
        env: extra environment variables (e.g. ``CUDA_VISIBLE_DEVICES``).
    """

    def __init__(
        self,
        name: str,
        command: List[str],
        url: str,
        *,
        log_path: str,
        env: Optional[Dict[str, str]] = None,
    ):
        self.name = name
        self.command = list(command)
        self.url = url
        self.log_path = log_path
        # The server shares this process's run secret (its control routes want the token).
        self.env = {**os.environ, **auth.child_env(), **(env or {})}
        self.process: Optional[subprocess.Popen] = None

    def start(self, health_timeout: float = 600.0):
        """Start the process and return ``self`` once ``/health`` answers 200."""
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            # Its own session makes its pid the id of a process group that the server's
            # children inherit, so that stop() can reach them all; and it gets SIGTERM if
            # this process dies without stopping it (SIGKILL) instead of running on.
            self.process = subprocess.Popen(
                proc_group.dying_with_parent(self.command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        finally:
            log.close()  # the child holds its own descriptor
        try:
            wait_healthy(self.url, health_timeout, process=self.process, log_path=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM the server's process group, SIGKILL it after ``timeout`` s.

        Returns the server's exit code (None if it was never started).  The group is
        signalled even when the server itself has exited already: its children may not
        have.

        Raises:
            TimeoutError: processes of the group still live ``timeout`` s after SIGKILL.
        """
        p = self.process
        if p is None:
            return None
        stuck = proc_group.stop_groups([p], grace=timeout, kill_timeout=timeout)
        if stuck:
            raise TimeoutError(
                f"the {self.name} server's process group {p.pid} ({self.url}) still has "
                f"live processes {timeout:g}s after SIGKILL; log: {self.log_path}"
            )
        return p.returncode


class SGLangServer(ServerProcess):
    """One SGLang server process (SGLang's scheduler and detokenizer processes hold GPU
    memory and must not outlive it: they go with the group).

    Args:
        config: its options.
        log_path: file receiving the server's stdout and stderr.
        env: extra environment variables (e.g. ``CUDA_VISIBLE_DEVICES``).
        python: interpreter that has ``sglang`` installed.
    """

    def __init__(
        self,
        config: SGLangConfig,
        *,
        log_path: str,
        env: Optional[Dict[str, str]] = None,
        python: str = sys.executable,
    ):
        super().__init__(
            "SGLang", build_command(config, python), config.url, log_path=log_path, env=env
        )
        self.config = config
