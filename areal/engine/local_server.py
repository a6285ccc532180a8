"""A generation server of the built-in engine in a process of its own, for light scripts.

    with LocalGenerationServer(model_dir, num_threads=1) as url:
        engine = RemoteInferenceEngine([url])

The server is ``python -m realhf.apps.serve`` (realhf's engine behind its SGLang-compatible
HTTP app, on 127.0.0.1); the context manager starts it on a free port, waits (bounded) for
``/health``, and stops it by PID on exit.  On a cluster, start
SGLang or this module on the generation machines and pass their URLs instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

import requests

from realhf.base.net import network

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
    """

    def __init__(
        self,
        model_dir: str,
        num_threads: Optional[int] = None,
        context_length: int = 512,
        max_running_requests: int = 256,
        start_timeout_s: float = 120.0,
    ):
        self.max_running_requests = max_running_requests
        self.model_dir = model_dir
        self.num_threads = num_threads
        self.context_length = context_length
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""

    def __enter__(self) -> str:
        port = network.find_free_port()
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
        self.proc = subprocess.Popen(cmd)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the generation server for {self.model_dir} exited with {self.proc.returncode}"
                )
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise TimeoutError(
            f"the generation server for {self.model_dir} did not answer /health on {self.url} "
            f"within {self.start_timeout_s:g}s"
        )

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
