"""Generate the embedded tiny arithmetic task (train / held-out eval / SFT splits).

    python examples/tiny/make_data.py                 # writes the committed files
    python examples/tiny/make_data.py --out-dir /tmp/x --eval-copy /tmp/x/test.jsonl

Problems are an even mix of three kinds, all with small integer answers:

- ``add``: 2-digit + 2-digit            ``Compute 37+48.``  -> ``\\boxed{85}``
- ``sub``: 2-digit - 2-digit, a >= b    ``Compute 90-12.``  -> ``\\boxed{78}``
- ``mul``: 2-digit * 1-digit (1..9), either operand order
                                        ``Compute 48*7.``   -> ``\\boxed{336}``

Every distinct problem appears at most once over all splits, and the eval split is disjoint
from train.  Multiplication has the fewest distinct problems (2 * 90 * 9 = 1620), which caps
the balanced train split at ``n_train_per_kind`` per kind.

Files written (math jsonl is AReaL's format; ``query_id`` names the problem, e.g.
``add-37-48``, so ids are stable and readable):

- ``{out_dir}/train.jsonl``  math jsonl: ``{"query_id", "prompt", "task": "math",
  "solutions": ["\\\\boxed{85}"]}``
- ``{out_dir}/eval.jsonl``   same format, ``n_eval`` held-out problems
- ``{out_dir}/sft.jsonl``    ``{"id", "prompt", "answer"}`` over the train problems
- ``{eval_copy}``            an identical copy of eval.jsonl where ``evaluation/`` looks it up
                             by data set name (``evaluation/data/tiny_arith/test.jsonl``)

The prompt is exactly what the model sees (no chat wrapping is needed: the tiny tokenizer's
chat template renders a user turn as its bare content) and the answer follows it directly,
then EOS.  Output is a pure function of ``--seed``: same seed, byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "realhf", "assets", "tiny", "data")
DEFAULT_EVAL_COPY = os.path.join(REPO_ROOT, "evaluation", "data", "tiny_arith", "test.jsonl")

KINDS = ("add", "sub", "mul")
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}


def all_problems(kind: str) -> List[Tuple[str, int, int]]:
    """Every distinct problem of one kind as ``(kind, a, b)`` meaning ``a <op> b``, sorted."""
    two_digit = range(10, 100)
    if kind == "add":
        return [("add", a, b) for a in two_digit for b in two_digit]
    if kind == "sub":
        return [("sub", a, b) for a in two_digit for b in two_digit if a >= b]
    if kind == "mul":
        one_digit = range(1, 10)
        return [("mul", a, b) for a in two_digit for b in one_digit] + [
            ("mul", b, a) for a in two_digit for b in one_digit
        ]
    raise ValueError(f"unknown problem kind {kind!r}; use one of {KINDS}")


def answer_of(kind: str, a: int, b: int) -> int:
    """The integer result of ``a <op> b``."""
    return {"add": a + b, "sub": a - b, "mul": a * b}[kind]


def prompt_of(kind: str, a: int, b: int) -> str:
    """The prompt text, e.g. ``Compute 37+48.``."""
    return f"Compute {a}{_SYMBOL[kind]}{b}."


def boxed(n: int) -> str:
    """The answer text the verifier and SFT use, e.g. ``\\boxed{85}``."""
    return f"\\boxed{{{n}}}"


def math_record(kind: str, a: int, b: int) -> Dict:
    """One line of the math jsonl format."""
    return {
        "query_id": f"{kind}-{a}-{b}",
        "prompt": prompt_of(kind, a, b),
        "task": "math",
        "solutions": [boxed(answer_of(kind, a, b))],
    }


def sft_record(kind: str, a: int, b: int) -> Dict:
    """One line of the SFT jsonl format."""
    return {
        "id": f"{kind}-{a}-{b}",
        "prompt": prompt_of(kind, a, b),
        "answer": boxed(answer_of(kind, a, b)),
    }


def split_problems(
    seed: int, n_eval: int, n_train_per_kind: int
) -> Tuple[List[Tuple[str, int, int]], List[Tuple[str, int, int]]]:
    """Choose the eval and train problems, balanced over kinds and disjoint.

    Eval gets ``n_eval // 3`` problems per kind, the first ``n_eval % 3`` kinds one more.
    Both lists are shuffled so that kinds interleave.
    """
    if n_eval < len(KINDS):
        raise ValueError(f"n_eval={n_eval} must be >= {len(KINDS)} to hold every kind")
    rng = random.Random(seed)
    pools = {kind: all_problems(kind) for kind in KINDS}
    n_eval_of = {
        kind: n_eval // len(KINDS) + (1 if i < n_eval % len(KINDS) else 0)
        for i, kind in enumerate(KINDS)
    }
    room = min(len(pools[k]) - n_eval_of[k] for k in KINDS)
    if n_train_per_kind > room:
        scarce = min(KINDS, key=lambda k: len(pools[k]) - n_eval_of[k])
        raise ValueError(
            f"n_train_per_kind={n_train_per_kind} is more than kind {scarce!r} has left after "
            f"{n_eval_of[scarce]} eval problems ({room} of {len(pools[scarce])}); "
            f"lower --n-train-per-kind to at most {room}"
        )
    eval_items, train_items = [], []
    for kind in KINDS:
        pool = pools[kind]
        rng.shuffle(pool)
        k_eval = n_eval_of[kind]
        eval_items += pool[:k_eval]
        train_items += pool[k_eval : k_eval + n_train_per_kind]
    rng.shuffle(eval_items)
    rng.shuffle(train_items)
    return train_items, eval_items


def _write_jsonl(path: str, records: List[Dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def make_data(
    out_dir: str = DEFAULT_OUT_DIR,
    eval_copy: str | None = DEFAULT_EVAL_COPY,
    seed: int = 1,
    n_eval: int = 500,
    n_train_per_kind: int = 1400,
) -> Dict[str, int]:
    """Write train/eval/sft jsonl files (and the eval copy); returns the split sizes."""
    train, held_out = split_problems(seed, n_eval, n_train_per_kind)
    return write_splits(out_dir, eval_copy, train, held_out, math_record, sft_record)


def write_splits(out_dir, eval_copy, train, held_out, math_record, sft_record) -> Dict[str, int]:
    """Write ``train``/``held_out`` problems as train/eval (math jsonl) and sft jsonl under
    ``out_dir`` (and eval again at ``eval_copy``); returns the split sizes.  Shared with
    examples/tiny_long/make_data.py."""
    _write_jsonl(os.path.join(out_dir, "train.jsonl"), [math_record(*p) for p in train])
    _write_jsonl(os.path.join(out_dir, "eval.jsonl"), [math_record(*p) for p in held_out])
    _write_jsonl(os.path.join(out_dir, "sft.jsonl"), [sft_record(*p) for p in train])
    if eval_copy:
        _write_jsonl(eval_copy, [math_record(*p) for p in held_out])
    return {"train": len(train), "eval": len(held_out), "sft": len(train)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where train/eval/sft.jsonl go")
    p.add_argument(
        "--eval-copy",
        default=DEFAULT_EVAL_COPY,
        help="second copy of eval.jsonl for evaluation/ ('' to skip)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--n-eval", type=int, default=500, help="held-out problems (>= 500 for stable accuracy)"
    )
    p.add_argument("--n-train-per-kind", type=int, default=1400)
    args = p.parse_args(argv)
    sizes = make_data(
        args.out_dir, args.eval_copy or None, args.seed, args.n_eval, args.n_train_per_kind
    )
    print(f"wrote {sizes} to {args.out_dir}")


if __name__ == "__main__":
    main()
