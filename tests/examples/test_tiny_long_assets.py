"""The committed long-reasoning task (examples/tiny_long/* -> realhf/assets/tiny_long/).

Checks the worked answers, the splits, that the script reproduces the committed files, that
the answer lengths have the long tail the task exists for (in the data and under the SFT
policy, sampled with our engine), and that ``task=tiny_long`` selects it.
"""

import json
import pathlib
import re
import statistics

import pytest
from example_scripts import load_script, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = ROOT / "realhf" / "assets" / "tiny_long"
DATA = ASSETS / "data"
EVAL_COPY = ROOT / "evaluation" / "data" / "tiny_long" / "test.jsonl"
_PROMPT = re.compile(r"^Compute (\d+)\+(\d+)\*(\d+)\.$")


_read = read_jsonl


def _make_data():
    return load_script("examples/tiny_long/make_data.py", "long_make_data")


def _tail(lengths):
    s = sorted(lengths)
    return s[0], statistics.median(s), s[int(0.9 * len(s))], s[-1]


def test_worked_answers_and_solutions():
    for r in _read(DATA / "sft.jsonl"):
        c, a, b = map(int, _PROMPT.match(r["prompt"]).groups())
        assert 1 <= c <= 999 and 1 <= a <= 30 and 2 <= b <= 9
        *lines, last = r["answer"].split("\n")
        assert lines == [f"{k}:{c + k * b}" for k in range(1, a + 1)]
        assert last == f"\\boxed{{{c + a * b}}}"
        assert r["id"] == f"long-{c}-{a}-{b}"
    for split in ("train", "eval"):
        for r in _read(DATA / f"{split}.jsonl"):
            c, a, b = map(int, _PROMPT.match(r["prompt"]).groups())
            assert r["solutions"] == [f"\\boxed{{{c + a * b}}}"] and r["task"] == "math"


def test_splits_are_disjoint_and_match():
    train, held_out, sft = (_read(DATA / f"{s}.jsonl") for s in ("train", "eval", "sft"))
    assert len(held_out) == 500 and len(train) == len(sft)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["query_id"] for r in train}) == len(train)
    assert [r["query_id"] for r in train] == [r["id"] for r in sft]
    assert EVAL_COPY.read_bytes() == (DATA / "eval.jsonl").read_bytes()


def test_make_data_reproduces_the_committed_files(tmp_path):
    _make_data().make_data(str(tmp_path), str(tmp_path / "copy.jsonl"))
    for name in ("train.jsonl", "eval.jsonl", "sft.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_reference_answer_lengths_have_a_long_tail():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    recs = _read(DATA / "sft.jsonl")
    # + 1 for EOS; the prompt/answer boundary tokenizes the same joined or apart
    for r in recs[:300]:
        apart = tok.encode(r["prompt"]).ids + tok.encode(r["answer"]).ids
        assert tok.encode(r["prompt"] + r["answer"]).ids == apart
    lo, med, p90, hi = _tail([len(tok.encode(r["answer"]).ids) + 1 for r in recs])
    assert lo >= 8 and hi <= 250 and p90 / med >= 4, (lo, med, p90, hi)


def test_model_is_complete_with_room_for_long_answers():
    cfg = json.loads((ASSETS / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 512
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ASSETS / name).read_bytes() == (
            ROOT / "realhf" / "assets" / "tiny" / name
        ).read_bytes()
    prov = json.loads((ASSETS / "sft_provenance.json").read_text())
    assert 0.15 <= prov["greedy_acc_tiny_long"] <= 0.45


@pytest.mark.slow
def test_sft_policy_answer_lengths_span_the_tail():
    """Sampled at temperature 1 from the committed SFT model: ~10-250 tokens, a long tail."""
    from transformers import AutoTokenizer

    from realhf.api.core.gen_api import GenerateRequest, SamplingParams
    from realhf.impl.model.gen.engine_config import EngineConfig
    from realhf.impl.model.gen.loading import load_engine

    tok = AutoTokenizer.from_pretrained(str(ASSETS))
    engine = load_engine(
        str(ASSETS), EngineConfig(max_running_requests=256, seed=1, device="cpu"), tok
    ).start()
    try:
        prompts = [r["prompt"] for r in _read(DATA / "train.jsonl")[:256]]
        reqs = [
            GenerateRequest(
                rid=str(i),
                input_ids=tuple(tok(p, add_special_tokens=False)["input_ids"]),
                sampling=SamplingParams(max_new_tokens=256, temperature=1.0),
            )
            for i, p in enumerate(prompts)
        ]
        outs = engine.generate(reqs, timeout=300)
    finally:
        engine.close()
    lengths = [len(o.output_ids) for o in outs]
    lo, med, p90, hi = _tail(lengths)
    # Sampled at temperature 1 the SFT policy ends some chains early and runs others past
    # their last line (2026-11-27, 2048 prompts: 6-256 tokens, median 21, p90 153).
    assert lo <= 12 and hi >= 150 and p90 / med >= 4, (lo, med, p90, hi)
    stopped = sum(o.finish_reason.type == "stop" for o in outs)
    assert stopped >= 0.95 * len(outs)


@pytest.mark.parametrize("exp", ["ppo-math", "async-ppo-math", "sft"])
def test_task_selects_model_data_and_lengths(exp, tmp_path):
    from realhf.api.cli_parser import parse_config
    from realhf.apps.quickstart import _load_experiments
    from realhf.experiments.building_blocks import task_data, task_model
    from realhf.experiments.registry import get_quickstart_exp

    _load_experiments()
    cls = get_quickstart_exp(exp).config_cls
    cfg = parse_config(cls, ["task=tiny_long"])
    assert task_model(cfg.task) == str(ASSETS)
    assert task_data(cfg.task, "train") == str(DATA / "train.jsonl")
    if exp != "sft":
        assert cfg.ppo.gen.max_new_tokens == 256 and cfg.dataset.eval_max_new_tokens == 256
        # the user's own values still win over the task's defaults, in any order
        cfg = parse_config(cls, ["ppo.gen.max_new_tokens=64", "task=tiny_long"])
        assert cfg.ppo.gen.max_new_tokens == 64 and cfg.dataset.eval_max_new_tokens == 256
        assert parse_config(cls, []).ppo.gen.max_new_tokens == 16
    with pytest.raises(ValueError, match="task='nope'.*tiny_arith"):
        parse_config(cls, ["task=nope"])
