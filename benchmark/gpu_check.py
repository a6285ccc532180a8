"""Everything GPU-only in one bounded command, for the first minutes of a lent GPU host.

    bash benchmark/gpu_check.sh [--out DIR] [--budget SECONDS] [--wheels DIR]
    bash benchmark/gpu_check.sh --cpu      # the same stages on the CPU: tiny shapes, few steps

The stages run in this order, each as a subprocess with its own timeout, all within ``--budget``
(480 s; 280 s with ``--cpu``). A stage that fails or times out is recorded with its reason and
the rest still run; one whose input failed is skipped, naming it.

- ``deps``: setup.py's runtime requirements that this Python lacks are installed from the
  wheels of ``tools/gpu_wheels.sh`` (``pip install --no-index --no-deps --target``; that folder
  goes on every later stage's PYTHONPATH), then every module of the project must import;
- ``cuda_kernels_build``: ``setup.py build_ext --inplace`` for this GPU's architecture must
  produce ``realhf._C_cuda``;
- ``kernel_tests``: ``tests/impl/test_kernels.py``, the kernels against the PyTorch reference
  ops (on a GPU none may skip);
- ``gpu_tests``: ``pytest -m gpu`` over the files that carry the marker;
- ``engine_tiny`` / ``engine_0.5b``: the built-in generation engine on the device: greedy tokens
  equal to ``transformers``' (tiny model, fp32, both on the device), then tokens/s with 16, 64
  and 256 requests in flight (bf16; fp32 with ``--cpu``);
- ``sync_tiny`` / ``sync_0.5b``: ``ppo-math`` through ``benchmark/scale.py`` (tiny: 20 steps;
  the 0.5B shape, written by ``realhf.apps.make_model`` in ``make_0.5b``: 2 steps): the step
  time and its split;
- ``async_tiny``: ``async-ppo-math`` through ``benchmark/scale.py``, the generation server and
  the trainer sharing the host's GPU (``share_gpus=0.3``: each capped at its share of memory);
- ``long_tail``: ``benchmark/async_vs_sync.py --task tiny_long``: async over sync samples/s.

With ``--cpu`` everything runs on the CPU (``CUDA_VISIBLE_DEVICES=``); the CUDA build and the
0.5B stages are skipped saying so, and ``long_tail`` runs the short task (``async_vs_sync.py``
grades 500 problems of up to 256 tokens after its last step: ~50 s on 2 cores, no switch).

Writes, to ``--out``, else ``$OUT``, else ``runs/gpu_check-<time>/``: ``report.json`` (the host,
then per stage: status ok / failed / skipped, reason, headline, figures, seconds, timeout,
command, peak GPU memory), ``log.txt`` (every command and its output, then the summary) and
``pip_freeze.txt`` (for ``tools/gpu_wheels.sh --have``). Exit code 0 when no stage failed.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "realhf", "assets", "tiny")
BIG = "qwen2.5-0.5b"
PACKAGES = ("realhf", "areal", "functioncall", "evaluation", "training")


def runtime_requirements() -> List[str]:
    """``install_requires`` of setup.py, read without running it (running it builds)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return list(ast.literal_eval(node.value))
    raise RuntimeError("setup.py has no literal install_requires list")


# ---- stages and how their output is judged -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # ok | failed | skipped
    reason: str = ""  # why it failed or was skipped
    headline: str = ""  # the figures that matter, in a line
    figures: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Stage:
    """``cmd`` runs in the repository for at most ``timeout_s``; ``judge(output, exit code)``
    says how it went."""

    name: str
    cmd: List[str]
    timeout_s: float
    judge: Callable[[str, int], Outcome]
    needs: Tuple[str, ...] = ()  # stages that must be ok first
    skip: str = ""  # a reason not to run it at all
    env: Dict[str, str] = dataclasses.field(default_factory=dict)


def last_line(out: str) -> str:
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(no output)"


def last_json(out: str) -> Optional[dict]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def judge_rc(out: str, rc: int) -> Outcome:
    return Outcome("ok") if rc == 0 else Outcome("failed", f"exit code {rc}: {last_line(out)}")


