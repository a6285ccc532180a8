"""Weight sync: the time from "the trainer has new weights" to "every server serves them".

For each model shape, number of generation servers and ``weight_sync`` mode, this script
plays the trainer: it holds the model (random weights of the shape, ``make_model``) and
changes them before every update, so each update moves real new bytes.  The servers are
real built-in generation servers (``python -m realhf.apps.serve``, one process each, one
thread each), updated through the one weight-update protocol the gserver manager uses
(:func:`realhf.impl.model.gen.weight_update.update_server`: pause -> load -> continue, the
servers in parallel).  An update is timed from before the trainer writes to after the last
server answers ``/continue_generation``:

* ``disk``: ``save_hf`` of a HuggingFace directory, each server reads and converts it;
* ``shm``: :func:`~realhf.impl.model.conversion.flat_file.write_model` of one flat file into
  ``/dev/shm``, each server maps it (and serves from the mapping);
* ``broadcast``: :meth:`~realhf.impl.model.comm.weight_broadcast.WeightSender.stage` of a
  copy with its MAC tags, each server pulls it over its own gloo pair into its weights.

Against it, in the same run: ``memcpy``, one copy of the same bytes between two tensors
in this process.  After the timed updates of each mode, every server must report as many
weight loads as it was sent, and its first greedy token for a short prompt must be the
trainer model's (the tests check the loaded bits exactly; later tokens of a random model
near-tie in bf16, where the server's cached decode and a full forward may part).

    python benchmark/weight_sync.py --shapes tiny,qwen2.5-0.5b,qwen2.5-1.5b --servers 1,2
    python benchmark/weight_sync.py --backend vllm   # vLLM's CPU build

With ``--backend vllm`` each server is vLLM (one thread, one process) behind the adapter
of :mod:`realhf.system.rollout.vllm_backend`: ``disk`` is its reload from the HF directory,
``shm`` and ``broadcast`` its worker's load of the flat file or of the pulled copy
(:mod:`realhf.system.rollout.vllm_worker_ext`); vLLM reports no load count, so only the
greedy token is checked.

Each mode first runs ``--warmup`` untimed-for-the-median updates (reported apart, as
``first_seconds``): the first versions of a mode allocate what later ones reuse (the flat
files of ``shm``, the sender's copy of ``broadcast``, the disk's page cache).  A run pays them
once; the median is over the ``--repeats`` updates after them.

Prints a table, then a JSON line: per shape the median seconds of each mode and servers,
``shm_over_disk`` and ``broadcast_over_disk`` (how many times faster each is than disk, with
the most servers), ``shm_over_memcpy`` (shm's time over one memcpy of the bytes) and the
host's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import aiohttp  # noqa: E402
import torch  # noqa: E402

from benchmark.scale import host_facts, model_dir  # noqa: E402
from realhf.base.net import auth  # noqa: E402
from realhf.base.net.http_server import auth_headers  # noqa: E402
from realhf.impl.model.comm.weight_broadcast import WeightSender  # noqa: E402
from realhf.impl.model.conversion.flat_file import retire, write_model  # noqa: E402
from realhf.impl.model.gen.weight_update import update_server  # noqa: E402
from realhf.impl.model.nn.real_model import ReaLModel  # noqa: E402

PROMPT = [5, 17, 42, 9]
CHECK_TOKENS = 1
SERVER_START_S = 600.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tiny,qwen2.5-0.5b")
    p.add_argument("--servers", default="1,2", help="numbers of generation servers")
    p.add_argument("--modes", default="disk,shm,broadcast")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per mode (median)")
    p.add_argument(
        "--warmup", type=int, default=2, help="updates per mode before them, reported apart"
    )
    p.add_argument("--dtype", default="bfloat16", help="trainer and server weights")
    p.add_argument("--models-dir", default=os.path.expanduser("~/.cache/realhf/shapes"))
    p.add_argument("--workdir", default=None, help="where disk versions go (default: a temp dir)")
    p.add_argument(
        "--backend",
        default="builtin",
        choices=("builtin", "vllm"),
        help="the servers: ours (realhf.apps.serve) or vLLM behind its adapter",
    )
    return p.parse_args(argv)


class Servers:
    """``n`` built-in servers of ``path`` as processes, on loopback, free ports; each logs
    to a file in ``logdir``."""

    def __init__(self, path: str, n: int, dtype: str, weights_root: str, shm_root: str, logdir):
        self.procs: List[subprocess.Popen] = []
        self.urls: List[str] = []
        env = dict(os.environ, **auth.child_env())
        logs = []
        for i in range(n):
            cmd = [
                sys.executable,
                "-m",
                "realhf.apps.serve",
                f"--model-path={path}",
                "--port=0",
                f"--dtype={dtype}",
                "--num-threads=1",
                "--max-running-requests=2",
                "--context-length=64",
                f"--weights-root={weights_root}",
                f"--shm-root={shm_root}",
            ]
            logs.append(os.path.join(logdir, f"server{i}.log"))
            with open(logs[-1], "w") as out:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
                )
        try:
            for p, log in zip(self.procs, logs):
                self.urls.append(_ready_url(p, log))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(30)


class VLLMServers:
    """``n`` vLLM CPU servers of ``path`` (one thread, one process each), each behind the
    adapter a generation server worker puts in front of it, on loopback."""

    def __init__(self, path: str, n: int, dtype: str, weights_root: str, shm_root: str, logdir):
        from realhf.base.net import network
        from realhf.base.net.http_server import ServerThread
        from realhf.system.rollout import vllm_backend

        python = vllm_backend.find_vllm_python()
        self.vllm, self.adapters, self.urls = [], [], []
        try:
            for i in range(n):
                cfg = vllm_backend.VLLMConfig(
                    model_path=path, port=network.find_free_port(host="127.0.0.1"),
                    dtype=dtype, max_model_len=64, max_num_seqs=2, num_threads=1,
                    single_process=True,
                )  # fmt: skip
                log = os.path.join(logdir, f"vllm{i}.log")
                self.vllm.append(vllm_backend.VLLMServer(cfg, python=python, log_path=log))
                self.vllm[-1].start(health_timeout=SERVER_START_S)
                app = vllm_backend.create_adapter_app(
                    cfg.url, cfg.served_model_name, weights_root=weights_root,
                    shm_root=shm_root, model_dir=path,
                )  # fmt: skip
                self.adapters.append(ServerThread(app, host="127.0.0.1", port=0).start(30))
                self.urls.append(self.adapters[-1].url)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for a in self.adapters:
            a.stop()
        for v in self.vllm:
            v.stop()


def _ready_url(proc: subprocess.Popen, log: str) -> str:
    """The URL a server prints once it is warm; an error naming its log if it exits or
    says nothing within SERVER_START_S."""
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            for line in f:
                if line.startswith("realhf generation server ready at "):
                    return line.split(" at ", 1)[1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"a generation server exited with {proc.returncode}; see {log}")
        time.sleep(0.2)
    raise TimeoutError(f"a generation server was not ready in {SERVER_START_S:g}s; see {log}")


async def _update_all(urls: List[str], version: int, where: str, mode: str) -> None:
    async def healthy(_):
        return True

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(
            *(update_server(session, u, version, where, 600.0, healthy, mode) for u in urls)
        )


def _served(urls: List[str], loads: bool = True) -> List[tuple]:
    """(greedy tokens, weight loads so far) of each server (vLLM: loads None)."""
    import requests

    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": CHECK_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    out = []
    for u in urls:
        r = requests.post(u + "/generate", json=body, headers=auth_headers(), timeout=600)
        got = None
        if loads:
            info = requests.get(u + "/get_server_info", headers=auth_headers(), timeout=60)
            got = info.json()["stats"]["weight_version"]
        out.append((r.json()["output_ids"], got))
    return out


@torch.no_grad()
def _reference_greedy(model: ReaLModel) -> List[int]:
    ids = list(PROMPT)
    for _ in range(CHECK_TOKENS):
        logits = model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32))
        ids.append(int(logits[-1].argmax()))
    return ids[len(PROMPT) :]


def memcpy_s(flat: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(flat)
    dst.copy_(flat)  # first touch of dst's pages outside the timing
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(flat)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_shape(args, shape: str, workdir: str) -> List[dict]:
    path = model_dir(shape, args.models_dir)
    dtype = getattr(torch, args.dtype)
    model = ReaLModel.from_hf(path, dtype=dtype).eval()
    nbytes = model.flat_params.numel() * model.flat_params.element_size()
    copy = memcpy_s(model.flat_params, max(3, args.repeats))
    rows = []
    version = 0
    for n in [int(x) for x in args.servers.split(",")]:
        weights_root = os.path.join(workdir, "disk")
        shm_root = tempfile.mkdtemp(prefix="realhf-bench-", dir="/dev/shm")
        os.makedirs(weights_root, exist_ok=True)
        kind = VLLMServers if args.backend == "vllm" else Servers
        servers = kind(path, n, args.dtype, weights_root, shm_root, workdir)
        sender = WeightSender(timeout=600.0)
        loads = 0
        try:
            for mode in args.modes.split(","):
                times, prev = [], None
                for _ in range(args.warmup + args.repeats):
                    version += 1
                    with torch.no_grad():  # new weights: every update moves real bytes
                        model.flat_params.mul_(1.0 - 1e-3)
                    t = time.perf_counter()
                    if mode == "disk":
                        where = os.path.join(weights_root, f"v{version}")
                        model.save_hf(where)
                    elif mode == "broadcast":
                        sender.stage(model.flat_params, model.param_spec, version)
                        where = sender.address
                    else:
                        where = os.path.join(shm_root, f"v{version}.flat")
                        write_model(model, where, version)
                    asyncio.run(_update_all(servers.urls, version, where, mode))
                    times.append(time.perf_counter() - t)
                    # Once every server holds it, the version before goes, as the manager
                    # prunes (keep_weight_versions=1): a flat file is retired for reuse.
                    if prev is not None and mode == "disk":
                        shutil.rmtree(prev)
                    elif prev is not None and mode == "shm":
                        retire(prev)
                    prev = where
                loads += args.warmup + args.repeats
                builtin = args.backend == "builtin"
                want = (_reference_greedy(model), loads if builtin else None)
                got = _served(servers.urls, loads=builtin)
                if any(g != want for g in got):
                    raise AssertionError(
                        f"{shape} {mode}: servers answer (tokens, loads) {got}, want {want}"
                    )
                row = dict(
                    backend=args.backend,
                    shape=shape,
                    servers=n,
                    mode=mode,
                    bytes=nbytes,
                    seconds=statistics.median(times[args.warmup :]),
                    all_seconds=[round(x, 4) for x in times[args.warmup :]],
                    first_seconds=[round(x, 4) for x in times[: args.warmup]],
                    memcpy_s=copy,
                )
                rows.append(row)
                print(
                    f"{shape:<14} {n} server(s) {mode:<5} {nbytes / 2**30:7.3f} GiB "
                    f"{row['seconds']:8.3f} s   (memcpy {copy:.3f} s)",
                    flush=True,
                )
        finally:
            servers.close()
            sender.close()
            shutil.rmtree(shm_root, ignore_errors=True)
    return rows


def summarize(rows: List[dict]) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        most = max(r["servers"] for r in mine)
        at = {r["mode"]: r["seconds"] for r in mine if r["servers"] == most}
        s = {"servers": most, "seconds": at, "memcpy_s": mine[0]["memcpy_s"]}
        if "disk" in at and "shm" in at:
            s["shm_over_disk"] = at["disk"] / at["shm"]
        if "shm" in at:
            s["shm_over_memcpy"] = at["shm"] / mine[0]["memcpy_s"]
        if "disk" in at and "broadcast" in at:
            s["broadcast_over_disk"] = at["disk"] / at["broadcast"]
        out[shape] = s
    return out


def table(rows: List[dict]) -> str:
    lines = [
        "| shape | servers | mode | GiB | first updates s | update s (median) | memcpy s "
        "| over memcpy |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        first = ", ".join(f"{x:.3f}" for x in r["first_seconds"]) or "—"
        lines.append(
            f"| {r['shape']} | {r['servers']} | {r['mode']} | {r['bytes'] / 2**30:.3f} | "
            f"{first} | {r['seconds']:.3f} | {r['memcpy_s']:.3f} | "
            f"{r['seconds'] / r['memcpy_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="weight-sync-")
    rows = []
    try:
        for shape in args.shapes.split(","):
            rows += run_shape(args, shape, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows))
    print(
        json.dumps(
            {
                "host": host_facts(),
                "backend": args.backend,
                "dtype": args.dtype,
                "shapes": summarize(rows),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
