"""Side by side with a peer: TRL's ``GRPOTrainer`` against our ``ppo-math`` and ``async-ppo-math``.

All three train the embedded tiny SFT model on the embedded arithmetic prompts with the same
settings: ``--batch`` prompts per step, ``--group-size`` answers each (GRPO group-normalised
advantages, no KL, no critic), at most ``--max-new-tokens`` new tokens at temperature 1,
AdamW at ``--lr`` (constant, no weight decay), fp32, one optimizer step per batch, the same
verifier (1 for a correct answer, 0 otherwise on TRL's side; ours scales it to ±5, which group
normalisation makes moot), and the machine's cores (``--threads``, default all of them, as
each system uses by default). Evaluation is off in the timed runs.

TRL is a benchmark-only dependency: the script makes a venv for it once
(``~/.cache/realhf/venvs/trl``, with ``trl==1.16.0`` pinned against the project's
``torch==2.13.0``) and runs TRL there in a child process; nothing of TRL enters the project's
environment or ``make test``.  The venv sees the interpreter that runs this script (its
site-packages and the project, through a ``.pth`` file), so it runs on the same ``torch`` and
``transformers`` whether the project is installed in the base interpreter or in a venv.

TRL runs twice: at its defaults (``GRPOConfig`` turns gradient checkpointing on) and at its
fastest setting here (gradient checkpointing off, which the memory of these workloads
allows); both are in the JSON, and our ratios are against the faster (``trl_fastest``).

Figures per system: completions/s over the timed steps (every step after the first, which
holds each system's warm-up), the median step split into generation / reward / train /
overhead (overhead = step − the three), and the training accuracy (share of correct answers)
over the first and last five steps. TRL's split comes from timing its ``_generate`` (HF
``generate``), ``_calculate_rewards`` and the rest of its step; ours from the run's
``trace.json`` (the MFCs ``actor_gen``, ``rew_inf``, ``actor_train``). In the async run
generation overlaps training, so only its train time is split out.

Run (about 4 minutes on the 2-core VM):

    python benchmark/peers.py [--steps 30 --batch 32 --group-size 8 --max-new-tokens 16]

The last line is one JSON object with ``ours_over_trl_sync`` and ``ours_over_trl_async``
(completions/s ratios).

A real shape: ``--model DIR`` (e.g. ``python -m realhf.apps.make_model --shape qwen2.5-0.5b
DIR``) trains that model on the task's prompts on every side (``--dtype bfloat16``: bf16
weights on ours, bf16 autocast on TRL's), e.g. ``--model DIR --dtype bfloat16 --steps 3
--batch 4 --group-size 4 --max-new-tokens 64``.

The second workload, ``--task tiny_long``, is the long-reasoning task (answers of 10–250
tokens with a long tail; ``--max-new-tokens 256``, ``--lr 1e-4``, 8 steps by default): there a
padding peer pays for its longest answer in every row of generation and training, and the
JSON adds ``ours_over_trl_long``, our faster mode against TRL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VERSION = "1.16.0"
TORCH_PIN = "torch==2.13.0"
VENV_ROOT = os.path.expanduser("~/.cache/realhf/venvs")
#: per embedded task: the defaults of --steps, --max-new-tokens and --lr (tiny_long's lr is
#: its PPO preset's: 2e-4 collapses that SFT policy within 20 steps)
TASK_DEFAULTS = {
    "tiny_arith": {"steps": 30, "max_new_tokens": 16, "lr": 2e-4},
    "tiny_long": {"steps": 8, "max_new_tokens": 256, "lr": 1e-4},
}


# ---------------------------------------------------------------------------- TRL (child)
def _trl_child(args) -> None:
    """Runs inside the TRL venv: train with GRPOTrainer, print one JSON line of figures."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, ROOT)
    from realhf.impl.reward.math_reward import verify_batch

    torch.set_num_threads(args.threads)
    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    data = Dataset.from_list([{"prompt": r["prompt"], "solutions": r["solutions"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def reward(completions, solutions, **_):
        return [float(ok) for ok in verify_batch(completions, solutions)]

    cfg = GRPOConfig(
        output_dir=args.out,
        use_cpu=True,
        per_device_train_batch_size=args.batch * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        beta=0.0,
        num_iterations=1,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=args.dtype == "bfloat16",
        gradient_checkpointing=args.trl_gradient_checkpointing == "on",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=reward, args=cfg, train_dataset=data
    )
    spans = {"gen": [], "reward": []}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[name].append(time.perf_counter() - t0)

        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    steps, rewards = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            steps.append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer.add_callback(Clock())
    trainer.train()
    print(
        "TRL_RESULT "
        + json.dumps(
            {"step_s": steps, "gen_s": spans["gen"], "reward_s": spans["reward"], "acc": rewards}
        )
    )


def _trl_python() -> str:
    """The TRL venv's interpreter, created on first use."""
    import site

    venv = os.path.join(VENV_ROOT, "trl")
    py = os.path.join(venv, "bin", "python")
    probe = [
        py, "-c", f"import trl, torch, realhf; assert trl.__version__ == '{TRL_VERSION}'; "
        f"assert torch.__version__.startswith('{TORCH_PIN.split('==')[1]}')",
    ]  # fmt: skip
    if os.path.exists(py) and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"making the TRL venv in {venv} (once; about a minute) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    # The venv sees this interpreter's packages (the project, torch, transformers) after its
    # own: a venv made with --system-site-packages from a venv would see the base
    # interpreter's instead, without the project.
    theirs = subprocess.run(
        [py, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    mine = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    with open(os.path.join(theirs, "realhf_outer.pth"), "w") as f:
        f.write("\n".join([ROOT, *mine]) + "\n")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
        pin.write(TORCH_PIN + "\n")
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "-c", pin.name, f"trl=={TRL_VERSION}"], check=True
    )
    if subprocess.run(probe, capture_output=True).returncode != 0:
        raise SystemExit(
            f"the TRL venv {venv} does not import trl {TRL_VERSION}; remove it and retry"
        )
    return py


def run_trl(args, out: str, checkpointing: str) -> dict:
    cmd = [_trl_python(), os.path.abspath(__file__), "--trl-child", "--out", out, *_shared(args)]
    cmd += ["--trl-gradient-checkpointing", checkpointing]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    line = [x for x in r.stdout.splitlines() if x.startswith("TRL_RESULT ")]
    if r.returncode != 0 or not line:
        raise SystemExit(
            f"TRL failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    res = json.loads(line[-1].split(" ", 1)[1])
    # Per step: one _generate and one _calculate_rewards call (num_iterations=1).
    split = [
        {"gen": g, "reward": w, "train": s - g - w, "overhead": 0.0}
        for s, g, w in zip(res["step_s"], res["gen_s"], res["reward_s"])
    ]
    label = f"TRL GRPOTrainer, checkpointing {checkpointing}"
    return _figures(label, res["step_s"], split, res["acc"], args)


# ---------------------------------------------------------------------------- ours
def _mfc_spans(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "trace.json")) as f:
        t = json.load(f)
    events = t["traceEvents"] if isinstance(t, dict) else t
    spans = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ("actor_gen", "rew_inf", "actor_train"):
            spans.setdefault(e["name"], []).append(e["dur"] / 1e6)
    return spans


def run_ours(name: str, args, fileroot: str) -> dict:
    cmd = [
        sys.executable, "-m", "realhf.apps.quickstart", name,
        f"fileroot={fileroot}",
        f"task={args.task}",
        f"train_batch_size={args.batch}",
        f"ppo.group_size={args.group_size}",
        f"ppo.gen.max_new_tokens={args.max_new_tokens}",
        f"actor.optimizer.lr={args.lr}",
        f"exp_ctrl.benchmark_steps={args.steps}",
        "eval=false",
        f"seed={args.seed}",
        f"actor.path={args.model}",
        f"actor.dtype={args.dtype}",
    ]  # fmt: skip
    if name == "ppo-math":
        cmd.append(f"torch_threads={args.threads}")
    # async-ppo-math splits the machine's cores between its servers and its trainer itself
    # (gen_server.num_threads, torch_threads), the whole machine being its budget.
    if name == "async-ppo-math":
        cmd.append(f"max_head_offpolicyness={args.eta}")
    print(f"\n$ {' '.join(cmd)}", flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(
            f"{name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    run_dir = os.path.join(fileroot, name, "run0")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [r_["time"] for r_ in rows]
    # verifier ±1 scaled by reward_output_scaling (5): accuracy = (r/5 + 1) / 2
    acc = [(r_["actor_train/ppo/task_reward"] / 5.0 + 1.0) / 2.0 for r_ in rows]
    spans = _mfc_spans(run_dir)
    split = []
    for i, s in enumerate(steps):
        if name == "async-ppo-math":
            tr = spans["actor_train"][i]
            split.append({"gen": None, "reward": None, "train": tr, "overhead": s - tr})
            continue
        g, w, tr = spans["actor_gen"][i], spans["rew_inf"][i], spans["actor_train"][i]
        split.append({"gen": g, "reward": w, "train": tr, "overhead": s - g - w - tr})
    label = "ours, sync (ppo-math)" if name == "ppo-math" else "ours, async (async-ppo-math)"
    return _figures(label, steps, split, acc, args)


# ---------------------------------------------------------------------------- report
def _figures(label: str, steps: list, split: list, acc: list, args) -> dict:
    timed = steps[1:]
    comps = args.batch * args.group_size * len(timed)
    out = {
        "label": label,
        "completions_per_s": comps / sum(timed),
        "step_s_median": statistics.median(timed),
        "acc_first5": statistics.mean(acc[:5]),
        "acc_last5": statistics.mean(acc[-5:]),
    }
    for k in ("gen", "reward", "train", "overhead"):
        vals = [s[k] for s in split[1:] if s[k] is not None]
        out[f"{k}_s_median"] = statistics.median(vals) if vals else None
    return out


def _host() -> dict:
    from benchmark.scale import host_facts

    return host_facts()


def _fmt(v, spec=".3f"):
    return "overlapped" if v is None else format(v, spec)


def _shared(args) -> list:
    return [
        "--steps", str(args.steps), "--batch", str(args.batch),
        "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
        "--lr", str(args.lr), "--seed", str(args.seed), "--threads", str(args.threads),
        "--model", args.model, "--task", args.task, "--dtype", args.dtype, "--data", args.data,
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="tiny_arith",
                   help="embedded task: its SFT model, prompts and the defaults below")  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="default: 30 (tiny_long: 8)")
    p.add_argument("--batch", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 16 (tiny_long: 256)")
    p.add_argument("--lr", type=float, default=None, help="default: 2e-4 (tiny_long: 1e-4)")
    p.add_argument("--eta", type=int, default=1, help="async max_head_offpolicyness")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model", default="", help="start model (default: the task's SFT model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights (ours) / autocast (TRL)")  # fmt: skip
    p.add_argument("--only", choices=["trl", "trl_default", "sync", "async"], action="append",
                   help="run only these sides (repeatable; trl: TRL at its fastest setting, "
                   "trl_default: at its defaults)")  # fmt: skip
    p.add_argument("--data", default="", help=argparse.SUPPRESS)  # the task's prompts
    p.add_argument("--trl-gradient-checkpointing", default="off", help=argparse.SUPPRESS)
    p.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    for key, value in TASK_DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sys.path.insert(0, ROOT)
    from realhf.experiments.building_blocks import task_data, task_model

    args.model = args.model or task_model(args.task)
    args.data = args.data or task_data(args.task, "train")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r}: not a HuggingFace directory (no config.json)")
    if args.trl_child:
        return _trl_child(args)
    sides = args.only or ["trl_default", "trl", "sync", "async"]
    fileroot = tempfile.mkdtemp(prefix="peers_")
    load0 = os.getloadavg()[0]
    res = {}
    if "trl_default" in sides:  # GRPOConfig's default: gradient checkpointing on
        res["trl_default"] = run_trl(args, os.path.join(fileroot, "trl_default"), "on")
    if "trl" in sides:  # its fastest here: off
        res["trl"] = run_trl(args, os.path.join(fileroot, "trl"), "off")
    if "sync" in sides:
        res["sync"] = run_ours("ppo-math", args, fileroot)
    if "async" in sides:
        res["async"] = run_ours("async-ppo-math", args, fileroot)
    print(
        f"\n{args.task}: {args.batch} prompts x {args.group_size} answers per step, "
        f"<= {args.max_new_tokens} "
        f"new tokens, {args.steps} steps (first one untimed), {args.threads} threads, "
        f"{args.dtype}, model {os.path.basename(args.model.rstrip('/'))}"
    )
    head = f"{'':40} {'compl/s':>8} {'step':>7} {'gen':>10} {'reward':>10} {'train':>7} {'other':>7} {'acc first5→last5':>17}"  # noqa: E501
    print(head)
    for r in res.values():
        print(
            f"{r['label']:40} {r['completions_per_s']:8.0f} {r['step_s_median']:7.3f} "
            f"{_fmt(r['gen_s_median']):>10} {_fmt(r['reward_s_median']):>10} "
            f"{_fmt(r['train_s_median']):>7} {_fmt(r['overhead_s_median']):>7} "
            f"{100 * r['acc_first5']:7.1f}% → {100 * r['acc_last5']:.1f}%"
        )
    summary = {
        "date": datetime.date.today().isoformat(),
        "task": args.task,
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "steps": args.steps,
        "model": args.model,
        "dtype": args.dtype,
        "host": _host(),
        "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }
    for side, r in res.items():
        summary[f"{side}_completions_per_s"] = round(r["completions_per_s"], 1)
        summary[f"{side}_step_s_median"] = round(r["step_s_median"], 3)
        summary[f"{side}_acc_first5_last5"] = [round(r["acc_first5"], 3), round(r["acc_last5"], 3)]
    trl = [k for k in ("trl", "trl_default") if k in res]
    if trl:
        # our ratios are against TRL's faster run (normally checkpointing off)
        best = max(trl, key=lambda k: res[k]["completions_per_s"])
        summary["trl_gradient_checkpointing"] = best == "trl_default"
        ratios = {
            side: res[side]["completions_per_s"] / res[best]["completions_per_s"]
            for side in ("sync", "async")
            if side in res
        }
        for side, ratio in ratios.items():
            summary[f"ours_over_trl_{side}"] = round(ratio, 3)
        if args.task == "tiny_long" and ratios:
            # the long workload's figure: our best mode against TRL at the same budget
            summary["ours_over_trl_long"] = round(max(ratios.values()), 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