def judge_pytest(strict: bool) -> Callable[[str, int], Outcome]:
    """ok when pytest passed something and failed nothing (``strict``: and skipped nothing);
    ``skipped`` with pytest's first reason when it skipped every test."""

    def judge(out: str, rc: int) -> Outcome:
        lines = re.findall(
            r"^.*\d+ (?:passed|failed|skipped|errors?|deselected).* in .*$", out, re.M
        )
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", lines[-1])} if lines else {}
        skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", out, re.M)
        first_skip = skips[0] if skips else "no reason given"
        figures = {k: counts.get(k, 0) for k in ("passed", "failed", "skipped")}
        figures["skip_reasons"] = skips
        headline = ", ".join(f"{n} {k}" for k, n in figures.items() if k != "skip_reasons")
        if rc != 0 or not lines:
            return Outcome("failed", f"pytest exit code {rc}: {last_line(out)}", headline, figures)
        if not figures["passed"]:
            return Outcome("skipped", f"pytest skipped all: {first_skip}", headline, figures)
        if strict and figures["skipped"]:
            return Outcome("failed", f"skipped on the GPU: {first_skip}", headline, figures)
        return Outcome("ok", "", headline, figures)

    return judge


def judge_json(read: Callable[[dict], Outcome]) -> Callable[[str, int], Outcome]:
    """``read`` the last JSON line the stage printed (the scripts' convention)."""

    def judge(out: str, rc: int) -> Outcome:
        result = last_json(out)
        return judge_rc(out, rc) if rc != 0 or result is None else read(result)

    return judge


def read_deps(r: dict) -> Outcome:
    problems = [f"missing {m}" for m in r["missing"]]
    problems += [f"{m} does not import: {e}" for m, e in r["import_errors"].items()]
    head = f"{len(r['lacked'])} lacked, {r['wheels_installed']} wheels installed, "
    head += f"{r['modules']} modules import"
    return Outcome("failed" if problems else "ok", "; ".join(problems)[:600], head, r)


def read_engine(r: dict) -> Outcome:
    head = f"{r['device']} {r['dtype']}, tokens/s by requests in flight {r['tokens_per_s']}"
    if "greedy_equal_to_hf" in r:
        head += f", greedy equal to transformers: {r['greedy_equal_to_hf']}"
    if r.get("greedy_equal_to_hf") is False:
        return Outcome("failed", f"greedy differs: {r['greedy_first_difference']}", head, r)
    return Outcome("ok", "", head, r)


def read_scale(r: dict) -> Outcome:
    if r["does_not_fit"]:
        return Outcome("failed", f"does not fit: {r['does_not_fit'][0]['largest_terms']}")
    run = r["runs"][0]
    keys = ("shape", "mode", "dtype", "wall_s", "step_s", "split_s", "tokens", "tokens_per_train_s")
    figures = {k: run.get(k) for k in keys}
    split = ", ".join(f"{k} {v:.2f}" for k, v in run["split_s"].items())
    head = f"{run['dtype']}: last step {run['step_s']:.2f} s ({split}), run {run['wall_s']:.0f} s"
    if run["step_s"] <= 0:
        return Outcome("failed", "the run recorded no step time", head, figures)
    return Outcome("ok", "", head, figures)


def read_long_tail(r: dict) -> Outcome:
    keys = ("task", "steps", "batch", "group_size", "sync_samples_per_s", "async_samples_per_s")
    figures = {k: r[k] for k in keys}
    figures["async_over_sync"] = ratio = r["async_over_sync_samples_per_s"]
    figures["step_s_median"] = {run["label"]: run["step_s_median"] for run in r["runs"]}
    head = f"{r['task']}, {r['steps']} steps: async/sync samples/s {ratio:.2f}"
    if ratio <= 0:
        return Outcome("failed", "no samples/s to compare", head, figures)
    return Outcome("ok", "", head, figures)


