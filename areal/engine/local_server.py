"""A generation server of the built-in engine in a process of its own, for light scripts.

    with LocalGenerationServer(model_dir, num_threads=1) as url:
        engine = RemoteInferenceEngine([url])

The server is ``python -m realhf.apps.serve`` (realhf's engine behind its SGLang-compatible
HTTP app, on 127.0.0.1), run by realhf's helper for server processes
(:class:`~realhf.system.rollout.sglang_launcher.ServerProcess`, as the generation server
worker runs SGLang and vLLM): the context manager starts it on a free port in a process group
of its own, waits (bounded) for ``/health`` (a failure quotes the server's log), and stops the
whole group on exit.  The server is tied to this process's life: if this process dies without
exiting the context (SIGKILL, a crash), Linux sends the server SIGTERM, so it never outlives
the script holding the port and the model's memory.  On a cluster, start SGLang or this
module on the generation machines and pass their URLs instead.

The server shares this process's secret (``$REALHF_RUN_SECRET``, made here if this process
has none), so ``RemoteInferenceEngine`` in this process may call its control routes; weight
updates load from under ``weights_root`` only (where the caller saves its versions).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional

from realhf.base.net import auth, network
from realhf.system.rollout.sglang_launcher import ServerProcess

__all__ = ["LocalGenerationServer"]


class LocalGenerationServer:
    """See the module docstring.

    Args:
        model_dir: HuggingFace directory of the weights to start with.
        num_threads: torch threads of the server (None: torch's default).
        context_length: longest prompt + answer.
        max_running_requests: sequences decoded together (a batch of 32 prompts x 8
            answers is 256).
        start_timeout_s: how long to wait for the server to answer ``/health``.
        log_path: file for the server's output; None = ``realhf_local_server_<port>.log``
            in the temporary directory.
        weights_root: the directory the caller saves weight versions under; the server
            loads updates from there only (None: it takes no weight updates).
        shm_root: the directory (in /dev/shm) flat weight files are written under
            (``weight_sync=shm``); the server maps them from there only.
    """

    def __init__(
        self,
        model_dir: str,
        num_threads: Optional[int] = None,
        context_length: int = 512,
        max_running_requests: int = 256,
        start_timeout_s: float = 120.0,
        weights_root: Optional[str] = None,
        log_path: Optional[str] = None,
        shm_root: Optional[str] = None,
    ):
        self.max_running_requests = max_running_requests
        self.model_dir = model_dir
        self.num_threads = num_threads
        self.context_length = context_length
        self.start_timeout_s = start_timeout_s
        self.weights_root = weights_root
        self.shm_root = shm_root
        self.log_path = log_path
        self.server: Optional[ServerProcess] = None
        self.url = ""

    def __enter__(self) -> str:
        port = network.find_free_port(host="127.0.0.1")
        cmd = [
            sys.executable,
            "-m",
            "realhf.apps.serve",
            "--model-path",
            os.path.abspath(self.model_dir),
            "--port",
            str(port),
            "--context-length",
            str(self.context_length),
            "--max-running-requests",
            str(self.max_running_requests),
        ]
        if self.num_threads:
            cmd += ["--num-threads", str(self.num_threads)]
        if self.weights_root:
            cmd += ["--weights-root", os.path.abspath(self.weights_root)]
        if self.shm_root:
            cmd += ["--shm-root", os.path.abspath(self.shm_root)]
        auth.run_secret()  # made now if this process has none: the child inherits it
        url = f"http://127.0.0.1:{port}"
        log = self.log_path or os.path.join(
            tempfile.gettempdir(), f"realhf_local_server_{port}.log"
        )
        # Start from a thread that lives as long as the process (the main one, as a script
        # does): Linux signals the server when the thread that started it ends.
        server = ServerProcess("generation server", cmd, url, log_path=log)
        server.start(health_timeout=self.start_timeout_s)  # stops it if it fails
        self.server, self.url = server, url
        return url

    def __exit__(self, *exc) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop(timeout=10)
