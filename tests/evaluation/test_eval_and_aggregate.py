import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "evaluation" / "eval_and_aggregate.py"
spec = importlib.util.spec_from_file_location("eval_and_aggregate", SCRIPT)
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)


def _brute_pass_at_k(n, c, k):
    # probability that a random k-subset of n samples (c correct) holds a correct one
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize(
    "n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (8, 3, 4), (16, 15, 8), (5, 5, 5)]
)
def test_pass_at_k_matches_combinatorics(n, c, k):
    assert ev.pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k))


def test_majority_vote():
    assert ev.majority_correct(["3", "4", "3", None], [True, False, True, False])
    assert not ev.majority_correct(["4", "4", "3"], [False, False, True])
    assert not ev.majority_correct([None, None], [False, False])
    # a tie goes to the first answer seen
    assert ev.majority_correct(["7", "8"], [True, False])


def test_unknown_data_name_lists_known():
    with pytest.raises(FileNotFoundError, match="tiny_arith"):
        ev.resolve_data("nope")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    from realhf.impl.model.conversion.hf import save_tokenizer

    d = tmp_path_factory.mktemp("m") / "model"
    assets = ROOT / "realhf" / "assets" / "tiny"
    make_tiny_hf_model("qwen2", d, vocab_size=272, tie_word_embeddings=True)
    save_tokenizer(str(assets), str(d))
    return d


@pytest.mark.slow
def test_cli_end_to_end(tiny_model, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model_path",
            str(tiny_model),
            "--data_names",
            "tiny_arith",
            "--output_path",
            str(out),
            "--n_samples",
            "4",
            "--max_gen_tokens",
            "6",
            "--max_problems",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())["results"]["tiny_arith"]
    for key in ("greedy_acc", "pass@1", "pass@2", "pass@4", "maj@4", "greedy_mean_len"):
        assert key in summary
    assert summary["n_problems"] == 12 and 0 <= summary["greedy_acc"] <= 1
    rows = [json.loads(l) for l in (out / "tiny_arith" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["samples"]) == 4 for r in rows)
    assert "greedy_acc" in r.stdout


@pytest.mark.slow
def test_cli_missing_model_dir(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model_path",
            str(tmp_path / "none"),
            "--data_names",
            "tiny_arith",
            "--output_path",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_data_names_default_to_the_embedded_eval_split(tiny_model, tmp_path, capsys):
    # without --data_names the script used to stop with a usage error
    from evaluation.eval_and_aggregate import main

    out = tmp_path / "out"
    argv = ["--model_path", str(tiny_model), "--output_path", str(out), "--max_problems", "2"]
    assert main(argv + ["--max_gen_tokens", "4"]) == 0
    summary = json.loads((out / "summary.json").read_text())["results"]
    assert list(summary) == ["tiny_arith"] and summary["tiny_arith"]["n_problems"] == 2
