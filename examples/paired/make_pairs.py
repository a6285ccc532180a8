"""Make the embedded preference pairs of the tiny arithmetic task (for `rw` and `dpo`).

    python examples/paired/make_pairs.py              # writes the committed files
    python examples/paired/make_pairs.py --out-dir /tmp/pairs --n-train 500

Each row is ``{"id", "prompt", "chosen", "rejected"}``: ``chosen`` is the correct answer in
the task's format (``\\boxed{85}``) and ``rejected`` a wrong one.  The rejected answers are
the embedded SFT model's own mistakes, so the pairs teach what that model gets wrong:

1. its greedy answer, when the verifier marks it wrong (what greedy accuracy measures);
2. else the first wrong one of ``--n-samples`` answers sampled at temperature 1;
3. else (the model is sure and right) a near miss: the true result with one digit moved by
   ±1, or ±1 overall, which keeps the task hard for a reward model (no format shortcut:
   every rejected answer is a well-formed ``\\boxed{integer}``).

``--rejected near_miss`` makes every rejected answer a near miss instead (no model needed).

``pairs_rw_train.jsonl`` (the ``rw`` recipe's training split) has more pairs per problem:
for every train problem, one pair per distinct well-formed wrong answer among
``--rw-samples`` answers sampled at temperature 1 (~3.7 per problem, ~15.5k pairs), so
the reward model sees the spread of mistakes the model makes, not only its favourite one.

Source prompts are the task's train split (``pairs_train.jsonl``, the first ``--n-train``
problems) and its held-out eval split (``pairs_eval.jsonl``, all 500), so held-out pairs
share no problem with the SFT data or the training pairs.  Output depends only on
``--seed`` and the model (CPU, float32, one thread: the same bytes on every run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO_ROOT, "realhf", "assets", "tiny")
DEFAULT_OUT_DIR = os.path.join(TINY, "data")

_BOXED = re.compile(r"^\\boxed\{(-?\d+)\}$")


def boxed_value(text: str) -> Optional[int]:
    """The integer of an answer exactly of the form ``\\boxed{N}``, else None."""
    m = _BOXED.match(text.strip())
    return int(m.group(1)) if m else None


def near_miss(value: int, rng: random.Random) -> int:
    """A wrong non-negative integer close to ``value``: one digit ±1, or the value ±1."""
    digits = str(value)
    options = set()
    for i, d in enumerate(digits):
        for step in (-1, 1):
            nd = int(d) + step
            if 0 <= nd <= 9 and not (i == 0 and nd == 0 and len(digits) > 1):
                options.add(int(digits[:i] + str(nd) + digits[i + 1 :]))
    options |= {value - 1, value + 1}
    options = sorted(x for x in options if x >= 0 and x != value)
    return rng.choice(options)


def _read_math(path: str) -> List[Dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _answers(model, tok, prompts: List[str], greedy: bool, n: int, max_new: int) -> List[List[str]]:
    """``n`` answers per prompt (greedy: n=1), decoded without special tokens."""
    import torch

    out: List[List[str]] = []
    for start in range(0, len(prompts), 256):
        chunk = prompts[start : start + 256]
        enc = tok(chunk, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(
                **enc,
                do_sample=not greedy,
                temperature=None if greedy else 1.0,
                top_k=None if greedy else 0,
                top_p=None if greedy else 1.0,
                num_return_sequences=1 if greedy else n,
                max_new_tokens=max_new,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        k = 1 if greedy else n
        out += [texts[i * k : (i + 1) * k] for i in range(len(chunk))]
    return out


def make_pairs(
    rows: List[Dict], model, tok, rng: random.Random, n_samples: int, source: str = "model"
) -> tuple:
    """Pair rows (and a count of where the rejected answers came from) for math ``rows``;
    ``source="near_miss"`` skips the model (every rejected answer a near miss)."""
    prompts = [r["prompt"] for r in rows]
    if source == "near_miss":
        greedy, sampled = [[""] for _ in rows], [[] for _ in rows]
    else:
        greedy = _answers(model, tok, prompts, True, 1, 16)
        sampled = _answers(model, tok, prompts, False, n_samples, 16)
    pairs, source = [], {"greedy": 0, "sampled": 0, "near_miss": 0}
    for row, g, s in zip(rows, greedy, sampled):
        chosen = row["solutions"][0]
        truth = boxed_value(chosen)
        # Only well-formed wrong answers: a garbled one is too easy to tell apart.
        wrong = [a.strip() for a in g + s if boxed_value(a) not in (None, truth)]
        if wrong and boxed_value(g[0]) not in (None, truth):
            rejected, kind = wrong[0], "greedy"
        elif wrong:
            rejected, kind = wrong[0], "sampled"
        else:
            rejected, kind = f"\\boxed{{{near_miss(truth, rng)}}}", "near_miss"
        source[kind] += 1
        pairs.append(
            {"id": row["query_id"], "prompt": row["prompt"], "chosen": chosen, "rejected": rejected}
        )
    return pairs, source


def all_wrong_pairs(rows: List[Dict], model, tok, n_samples: int) -> List[Dict]:
    """One pair per distinct well-formed wrong answer among ``n_samples`` sampled answers
    of each math row, in the order sampled."""
    sampled = _answers(model, tok, [r["prompt"] for r in rows], False, n_samples, 16)
    pairs = []
    for row, answers in zip(rows, sampled):
        chosen = row["solutions"][0]
        truth, seen = boxed_value(chosen), set()
        for a in (a.strip() for a in answers):
            if boxed_value(a) in (None, truth) or a in seen:
                continue
            seen.add(a)
            pairs.append(
                {
                    "id": f"{row['query_id']}/{len(seen) - 1}",
                    "prompt": row["prompt"],
                    "chosen": chosen,
                    "rejected": a,
                }
            )
    return pairs


def _write(path: str, rows: List[Dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=TINY, help="SFT model whose mistakes become 'rejected'")
    p.add_argument("--data-dir", default=DEFAULT_OUT_DIR, help="holds train.jsonl and eval.jsonl")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    p.add_argument("--n-train", type=int, default=2000, help="training pairs (first N problems)")
    p.add_argument("--n-samples", type=int, default=4, help="sampled answers per prompt")
    p.add_argument(
        "--rw-samples",
        type=int,
        default=8,
        help="sampled answers per train problem for pairs_rw_train.jsonl (0: skip it)",
    )
    p.add_argument(
        "--rw-n-train",
        type=int,
        default=None,
        help="pairs_rw_train.jsonl from the first N train problems (default: all)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--rejected",
        choices=("model", "near_miss"),
        default="model",
        help="where rejected answers come from (see the module docstring)",
    )
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # reproducible float sums, hence reproducible samples
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    for split, src, n in (("train", "train.jsonl", args.n_train), ("eval", "eval.jsonl", None)):
        rows = _read_math(os.path.join(args.data_dir, src))[:n]
        pairs, source = make_pairs(rows, model, tok, rng, args.n_samples, args.rejected)
        _write(os.path.join(args.out_dir, f"pairs_{split}.jsonl"), pairs)
        print(f"pairs_{split}.jsonl: {len(pairs)} pairs, rejected from {source}", flush=True)
    if args.rw_samples > 0 and args.rejected == "model":
        torch.manual_seed(args.seed)  # the two files above stay as they were without it
        rows = _read_math(os.path.join(args.data_dir, "train.jsonl"))[: args.rw_n_train]
        pairs = all_wrong_pairs(rows, model, tok, args.rw_samples)
        _write(os.path.join(args.out_dir, "pairs_rw_train.jsonl"), pairs)
        print(f"pairs_rw_train.jsonl: {len(pairs)} pairs from {len(rows)} problems", flush=True)


if __name__ == "__main__":
    main()