def judge_build(out: str, rc: int) -> Outcome:
    built = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "realhf", "_C*.so")))
    if rc != 0:
        return judge_rc(out, rc)
    if not any(b.startswith("_C_cuda") for b in built):
        return Outcome("failed", "setup.py built no realhf._C_cuda (it needs CUDA torch and nvcc)")
    return Outcome("ok", "", " ".join(built), {"built": built})


def gpu_test_files() -> List[str]:
    """Test files that carry the ``gpu`` marker: collecting only these keeps pytest from
    importing test modules whose optional packages a bare GPU host lacks."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)):
        with open(path) as f:
            if "mark.gpu" in f.read():
                found.append(os.path.relpath(path, ROOT))
    return found


def plan(args, host: dict) -> List[Stage]:
    """The stages; ``--cpu`` keeps them all, smaller, and skips those that need CUDA."""
    py, me, cpu = sys.executable, os.path.abspath(__file__), args.cpu
    models = os.path.join(args.workdir, "models")
    big = os.path.join(models, BIG)
    dtype = "float32" if cpu else "bfloat16"
    gpu_only = "--cpu: needs a CUDA device" if cpu else ""
    big_only = "--cpu: tiny shapes only" if cpu else ""
    pytest = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    # every core, one architecture (this GPU's): the build is most of its stage
    build_env = {"MAX_JOBS": str(os.cpu_count() or 4)}
    if host.get("capability"):
        build_env["TORCH_CUDA_ARCH_LIST"] = host["capability"]

    def engine(model: str, greedy: bool) -> List[str]:
        cmd = [py, me, "engine", "--model", model, "--dtype", dtype]
        return cmd + ["--new-tokens", "16" if cpu else "128"] + ["--greedy"] * greedy

    def scale(shape: str, mode: str, steps: int) -> List[str]:
        cmd = [py, "benchmark/scale.py", "--shapes", shape, "--modes", mode, "--dtypes", dtype]
        return cmd + ["--steps", str(steps), "--models-dir", models]

    long_tail = [py, "benchmark/async_vs_sync.py", "--no-eval", "--fileroot", args.workdir]
    if cpu:
        long_tail += ["--task", "tiny_arith", "--steps", "2", "--batch", "4", "--group-size", "2"]
    else:
        long_tail += ["--task", "tiny_long", "--steps", "10", "--async-extra", "share_gpus=0.3"]
    deps = [py, me, "deps", "--wheels", args.wheels, "--site", args.site]
    build = [py, "setup.py", "build_ext", "--inplace"]
    make = [py, "-m", "realhf.apps.make_model", "--shape", BIG, big]
    kernel_tests = pytest + ["tests/impl/test_kernels.py"]
    built = () if cpu else ("cuda_kernels_build",)
    by_scale, by_engine = judge_json(read_scale), judge_json(read_engine)
    share = [] if cpu else ["--extra", "share_gpus=0.3"]
    d, made = ("deps",), ("make_0.5b",)
    return [
        Stage("deps", deps, 240, judge_json(read_deps)),
        Stage("cuda_kernels_build", build, 360, judge_build, skip=gpu_only, env=build_env),
        Stage("kernel_tests", kernel_tests, 180, judge_pytest(not cpu), built),
        Stage("gpu_tests", pytest + ["-m", "gpu"] + gpu_test_files(), 240, judge_pytest(False)),
        Stage("engine_tiny", engine(TINY, True), 240, by_engine, d),
        Stage("sync_tiny", scale("tiny", "sync", 2 if cpu else 20), 300, by_scale, d),
        # one GPU: the server and the trainer share it (share_gpus caps each one's memory)
        Stage("async_tiny", scale("tiny", "async", 2 if cpu else 5) + share, 240, by_scale, d),
        Stage("make_0.5b", make, 240, judge_rc, d, big_only),
        Stage("engine_0.5b", engine(big, False), 240, by_engine, made, big_only),
        Stage("sync_0.5b", scale(BIG, "sync", 2), 300, by_scale, made, big_only),
        Stage("long_tail", long_tail, 360, judge_json(read_long_tail), ("async_tiny",)),
    ]


# ---- running them --------------------------------------------------------------------------


class GpuMemory(threading.Thread):
    """Samples the used GPU memory (``nvidia-smi``) twice a second; :meth:`take` returns the
    peak since the last call (None without ``nvidia-smi``)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: Optional[int] = None
        self.done = threading.Event()

    def run(self):
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self.done.wait(0.5):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak or 0, sum(int(x) for x in out.split()))
            except (OSError, ValueError, subprocess.TimeoutExpired):
                return

    def take(self) -> Optional[int]:
        peak, self.peak = self.peak, None
        return peak


