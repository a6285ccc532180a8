"""Measure greedy accuracy of saved SFT checkpoints and install the one closest to a target.

    python examples/tiny/pick_checkpoint.py CKPT_ROOT --low 0.2 --high 0.6 [--target 0.35] \
        [--install realhf/assets/tiny]

CKPT_ROOT holds HF directories named ``epoch{E}epochstep{S}globalstep{G}`` (what
`quickstart sft exp_ctrl.save_freq_steps=N` writes). Each is evaluated greedily on the
held-out split of ``--task`` (500 problems) with evaluation/eval_and_aggregate.py; the
checkpoint in [low, high] closest to --target is copied (config + weights) into --install.
"""

import argparse
import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "evaluation"))

WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors")


def main(argv=None):
    import eval_and_aggregate as ev

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt_root")
    p.add_argument("--low", type=float, default=0.2)
    p.add_argument("--high", type=float, default=0.6)
    p.add_argument("--target", type=float, default=0.35)
    p.add_argument(
        "--min-step", type=int, default=0, help="skip checkpoints before this global step"
    )
    p.add_argument("--install", default=None, help="directory to copy the chosen weights into")
    p.add_argument(
        "--task", default="tiny_arith", help="evaluation data set (tiny_arith, tiny_long)"
    )
    p.add_argument("--max-gen-tokens", type=int, default=16, help="greedy answer budget")
    args = p.parse_args(argv)
    ckpts = []
    for name in os.listdir(args.ckpt_root):
        m = re.search(r"globalstep(\d+)$", name)
        if m and int(m.group(1)) >= args.min_step:
            ckpts.append((int(m.group(1)), os.path.join(args.ckpt_root, name)))
    if not ckpts:
        sys.exit(f"no checkpoints under {args.ckpt_root}")
    results = {}
    for step, path in sorted(ckpts):
        out = ev.evaluate(
            path, [args.task], os.path.join(path, "eval"), max_gen_tokens=args.max_gen_tokens
        )
        results[step] = out[args.task]["greedy_acc"]
        print(f"step {step:5d}: greedy accuracy {100 * results[step]:.1f}%", flush=True)
    inside = {s: a for s, a in results.items() if args.low <= a <= args.high}
    if not inside:
        sys.exit(f"no checkpoint with accuracy in [{args.low}, {args.high}]: {results}")
    step = min(inside, key=lambda s: abs(inside[s] - args.target))
    path = dict(ckpts)[step]
    print(f"chosen: step {step} ({100 * inside[step]:.1f}%) {path}")
    if args.install:
        for f in WEIGHT_FILES:
            if os.path.exists(os.path.join(path, f)):
                shutil.copy(os.path.join(path, f), os.path.join(args.install, f))
        with open(os.path.join(args.install, "sft_provenance.json"), "w") as f:
            json.dump(
                {
                    "global_step": step,
                    f"greedy_acc_{args.task}": inside[step],
                    "all_checkpoints": {str(k): v for k, v in sorted(results.items())},
                },
                f,
                indent=2,
            )
        print(f"installed into {args.install}")


if __name__ == "__main__":
    main()
