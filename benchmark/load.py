"""Load: the generation server, the gserver manager and rollouts under 1,000 concurrent requests.

Starts real servers, each as its own process so that its peak memory is its own: built-in
generation servers (``python -m realhf.apps.serve`` on the embedded tiny model, CPU) and
gserver managers (a :class:`ManagerService` in a spawned process).  An aiohttp client in this
process then sends ``--n`` requests at once to each and records what every one got back:

1. ``gen``: ``/generate`` (``--new-tokens`` tokens each, prompts from the embedded arithmetic
   data) to a server with the default ``--max-concurrent-requests`` (4096), then to one with
   ``--tight-limit``, so that most are refused;
2. ``manager``: ``/allocate_rollout``, then ``/schedule_request`` and ``/finish_rollout``
   (release) for every admitted rollout, with the default bound and with ``--tight-limit``;
3. ``rollouts``: ``--n`` concurrent rollouts in a spawned process (the rollout side), each
   allocate -> ``PartialRolloutManager.generate_group`` (chunks of ``--chunk`` tokens routed
   by the manager) -> ``/finish_rollout`` until accepted, with a heartbeat, exactly as the
   rollout worker runs them, against a fresh manager and the first generation server.

For each it prints served / refused (by status and reason) / failed, latency percentiles,
whether the server answers ``/health`` afterwards, and its memory: RSS before and peak RSS
during the phase (``VmHWM``, reset before each phase through ``/proc/<pid>/clear_refs``).
Passing means: every request served or refused with 503 and a reason, no server down.

Run (about 3 minutes on 2 cores):

    python benchmark/load.py

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import aiohttp
import psutil

from realhf.base.net import auth, network
from realhf.base.net.http_server import auth_headers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "realhf", "assets", "tiny")
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="concurrent requests / rollouts")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per request and rollout")
    p.add_argument("--chunk", type=int, default=8, help="rollouts: tokens per /generate call")
    p.add_argument("--group-size", type=int, default=1, help="rollouts: answers per prompt")
    p.add_argument("--tight-limit", type=int, default=100, help="max_concurrent_requests")
    p.add_argument("--max-running", type=int, default=64, help="the server's running requests")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---------------------------------------------------------------- memory of a process


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def reset_peak(pid: int) -> bool:
    """Restart ``VmHWM`` at the current RSS (Linux 4.0+); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_mb(pid: int) -> float:
    """The peak RSS (``VmHWM``) since start or the last :func:`reset_peak`."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


# ---------------------------------------------------------------- servers


def start_gen_server(limit: int, max_running: int, log_dir: str):
    """A built-in generation server process on the embedded model; returns (proc, url)."""
    port = network.find_free_port()
    cmd = [sys.executable, "-m", "realhf.apps.serve", "--model-path", ASSETS, "--port", str(port)]
    cmd += ["--max-running-requests", str(max_running), "--context-length", "256"]
    cmd += ["--num-threads", "1", "--max-concurrent-requests", str(limit)]
    log_path = os.path.join(log_dir, f"gen-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with open(log_path) as f:
            if "realhf generation server ready" in f.read():
                return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log_path) as f:
                raise RuntimeError(f"generation server did not start:\n{f.read()[-3000:]}")
        time.sleep(0.1)


class _Progress:
    """The trainer stays at version 0 with nothing trained: admission is the cap alone."""

    def version(self):
        return 0

    def trained_samples(self):
        return 0


def _manager_main(conn, gen_urls: List[str], config: Dict[str, Any]) -> None:
    from realhf.api.core.rollout_config import GserverManagerConfig
    from realhf.system.rollout.manager.service import ManagerService
    from realhf.system.rollout.manager.state import GserverManager

    cfg = GserverManagerConfig(**config)
    manager = GserverManager(cfg, _Progress(), lambda: list(gen_urls), lambda v: "")
    service = ManagerService(manager).start(60)
    try:
        conn.send(service.url)
        conn.poll(24 * 3600)  # until the parent says stop (or dies: the pipe closes)
    finally:
        service.stop()


class ManagerProcess:
    """A gserver manager serving in a spawned process (its own memory and event loop)."""

    def __init__(self, gen_urls: List[str], **config):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_manager_main, args=(child, gen_urls, config), daemon=True)
        self.proc.start()
        if not self.conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError("the gserver manager did not start (see its log above)")
        self.url = self.conn.recv()
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


# ---------------------------------------------------------------- the client


def _reason(status: int, text: str) -> str:
    """A refusal's class: status and error type, or the message with numbers masked."""
    try:
        err = json.loads(text)["error"]
        kind = err.get("type") or re.sub(r"\d+", "#", err["message"])[:70]
    except (ValueError, KeyError, TypeError):
        kind = text[:70]
    return f"{status} {kind}"