def run_command(cmd: List[str], env: Dict[str, str], timeout: float) -> Tuple[str, int, bool]:
    """``(output, exit code, timed out)``. On time-out its process group gets SIGTERM (the
    launchers stop their workers on it), then SIGKILL 15 s later."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        return proc.communicate(timeout=timeout)[0], proc.returncode, False
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=15)[0], proc.returncode, True
        except subprocess.TimeoutExpired:
            continue
    return "(its output was lost: a process it started kept the pipe open)", -9, True


PROBE = """import json, os, platform, shutil, torch
c = torch.cuda.is_available()
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "cuda": c, "devices": torch.cuda.device_count(),
    "device": torch.cuda.get_device_name() if c else None,
    "capability": "%d.%d" % torch.cuda.get_device_capability() if c else "",
    "nvcc": shutil.which("nvcc"), "cpus": os.cpu_count()}))"""


def run_all(args) -> dict:
    """Every stage in order, the report rewritten after each (a partial one is useful too)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, args.site, env.get("PYTHONPATH")) if p)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.monotonic()
    out, rc, _ = run_command([sys.executable, "-c", PROBE], env, 120)
    host = last_json(out) or {"error": f"exit code {rc}: {last_line(out)}"}
    freeze, _, _ = run_command([sys.executable, "-m", "pip", "freeze"], env, 60)
    with open(os.path.join(args.out, "pip_freeze.txt"), "w") as f:
        f.write(freeze)
    no_cuda = "" if args.cpu or host.get("cuda") else "no CUDA device visible to torch (--cpu?)"
    report = {"mode": "cpu" if args.cpu else "gpu", "budget_s": args.budget, "host": host}
    report.update(started=datetime.datetime.now().isoformat(timespec="seconds"), stages=[])
    memory = GpuMemory()
    if not args.cpu:
        memory.start()
    stages, status = plan(args, host), {}
    with open(os.path.join(args.out, "log.txt"), "w") as log:
        log.write(f"host: {json.dumps(host)}\n")
        for i, stage in enumerate(stages, 1):
            left = args.budget - (time.monotonic() - start)
            blocked = [n for n in stage.needs if status.get(n) != "ok"]
            t0, out, timeout = time.monotonic(), "", max(0.0, min(stage.timeout_s, left))
            if no_cuda or stage.skip:
                outcome = Outcome("skipped", no_cuda or stage.skip)
            elif blocked:
                outcome = Outcome("skipped", f"needs {blocked[0]}, which {status[blocked[0]]}")
            elif left < 10:
                outcome = Outcome("skipped", f"the check's {args.budget:.0f} s are spent")
            else:
                print(f"[{i}/{len(stages)}] {stage.name} (at most {timeout:.0f} s)", flush=True)
                memory.take()
                out, rc, timed_out = run_command(stage.cmd, {**env, **stage.env}, timeout)
                try:
                    outcome = stage.judge(out, rc)
                except Exception as e:  # output of an unexpected shape: this stage's failure
                    outcome = Outcome("failed", f"unreadable output: {type(e).__name__}: {e}")
                if timed_out:
                    outcome = Outcome(
                        "failed", f"timed out after {timeout:.0f} s: {last_line(out)}"
                    )
            status[stage.name] = outcome.status
            entry = {"name": stage.name, **dataclasses.asdict(outcome)}
            entry.update(seconds=round(time.monotonic() - t0, 1), timeout_s=round(timeout))
            entry.update(command=" ".join(stage.cmd), gpu_memory_peak_mib=memory.take())
            report["stages"].append(entry)
            report["elapsed_s"] = round(time.monotonic() - start, 1)
            write_json(os.path.join(args.out, "report.json"), report)
            line = f"{stage.name}: {outcome.status} in {entry['seconds']} s"
            line += f" -- {outcome.reason or outcome.headline}"
            print(f"    {line}", flush=True)
            log.write(f"\n===== {stage.name}\n$ {entry['command']}\n{out}\n----- {line}\n")
            log.flush()
    memory.done.set()
    return report


