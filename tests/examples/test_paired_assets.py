"""The committed preference pairs (examples/paired/make_pairs.py -> realhf/assets/tiny/data/)."""

import pathlib
import random
import re

import pytest
from example_scripts import load_script, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "realhf" / "assets" / "tiny" / "data"
_PROMPT = re.compile(r"^Compute (\d+)([+\-*])(\d+)\.$")


def _script():
    return load_script("examples/paired/make_pairs.py", "make_pairs")


_read = read_jsonl


def test_pairs_are_correct_vs_wrong_and_held_out_from_training():
    mp = _script()
    math_ids = {s: {r["query_id"] for r in _read(DATA / f"{s}.jsonl")} for s in ("train", "eval")}
    # (split, its rows, the math split its problems come from); rw_train ids are "qid/k"
    for split, n, source in (
        ("train", 2000, "train"),
        ("eval", 500, "eval"),
        ("rw_train", 15620, "train"),
    ):
        rows = _read(DATA / f"pairs_{split}.jsonl")
        assert len(rows) == n
        assert {r["id"].split("/")[0] for r in rows} <= math_ids[source]
        for r in rows:
            a, op, b = _PROMPT.match(r["prompt"]).groups()
            truth = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert mp.boxed_value(r["chosen"]) == truth
            wrong = mp.boxed_value(r["rejected"])
            assert wrong is not None and wrong != truth, r


def test_near_miss_is_a_close_wrong_answer():
    mp = _script()
    rng = random.Random(0)
    for value in (0, 7, 10, 99, 100, 855):
        for _ in range(20):
            x = mp.near_miss(value, rng)
            assert x != value and x >= 0 and len(str(x)) - len(str(value)) in (-1, 0, 1)


@pytest.mark.slow
def test_script_reproduces_the_committed_files(tmp_path):
    # ~30 s: greedy + sampled answers of the SFT model; the rw split only for the first 256
    # problems (its first batch of samples, drawn as in the whole file)
    _script().main(["--out-dir", str(tmp_path), "--rw-n-train", "256"])
    for split in ("train", "eval"):
        name = f"pairs_{split}.jsonl"
        made, committed = _read(tmp_path / name), _read(DATA / name)
        key = [(r["id"], r["prompt"], r["chosen"]) for r in made]
        assert key == [(r["id"], r["prompt"], r["chosen"]) for r in committed], name
        # The rejected answers are the SFT model's own samples: bit-identical on this
        # machine, but another CPU's float kernels may tip a rare near-tie in sampling.
        same = sum(a["rejected"] == b["rejected"] for a, b in zip(made, committed))
        assert same >= 0.98 * len(made), (name, same, len(made))
    first = {r["query_id"] for r in _read(DATA / "train.jsonl")[:256]}
    committed = {
        (r["prompt"], r["rejected"])
        for r in _read(DATA / "pairs_rw_train.jsonl")
        if r["id"].split("/")[0] in first
    }
    made = {(r["prompt"], r["rejected"]) for r in _read(tmp_path / "pairs_rw_train.jsonl")}
    assert len(made & committed) >= 0.98 * max(len(made), len(committed)), (
        len(made),
        len(committed),
    )