class Tally:
    """What ``n`` concurrent requests got back, and how long each took."""

    def __init__(self, name: str):
        self.name = name
        self.latencies: List[float] = []
        self.served = 0
        self.refused: collections.Counter = collections.Counter()
        self.failed: collections.Counter = collections.Counter()
        self.examples: Dict[str, str] = {}
        self.wall = 0.0
        self.memory: Dict[str, float] = {}
        #: (status, body) of every request, in order (None: no answer)
        self.answers: List[tuple] = []
        self.healthy_after = False

    def add(self, latency: float, status: Optional[int], text: str) -> None:
        self.latencies.append(latency)
        if status == 200:
            self.served += 1
        elif status is not None and status in (429, 503) and '"error"' in text:
            key = _reason(status, text)
            self.refused[key] += 1
            self.examples.setdefault(key, text[:300])
        else:
            self.failed[f"{status} {text[:70]}" if status is not None else text[:70]] += 1

    def summary(self) -> Dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q):
            return round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

        return {
            "n": len(lat),
            "served": self.served,
            "refused": sum(self.refused.values()),
            "refused_by_reason": dict(self.refused),
            "failed": sum(self.failed.values()),
            "failed_by_error": dict(self.failed),
            "p50_ms": pct(0.5),
            "p90_ms": pct(0.9),
            "p99_ms": pct(0.99),
            "max_ms": round(1000 * lat[-1], 1) if lat else None,
            "wall_s": round(self.wall, 2),
            "healthy_after": self.healthy_after,
            **self.memory,
        }


async def flood(
    name: str, n: int, request: Callable[[aiohttp.ClientSession, int], Any], pid: int, url: str
) -> Tally:
    """Send ``request(session, i)`` for i < n all at once; tally the answers, the memory of
    the server process ``pid`` (RSS before, peak during) and whether ``url`` is healthy after."""
    tally = Tally(name)
    before = rss_mb(pid)
    exact_peak = reset_peak(pid)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def one(session, i):
        t0 = time.perf_counter()
        try:
            async with request(session, i) as r:
                status, text = r.status, await r.text()
        except Exception as e:  # noqa: BLE001 — a failed request is a result here
            status, text = None, f"{type(e).__name__}: {e}"
        tally.add(time.perf_counter() - t0, status, text)
        return status, text

    connector = aiohttp.TCPConnector(limit=0)
    # with the run's token, as the rollout workers: the manager's routes want it
    headers = auth_headers()
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(session, i) for i in range(n)))
        tally.wall = time.perf_counter() - t0
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
            tally.healthy_after = r.status == 200
    peak = peak_mb(pid)
    tally.memory = {
        "server_rss_before_mb": round(before, 1),
        "server_peak_rss_mb": round(peak, 1),
        "server_growth_mb": round(peak - before, 1),
        "peak_is_this_phase": exact_peak,
    }
    tally.answers = answers
    return tally


