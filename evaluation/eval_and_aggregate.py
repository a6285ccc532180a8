"""Evaluate a checkpoint on math data sets: greedy accuracy, pass@k, maj@k.

    python evaluation/eval_and_aggregate.py --model_path DIR --output_path OUT \\
        [--data_names tiny_arith,...] [--n_samples K --temperature T --max_gen_tokens N]

For every problem it generates one greedy answer and K sampled answers with the
built-in engine (realhf.impl.model.gen), grades each with the math verifier, and
writes per-problem records to ``OUT/{data_name}/samples.jsonl`` and a summary to
``OUT/summary.json`` (also printed as a table):

- greedy_acc: accuracy of the greedy answer;
- pass@1: mean accuracy of the K samples;
- pass@k (k = 1, 2, 4, ... ≤ K): unbiased estimate ``1 − C(n−c, k)/C(n, k)``;
- maj@K: the most frequent extracted answer among the K samples is correct;
- mean_len: mean generated length (tokens) of greedy and sampled answers.

Data sets are names under ``evaluation/data/{name}/test.jsonl`` (the embedded
arithmetic eval split is ``tiny_arith``) or paths of jsonl files in the math format.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_DIR = os.path.join(HERE, "data")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for n samples with c correct: 1 − ∏_{j=n−c+1}^{n} (1 − k/j)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for j in range(n - c + 1, n + 1):
        prod *= 1.0 - k / j
    return 1.0 - prod


def majority_correct(answers: Sequence[Optional[str]], correct: Sequence[bool]) -> bool:
    """Whether the most frequent (normalised) extracted answer is a correct one.

    Ties go to the answer seen first; samples with no extractable answer do not vote.
    """
    votes = collections.Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes, key=lambda a: (votes[a], -answers.index(a)))
    return any(c for a, c in zip(answers, correct) if a == best)


def resolve_data(name: str) -> str:
    """A data-set name under evaluation/data/ or a jsonl path."""
    if name.endswith(".jsonl"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"data file '{name}' does not exist")
        return name
    path = os.path.join(DATA_DIR, name, "test.jsonl")
    if not os.path.isfile(path):
        known = sorted(d for d in os.listdir(DATA_DIR) if os.path.isdir(os.path.join(DATA_DIR, d)))
        raise FileNotFoundError(
            f"unknown data set '{name}': no {path}; known: {known} (or pass a .jsonl path)"
        )
    return path


def load_problems(path: str) -> List[dict]:
    """Rows of a math jsonl file (query_id, prompt, solutions), with line-precise errors."""
    from realhf.impl.dataset.jsonl import read_jsonl

    rows = read_jsonl(path, {"prompt": str, "solutions": list})
    for i, r in enumerate(rows):
        r.setdefault("query_id", str(i))
    return rows


def _percent(x: float) -> str:
    return f"{100 * x:.1f}"


# Long on purpose: load once, then per data set generate, grade and aggregate, writing
# each set's records as it finishes (a crash keeps the sets already done).
def evaluate(
    model_path: str,
    data_names: Sequence[str],
    output_path: str,
    n_samples: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_gen_tokens: int = 32,
    max_problems: Optional[int] = None,
    seed: int = 1,
    max_running_requests: int = 128,
) -> Dict[str, dict]:
    """Evaluate `model_path` on each data set; return {data_name: summary}."""
    import torch
    from transformers import AutoTokenizer

    from realhf.api.core.data_api import VisionInputs
    from realhf.api.core.gen_api import GenerateRequest, SamplingParams
    from realhf.impl.dataset.images import RowImages
    from realhf.impl.model import ReaLModel
    from realhf.impl.model.gen.engine import GenerationEngine
    from realhf.impl.model.gen.engine_config import EngineConfig
    from realhf.impl.reward.math_reward import extract_answer, normalize_answer, verify_batch

    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model directory '{model_path}' does not exist")
    paths = {name: resolve_data(name) for name in data_names}
    tok = AutoTokenizer.from_pretrained(model_path)
    model = ReaLModel.from_hf(model_path, dtype=torch.float32, device="cpu")
    model.eval()
    engine = GenerationEngine(
        model,
        EngineConfig(max_running_requests=max_running_requests, seed=seed, device="cpu"),
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    ).start()
    summaries = {}
    try:
        for name, path in paths.items():
            problems = load_problems(path)[:max_problems]
            t0 = time.monotonic()
            prompts = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
            images = [None] * len(problems)
            if RowImages.needed(problems):  # a visual task: placeholders expanded, pixels
                rows = RowImages(path, tok)
                for i, p in enumerate(problems):
                    prompts[i] = rows.expand(i, p, prompts[i], f"{path} ({p['query_id']})")
                    pix, grid = rows.pixels(i)
                    images[i] = VisionInputs(pix, grid) if grid.shape[0] else None
            greedy = SamplingParams(max_new_tokens=max_gen_tokens, temperature=0.0)
            reqs = [
                GenerateRequest(input_ids=ids, sampling=greedy, images=im)
                for ids, im in zip(prompts, images)
            ]
            if n_samples > 0:
                sp = SamplingParams(
                    max_new_tokens=max_gen_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    n=n_samples,
                )
                for i, ids in enumerate(prompts):
                    base = SamplingParams(**{**sp.__dict__, "sampling_seed": seed * 1_000_003 + i})
                    reqs += [
                        GenerateRequest(
                            input_ids=ids, sampling=base.for_sample(j), images=images[i]
                        )
                        for j in range(n_samples)
                    ]
            outs = engine.generate(reqs)
            texts = [tok.decode(o.output_ids, skip_special_tokens=True) for o in outs]
            lens = [len(o.output_ids) for o in outs]
            n = len(problems)
            sols = [p["solutions"] for p in problems]
            correct = verify_batch(texts, sols[:] + [s for s in sols for _ in range(n_samples)])
            records = []
            ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n_samples]
            agg = collections.defaultdict(float)
            for i, p in enumerate(problems):
                lo = n + i * n_samples
                s_texts, s_ok = texts[lo : lo + n_samples], correct[lo : lo + n_samples]
                answers = [extract_answer(t) for t in s_texts]
                answers = [normalize_answer(a) if a is not None else None for a in answers]
                rec = {
                    "idx": i,
                    "query_id": p["query_id"],
                    "prompt": p["prompt"],
                    "solutions": p["solutions"],
                    "greedy": texts[i],
                    "greedy_correct": correct[i],
                    "samples": s_texts,
                    "sample_correct": s_ok,
                }
                records.append(rec)
                agg["greedy_acc"] += correct[i]
                if n_samples:
                    agg["pass@1"] += sum(s_ok) / n_samples
                    for k in ks:
                        agg[f"pass@{k}"] += pass_at_k(n_samples, sum(s_ok), k)
                    agg[f"maj@{n_samples}"] += majority_correct(answers, s_ok)
            summary = {k: v / n for k, v in agg.items()}
            summary["greedy_mean_len"] = sum(lens[:n]) / n
            if n_samples:
                summary["sample_mean_len"] = sum(lens[n:]) / (n * n_samples)
            summary.update(
                n_problems=n, n_samples=n_samples, seconds=round(time.monotonic() - t0, 2)
            )
            summaries[name] = summary
            out_dir = os.path.join(output_path, os.path.basename(name).removesuffix(".jsonl"))
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "samples.jsonl"), "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
    finally:
        engine.close()
    os.makedirs(output_path, exist_ok=True)
    with open(os.path.join(output_path, "summary.json"), "w") as f:
        json.dump({"model_path": os.path.abspath(model_path), "results": summaries}, f, indent=2)
    return summaries


def format_table(summaries: Dict[str, dict]) -> str:
    """A plain-text table: one row per data set, metrics as percentages."""
    cols = []
    for s in summaries.values():
        cols += [k for k in s if k not in cols and k not in ("n_problems", "n_samples", "seconds")]
    head = ["data"] + cols + ["n"]
    rows = [head]
    for name, s in summaries.items():
        row = [name]
        for c in cols:
            v = s.get(c)
            row.append("" if v is None else (f"{v:.1f}" if "len" in c else _percent(v)))
        rows.append(row + [str(s["n_problems"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model_path", required=True, help="HuggingFace model directory (with tokenizer)"
    )
    p.add_argument(
        "--data_names",
        default="tiny_arith",
        help="comma-separated names under evaluation/data/ or .jsonl paths "
        "(default: tiny_arith, the embedded arithmetic eval split)",
    )
    p.add_argument(
        "--output_path", required=True, help="directory for samples.jsonl files and summary.json"
    )
    p.add_argument(
        "--n_samples",
        type=int,
        default=0,
        help="sampled answers per problem besides the greedy one",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument(
        "--max_gen_tokens", type=int, default=32, help="most generated tokens per answer"
    )
    p.add_argument(
        "--max_problems", type=int, default=None, help="evaluate only the first N problems"
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.n_samples < 0 or args.max_gen_tokens < 1 or args.temperature <= 0:
        p.error("need n_samples >= 0, max_gen_tokens >= 1 and temperature > 0")
    try:
        summaries = evaluate(
            args.model_path,
            [d for d in args.data_names.split(",") if d],
            args.output_path,
            n_samples=args.n_samples,
            temperature=args.temperature,
            top_p=args.top_p,
            max_gen_tokens=args.max_gen_tokens,
            max_problems=args.max_problems,
            seed=args.seed,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"eval_and_aggregate: {e}", file=sys.stderr)
        return 2
    print(format_table(summaries))
    print(f"summary written to {os.path.join(args.output_path, 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