def write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def summary(report: dict) -> str:
    h = report["host"]
    rows = [
        f"gpu_check --{report['mode']}: {report['elapsed_s']} s of {report['budget_s']:.0f}; "
        f"python {h.get('python')}, torch {h.get('torch')}, {h.get('device') or 'no GPU'}"
    ]
    for s in report["stages"]:
        text = s["reason"] if s["status"] != "ok" else s["headline"]
        rows.append(f"  {s['name']:<19}{s['status']:<8}{s['seconds']:>7.1f} s  {text}")
    return "\n".join(rows)


# ---- the stages that are this script (each runs as its own subprocess) -------------------


def deps_main(wheels: str, site: str) -> None:
    """Install the wheels of what this Python lacks into ``site`` (already on PYTHONPATH),
    then import every module of the project."""
    import importlib
    import importlib.machinery
    import importlib.metadata as md
    import importlib.util
    import pkgutil

    from packaging.requirements import Requirement

    def missing() -> List[str]:
        importlib.invalidate_caches()
        out = []
        for req in map(Requirement, runtime_requirements()):
            try:
                if not req.specifier.contains(md.version(req.name), prereleases=True):
                    out.append(f"{req} (have {md.version(req.name)})")
            except md.PackageNotFoundError:
                out.append(str(req))
        return out

    lacked, files = missing(), sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if lacked and files:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        pip += ["--no-compile", "--disable-pip-version-check", "--target", site, *files]
        subprocess.run(pip, check=True, timeout=180)
    still = missing()
    if still and not files:
        still = [f"{m} (no wheels in {wheels}: run tools/gpu_wheels.sh)" for m in still]
    errors, n = {}, 0
    for top in PACKAGES:
        for mod in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
            origin = importlib.util.find_spec(mod.name).origin or ""
            if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
                continue  # realhf._C*: realhf.impl.kernels loads them after torch, as they need
            n += 1
            try:
                importlib.import_module(mod.name)
            except Exception as e:
                errors[mod.name] = f"{type(e).__name__}: {e}"[:300]
    result = {"requirements": len(runtime_requirements()), "lacked": lacked, "missing": still}
    result.update(wheels_installed=len(files) if lacked else 0, modules=n, import_errors=errors)
    print(json.dumps(result))


