"""A same-host attacker without the run's secret, pointed at a live run.

:class:`RunProbe` watches a run started by the local launcher (the ``Popen`` of its
quickstart) and, once its workers are up,

* records every listening socket of every process of the run (from ``/proc`` via psutil),
* sends each ZMQ socket the run published (worker control, request/reply, push/pull) a pickle
  that would create ``evil_path`` when unpickled, bare and with a forged MAC, through a
  socket type that socket accepts,
* calls the generation servers' and the manager's control routes without the run's token.

The test then checks that everything listened on loopback, that the file does not exist,
that the run finished, and what each route answered.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Dict, List, Set, Tuple

import psutil
import requests
import zmq

from realhf.base import name_resolve, names


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _processes(pid: int) -> List[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class RunProbe:
    """See the module docstring; :meth:`start` runs it in a thread until the run exits."""

    def __init__(self, popen, spec: str, experiment: str, trial: str, evil_path: str):
        self.popen = popen
        self.spec = spec
        self.experiment = experiment
        self.trial = trial
        self.evil_path = evil_path
        #: (process name, ip, port) of every listening TCP socket seen
        self.listening: Set[Tuple[str, str, int]] = set()
        #: ZMQ addresses attacked, by the key that published them
        self.zmq_attacked: Dict[str, str] = {}
        #: (url, status code) of each unauthenticated control call
        self.http_answers: List[Tuple[str, int]] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="run-probe")

    def start(self) -> "RunProbe":
        self._thread.start()
        return self

    def join(self, timeout: float = 30.0) -> None:
        self._thread.join(timeout)

    def _sample_sockets(self) -> None:
        for p in _processes(self.popen.pid):
            try:
                conns = p.net_connections(kind="inet")
                name = " ".join(" ".join(p.cmdline()).split()[-4:])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN or (not c.raddr and c.type == 2):
                    self.listening.add((name, c.laddr.ip, c.laddr.port))

    def _published(self, root: str) -> Dict[str, str]:
        repo = name_resolve.from_spec(self.spec)
        try:
            keys = repo.find_subtree(root)
            out = {}
            for k in keys:
                try:
                    out[k] = repo.get(k)
                except name_resolve.NameEntryNotFoundError:
                    pass
            return out
        finally:
            repo.close()

    def _attack_zmq(self) -> None:
        body = pickle.dumps(_Evil(self.evil_path))
        forged = [[body], [b"\0" * 32 + body]]
        ctx = zmq.Context.instance()
        roots = {
            names.worker_root(self.experiment, self.trial): zmq.REQ,
            names.request_reply_stream_root(self.experiment, self.trial): zmq.DEALER,
            names.push_pull_stream_root(self.experiment, self.trial): zmq.PUSH,
        }
        for root, sock_type in roots.items():
            for key, addr in self._published(root).items():
                if not addr.startswith("tcp://"):
                    continue
                for frames in forged:
                    # A REQ socket sends one request per answer: a fresh socket per forgery.
                    s = ctx.socket(sock_type)
                    s.setsockopt(zmq.LINGER, 500)
                    s.connect(addr)
                    s.send_multipart(frames)
                    s.close()
                self.zmq_attacked[key] = addr

    def _attack_http(self) -> None:
        servers = list(self._published(names.gen_servers(self.experiment, self.trial)).values())
        manager = self._published(names.gen_server_manager(self.experiment, self.trial))
        servers = [a if a.startswith("http") else f"http://{a}" for a in servers]
        calls = [(f"{a}/pause_generation", {}) for a in servers]
        calls += [
            (f"{a}/update_weights_from_disk", {"model_path": "/etc", "version": 99})
            for a in servers
        ]
        calls += [(f"http://{a}/allocate_rollout", {"qid": "x"}) for a in manager.values()]
        for url, body in calls:
            try:
                self.http_answers.append(
                    (url, requests.post(url, json=body, timeout=10).status_code)
                )
            except requests.RequestException as e:
                self.http_answers.append((url, -1))
                print(f"probe: {url}: {e!r}")

    def _ready(self) -> bool:
        """Workers are up once the trainer has published a version (step 1 is under way)."""
        root = names.trial_root(self.experiment, self.trial)
        return any("model_version" in k for k in self._published(root))

    def _run(self) -> None:
        attacked = False
        while self.popen.poll() is None:
            try:
                self._sample_sockets()
                if not attacked and self._ready():
                    self._attack_zmq()
                    self._attack_http()
                    attacked = True
            except Exception as e:  # noqa: BLE001 — the run may be shutting down under us
                print(f"probe: {e!r}")
            time.sleep(0.3)