def load_prompts(n: int, seed: int) -> List[List[int]]:
    from realhf.impl.model.gen.loading import load_tokenizer

    tok = load_tokenizer(ASSETS)
    with open(os.path.join(ASSETS, "data", "train.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f]
    rng = random.Random(seed)
    return [tok.encode(rng.choice(texts)) for _ in range(n)]


# ---------------------------------------------------------------- phases


async def gen_phase(name: str, url: str, pid: int, prompts, new_tokens: int) -> Tally:
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    return await flood(
        name,
        len(prompts),
        lambda s, i: s.post(
            url + "/generate", json={"input_ids": prompts[i], "sampling_params": sampling}
        ),
        pid,
        url,
    )


async def manager_phases(name: str, url: str, pid: int, n: int) -> List[Tally]:
    """N concurrent allocations, then a schedule and a release for each admitted one."""
    alloc = await flood(
        f"manager: /allocate_rollout, {name}",
        n,
        lambda s, i: s.post(
            url + "/allocate_rollout", json={"worker": f"w{i % 8}", "incarnation": "i"}
        ),
        pid,
        url,
    )
    ids = [json.loads(t)["rollout_id"] for st, t in alloc.answers if st == 200]
    ids = [r for r in ids if r]  # refused allocations have no id
    sched = await flood(
        f"manager: /schedule_request, {name}",
        len(ids),
        lambda s, i: s.post(
            url + "/schedule_request",
            json={"rollout_id": ids[i], "prompt_len": 8, "new_token_budget": 16},
        ),
        pid,
        url,
    )
    fin = await flood(
        f"manager: /finish_rollout, {name}",
        len(ids),
        lambda s, i: s.post(
            url + "/finish_rollout", json={"rollout_id": ids[i], "accepted": False, "wait_s": 0}
        ),
        pid,
        url,
    )
    return [alloc, sched, fin]


def _rollouts_main(conn, manager_url: str, prompts, opts: Dict[str, Any]) -> None:
    try:
        conn.send(asyncio.run(_rollouts(manager_url, prompts, **opts)))
    except BaseException as e:  # the parent reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})


async def _rollouts(manager_url: str, prompts, new_tokens: int, chunk: int, group_size: int):
    from realhf.api.core.model_api import GenerationHyperparameters
    from realhf.api.core.rollout_api import FinishStatus, GenerateGroupRequest
    from realhf.system.rollout.manager.client import ManagerClient
    from realhf.system.rollout.partial_rollout import PartialRolloutManager

    worker, inc = "rollout_worker/0", "bench"
    client = ManagerClient(manager_url, timeout_s=REQUEST_TIMEOUT_S)
    prm = PartialRolloutManager(
        client, new_tokens_per_chunk=chunk, request_timeout_s=REQUEST_TIMEOUT_S
    )
    # min = max new tokens: every answer is exactly new_tokens long (fixed work)
    g = GenerationHyperparameters(
        n=group_size, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    refusals = collections.Counter()

    async def heartbeat():
        while True:
            await client.heartbeat(worker, inc)
            await asyncio.sleep(5.0)

    async def one(i):
        t0 = time.perf_counter()
        while True:
            adm = await client.allocate(worker, inc, f"q{i}")
            if adm.success:
                break
            refusals[adm.reason] += 1
            await asyncio.sleep(0.05)  # the rollout worker's allocate_retry_interval_s
        group = await prm.generate_group(
            adm.rollout_id, GenerateGroupRequest(f"q{i}", prompts[i], g)
        )
        while (
            await client.finish(adm.rollout_id, True, wait_s=10.0)
        ).status != FinishStatus.ACCEPTED:
            pass
        return time.perf_counter() - t0, sum(len(o) for o in group.output_ids)

    hb = asyncio.create_task(heartbeat())
    t0 = time.perf_counter()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(len(prompts))), return_exceptions=True),
            REQUEST_TIMEOUT_S * 2,
        )
    finally:
        wall = time.perf_counter() - t0
        hb.cancel()
        status = await client.status()
        await prm.close()
        await client.close()
    tally = Tally("rollouts")
    tally.wall = wall
    tokens = 0
    for r in results:
        if isinstance(r, BaseException):
            tally.add(0.0, None, f"{type(r).__name__}: {r}")
        else:
            tally.add(r[0], 200, "")
            tokens += r[1]
    out = tally.summary()
    del out["healthy_after"]  # the servers' health is checked by the parent
    out.update(
        rollouts_per_s=round(tally.served / wall, 1),
        tokens=tokens,
        allocation_refusals=dict(refusals),
        chunks=prm.stats["chunks"],
        server_failures=prm.stats["server_failures"],
        accepted_total=status["accepted_total"],
        rollout_process_peak_rss_mb=round(peak_mb(os.getpid()), 1),
    )
    return out


def rollout_phase(manager: ManagerProcess, gen_pid: int, prompts, args) -> Dict[str, Any]:
    before = {"gen": rss_mb(gen_pid), "manager": rss_mb(manager.pid)}
    for pid in (gen_pid, manager.pid):
        reset_peak(pid)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    opts = dict(new_tokens=args.new_tokens, chunk=args.chunk, group_size=args.group_size)
    proc = ctx.Process(target=_rollouts_main, args=(child, manager.url, prompts, opts), daemon=True)
    proc.start()
    try:
        if not conn.poll(REQUEST_TIMEOUT_S * 3):
            raise TimeoutError("the rollout process did not report within its time")
        out = conn.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if "error" in out:
        raise RuntimeError(f"the rollout process failed: {out['error']}")
    out.update(
        gen_server_rss_before_mb=round(before["gen"], 1),
        gen_server_peak_rss_mb=round(peak_mb(gen_pid), 1),
        manager_rss_before_mb=round(before["manager"], 1),
        manager_peak_rss_mb=round(peak_mb(manager.pid), 1),
    )
    return out


# ---------------------------------------------------------------- report