def engine_main(args) -> None:
    """Greedy tokens against ``transformers`` on the same device, then tokens/s with each
    number of requests in flight (every request generates exactly ``--new-tokens``)."""
    import importlib.util

    import torch
    import transformers

    from realhf.api.core.gen_api import GenerateRequest, SamplingParams
    from realhf.impl.model.gen import EngineConfig
    from realhf.impl.model.gen.loading import load_engine, special_token_ids

    path = os.path.join(ROOT, "benchmark", "generation.py")
    spec = importlib.util.spec_from_file_location("benchmark_generation", path)
    generation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generation)
    prompts = generation.load_prompts(64, seed=0)  # the embedded task's, its tokenizer
    levels = [int(c) for c in args.concurrency.split(",")]
    context = max(map(len, prompts)) + args.new_tokens + 1
    result = {"model": os.path.basename(args.model.rstrip("/")), "dtype": args.dtype}

    if args.greedy:  # in fp32: rounding to bf16 alone can flip a near-tie
        cfg = EngineConfig(max_running_requests=8, context_length=context, dtype="float32")
        engine = load_engine(args.model, cfg).start()
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            hf = hf.to(cfg.torch_device).eval()
            hf.generation_config.eos_token_id = None  # the budget ends both, not EOS
            pad = special_token_ids(args.model)[1] or 0
            sp = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
            outs = engine.generate([GenerateRequest(tuple(p), sp) for p in prompts[:8]], 300)
            first = None
            for p, o in zip(prompts, outs):
                with torch.inference_mode():
                    ids = torch.tensor([p], device=cfg.torch_device)
                    ref = hf.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=pad)
                ref, ours = ref[0, len(p) :].tolist(), list(o.output_ids)
                if ref != ours and first is None:
                    first = f"prompt {p}: transformers {ref}, ours {ours}"
            result.update(greedy_equal_to_hf=first is None, greedy_first_difference=first)
        finally:
            engine.close()

    cfg = EngineConfig(max_running_requests=max(levels), context_length=context, dtype=args.dtype)
    engine = load_engine(args.model, cfg).start()
    try:
        warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
        engine.generate([GenerateRequest(tuple(p), warm) for p in prompts[:8]], 300)
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
        rates = {}
        for c in levels:
            reqs = [GenerateRequest(tuple(prompts[i % len(prompts)]), sp) for i in range(c)]
            t0 = time.perf_counter()
            outs = engine.generate(reqs, 300)
            rates[str(c)] = round(c * args.new_tokens / (time.perf_counter() - t0), 1)
            assert all(len(o.output_ids) == args.new_tokens for o in outs)
            print(f"{c} requests in flight: {rates[str(c)]} tokens/s", flush=True)
        result.update(device=str(cfg.torch_device), decode_attention=str(engine.decode_impl))
        result.update(new_tokens=args.new_tokens, tokens_per_s=rates)
        if cfg.torch_device.type == "cuda":
            result["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    finally:
        engine.close()
    print(json.dumps(result))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="on the CPU: tiny shapes, few steps")
    p.add_argument("--out", default="", help="report folder (default: $OUT, else runs/)")
    p.add_argument("--budget", type=float, default=0, help="seconds in all (480; --cpu 280)")
    p.add_argument(
        "--wheels", default=os.path.join(ROOT, ".gpu_wheels"), help="gpu_wheels.sh's folder"
    )
    p.add_argument("--workdir", default="", help="models and runs (default: a temporary one)")
    p.add_argument("--requirements", action="store_true", help="print setup.py's runtime needs")
    sub = p.add_subparsers(dest="stage", help="the stages that are this script")
    d = sub.add_parser("deps")
    d.add_argument("--wheels", required=True)
    d.add_argument("--site", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--model", required=True)
    e.add_argument("--dtype", default="bfloat16")
    e.add_argument("--concurrency", default="16,64,256")
    e.add_argument("--new-tokens", type=int, default=128)
    e.add_argument("--greedy", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.requirements:
        print("\n".join(runtime_requirements()))
        return 0
    if args.stage == "deps":
        deps_main(args.wheels, args.site)
        return 0
    if args.stage == "engine":
        engine_main(args)
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    args.out = args.out or os.environ.get("OUT") or os.path.join(ROOT, "runs", f"gpu_check-{stamp}")
    args.budget = args.budget or (280.0 if args.cpu else 480.0)
    os.makedirs(args.out, exist_ok=True)
    workdir, args.workdir = args.workdir, args.workdir or tempfile.mkdtemp(prefix="gpu_check_")
    args.site = os.path.join(args.workdir, "site")
    try:
        report = run_all(args)
    finally:
        if not workdir:
            shutil.rmtree(args.workdir, ignore_errors=True)
    text = summary(report)
    with open(os.path.join(args.out, "log.txt"), "a") as f:
        f.write(f"\n{text}\n")
    print(f"\n{text}\nreport: {os.path.join(args.out, 'report.json')}")
    return 1 if any(s["status"] == "failed" for s in report["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
