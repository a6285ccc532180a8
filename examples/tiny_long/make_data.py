"""Generate the embedded long-reasoning task ``tiny_long`` (train / held-out eval / SFT splits).

    python examples/tiny_long/make_data.py            # writes the committed files
    python examples/tiny_long/make_data.py --out-dir /tmp/x --eval-copy ''

A problem ``Compute c+a*b.`` (c in 1..999, a in 1..30, b in 2..9) is solved by adding b
to c, a times, one addition per line, each line numbered, then boxing the result::

    Compute 37+4*7.   ->   1:44
                           2:51
                           3:58
                           4:65
                           \\boxed{65}

Every step is local (increment the line number, add one digit to the previous total,
stop when the line number reaches a), so the tiny model can learn it, and the answer
length is set by the problem: about 8 tokens per line.  ``a`` is drawn with weight
``a**-TAIL`` (TAIL = 1.3), which gives a long tail of lengths: 10 to ~240 answer tokens,
median ~26, 90th percentile ~110 in the reference answers; sampled at temperature 1 from
the SFT policy (which ends some chains early and runs others on past their last line):
median 21, p90 153 -- the regime where a synchronous step waits for its longest answers
(issue "where asynchrony wins").  With weight ``1/a`` the reference ratio was 4.3 but the
policy sampled only 3.85.

Files and formats are those of the short task (examples/tiny/make_data.py):
``train.jsonl`` / ``eval.jsonl`` (math jsonl), ``sft.jsonl`` ({id, prompt, answer})
over the train problems, and a copy of eval.jsonl where ``evaluation/`` finds it by
name (``evaluation/data/tiny_long/test.jsonl``).  Each distinct problem appears at most
once over all splits.  Output is a pure function of ``--seed``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "realhf", "assets", "tiny_long", "data")
DEFAULT_EVAL_COPY = os.path.join(REPO_ROOT, "evaluation", "data", "tiny_long", "test.jsonl")

START = range(1, 1000)  # c
COUNT = range(1, 31)  # a: number of lines
STEP = range(2, 10)  # b
TAIL = 1.3  # a is drawn with weight a**-TAIL

Problem = Tuple[int, int, int]  # (c, a, b)


def prompt_of(c: int, a: int, b: int) -> str:
    return f"Compute {c}+{a}*{b}."


def solution_of(c: int, a: int, b: int) -> str:
    """The worked answer: ``k:total`` for k = 1..a, then ``\\boxed{c+a*b}``."""
    lines, total = [], c
    for k in range(1, a + 1):
        total += b
        lines.append(f"{k}:{total}")
    return "\n".join(lines) + f"\n\\boxed{{{total}}}"


def math_record(c: int, a: int, b: int) -> Dict:
    return {
        "query_id": f"long-{c}-{a}-{b}",
        "prompt": prompt_of(c, a, b),
        "task": "math",
        "solutions": [f"\\boxed{{{c + a * b}}}"],
    }


def sft_record(c: int, a: int, b: int) -> Dict:
    return {"id": f"long-{c}-{a}-{b}", "prompt": prompt_of(c, a, b), "answer": solution_of(c, a, b)}


def sample_problems(seed: int, n: int) -> List[Problem]:
    """``n`` distinct problems, ``a`` drawn with weight ``a**-TAIL`` (the long tail of lengths)."""
    rng = random.Random(seed)
    weights = [a**-TAIL for a in COUNT]
    seen, out = set(), []
    while len(out) < n:
        p = (rng.choice(START), rng.choices(COUNT, weights)[0], rng.choice(STEP))
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _tiny_make_data():
    """examples/tiny/make_data.py (its split writer), loaded by path: both scripts are
    named make_data."""
    path = os.path.join(REPO_ROOT, "examples", "tiny", "make_data.py")
    spec = importlib.util.spec_from_file_location("tiny_make_data", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_data(
    out_dir: str = DEFAULT_OUT_DIR,
    eval_copy: str | None = DEFAULT_EVAL_COPY,
    seed: int = 1,
    n_eval: int = 500,
    n_train: int = 8000,
) -> Dict[str, int]:
    """Write train/eval/sft jsonl files (and the eval copy); returns the split sizes."""
    problems = sample_problems(seed, n_eval + n_train)
    held_out, train = problems[:n_eval], problems[n_eval:]
    return _tiny_make_data().write_splits(
        out_dir, eval_copy, train, held_out, math_record, sft_record
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where train/eval/sft.jsonl go")
    p.add_argument(
        "--eval-copy",
        default=DEFAULT_EVAL_COPY,
        help="second copy of eval.jsonl for evaluation/ ('' to skip)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-eval", type=int, default=500, help="held-out problems (>= 500)")
    p.add_argument("--n-train", type=int, default=8000)
    args = p.parse_args(argv)
    sizes = make_data(args.out_dir, args.eval_copy or None, args.seed, args.n_eval, args.n_train)
    print(f"wrote {sizes} to {args.out_dir}")


if __name__ == "__main__":
    main()