def print_table(tallies: List[Tally]) -> None:
    head = f"{'phase':<40}{'n':>6}{'served':>8}{'refused':>9}{'failed':>8}"
    head += f"{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}{'wall s':>8}"
    head += f"{'RSS MB':>8}{'peak MB':>9}{'health':>8}"
    print(head)
    print("-" * len(head))
    for t in tallies:
        s = t.summary()
        print(
            f"{t.name:<40}{s['n']:>6}{s['served']:>8}{s['refused']:>9}{s['failed']:>8}"
            f"{s['p50_ms']!s:>9}{s['p90_ms']!s:>9}{s['p99_ms']!s:>9}{s['max_ms']!s:>9}"
            f"{s['wall_s']:>8}{s['server_rss_before_mb']:>8}{s['server_peak_rss_mb']:>9}"
            f"{'200' if s['healthy_after'] else 'DOWN':>8}"
        )
    for t in tallies:
        for key, n in t.refused.items():
            print(f"  {t.name}: {n} refused [{key}], e.g. {t.examples[key]}")
        for key, n in t.failed.items():
            print(f"  {t.name}: {n} FAILED [{key}]")


def print_rollouts(r: Dict[str, Any], args) -> None:
    print(
        f"\n{args.n} concurrent rollouts (group size {args.group_size}, {args.new_tokens} "
        f"tokens in chunks of {args.chunk}): {r['served']} completed, {r['failed']} failed "
        f"in {r['wall_s']} s ({r['rollouts_per_s']} rollouts/s, {r['chunks']} chunks)"
    )
    print(f"  latency p50/p90/p99/max {r['p50_ms']}/{r['p90_ms']}/{r['p99_ms']}/{r['max_ms']} ms")
    print(
        f"  peak RSS MB: rollout process {r['rollout_process_peak_rss_mb']}, manager "
        f"{r['manager_peak_rss_mb']} (from {r['manager_rss_before_mb']}), generation server "
        f"{r['gen_server_peak_rss_mb']} (from {r['gen_server_rss_before_mb']})"
    )
    for key, n in r["failed_by_error"].items():
        print(f"  {n} FAILED: {key}")


def main() -> int:
    """Start the servers, run the phases, print the table and one JSON line; stop everything."""
    from realhf.impl.model.gen.http_app import DEFAULT_MAX_CONCURRENT_REQUESTS as DEFAULT

    args = parse_args()
    auth.run_secret()  # made now: every server and process started below inherits it
    prompts = load_prompts(args.n, args.seed)
    log_dir = tempfile.mkdtemp(prefix="realhf-load-")
    gens: List[subprocess.Popen] = []
    managers: List[ManagerProcess] = []
    tallies: List[Tally] = []
    cap = dict(train_batch_size=args.n, max_concurrent_rollouts=args.n, server_wait_timeout_s=60)
    try:
        for limit in (DEFAULT, args.tight_limit):
            gen, url = start_gen_server(limit, args.max_running, log_dir)
            gens.append(gen)
            name = f"gen: /generate, limit {limit}"
            tallies.append(asyncio.run(gen_phase(name, url, gen.pid, prompts, args.new_tokens)))
            if limit == DEFAULT:
                gen_url = url  # kept for the managers and the rollouts
        for limit in (DEFAULT, args.tight_limit):
            managers.append(ManagerProcess([gen_url], max_concurrent_requests=limit, **cap))
            m = managers[-1]
            tallies += asyncio.run(manager_phases(f"limit {limit}", m.url, m.pid, args.n))
            m.stop()
        print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
        print_table(tallies)

        managers.append(ManagerProcess([gen_url], **cap))
        rollouts = rollout_phase(managers[-1], gens[0].pid, prompts, args)
        managers[-1].stop()
        print_rollouts(rollouts, args)
        ok = (
            all(t.summary()["failed"] == 0 and t.healthy_after for t in tallies)
            and rollouts["failed"] == 0
            and all(g.poll() is None for g in gens)
            and all(m.proc.exitcode == 0 for m in managers)
        )
        result = {
            "n": args.n,
            "new_tokens": args.new_tokens,
            "phases": {t.name: t.summary() for t in tallies},
            "rollouts": rollouts,
            "no_failure_no_crash": ok,
            "load_average": round(os.getloadavg()[0], 2),
            "cpu_count": os.cpu_count(),
            "date": datetime.date.today().isoformat(),
        }
    finally:
        for m in managers:
            if m.proc.is_alive():
                m.stop()
        for g in gens:
            if g.poll() is None:
                g.kill()
                g.wait(30)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
