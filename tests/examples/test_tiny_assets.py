"""The committed tiny task (examples/tiny/* -> realhf/assets/tiny/, evaluation/data/tiny_arith/).

Checks that the data is well formed, balanced and disjoint, that the tokenizer loads through
transformers' AutoTokenizer with exactly the ids of the raw `tokenizers` file (also inside a
qwen2 model directory), and that both scripts reproduce the committed files byte for byte.
"""

import collections
import filecmp
import json
import pathlib
import random
import re
import shutil

import pytest
from example_scripts import load_script, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[2]
ASSETS = ROOT / "realhf" / "assets" / "tiny"
DATA = ASSETS / "data"
EVAL_COPY = ROOT / "evaluation" / "data" / "tiny_arith" / "test.jsonl"
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]


def _load_script(name):
    return load_script(f"examples/tiny/{name}.py", f"tiny_{name}")


_read = read_jsonl


_PROMPT = re.compile(r"^Compute (\d+)([+\-*])(\d+)\.$")


def _solve(prompt):
    m = _PROMPT.match(prompt)
    assert m, f"unexpected prompt {prompt!r}"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op], op, a, b


# ---------------------------------------------------------------- data


def test_math_jsonl_format_and_answers():
    for split in ("train", "eval"):
        recs = _read(DATA / f"{split}.jsonl")
        for r in recs:
            assert set(r) == {"query_id", "prompt", "task", "solutions"}
            assert r["task"] == "math"
            value, op, a, b = _solve(r["prompt"])
            assert r["solutions"] == [f"\\boxed{{{value}}}"]
            kind = {"+": "add", "-": "sub", "*": "mul"}[op]
            assert r["query_id"] == f"{kind}-{a}-{b}"
            if op in "+-":
                assert 10 <= a <= 99 and 10 <= b <= 99
            else:
                assert sorted([len(str(a)), len(str(b))]) == [1, 2]
            assert value >= 0


def test_splits_sizes_balance_and_disjointness():
    train, held_out = _read(DATA / "train.jsonl"), _read(DATA / "eval.jsonl")
    assert len(held_out) == 500
    train_ids = [r["query_id"] for r in train]
    eval_ids = [r["query_id"] for r in held_out]
    assert len(set(train_ids)) == len(train_ids) and len(set(eval_ids)) == len(eval_ids)
    assert not set(train_ids) & set(eval_ids)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    kinds = lambda recs: collections.Counter(r["query_id"].split("-")[0] for r in recs)  # noqa: E731
    assert set(kinds(train).values()) == {len(train) // 3}
    assert sorted(kinds(held_out).values()) == [166, 167, 167]
    # kinds interleave (shuffled), not in blocks
    assert len({r["query_id"].split("-")[0] for r in train[:30]}) == 3


def test_sft_split_matches_train_and_eval_copy_is_identical():
    train, sft = _read(DATA / "train.jsonl"), _read(DATA / "sft.jsonl")
    assert [(r["query_id"], r["prompt"], r["solutions"][0]) for r in train] == [
        (r["id"], r["prompt"], r["answer"]) for r in sft
    ]
    assert all(set(r) == {"id", "prompt", "answer"} for r in sft)
    assert EVAL_COPY.read_bytes() == (DATA / "eval.jsonl").read_bytes()


def test_make_data_is_deterministic_and_seeded(tmp_path):
    make_data = _load_script("make_data")
    make_data.make_data(str(tmp_path / "a"), str(tmp_path / "a" / "copy.jsonl"))
    for name in ("train.jsonl", "eval.jsonl", "sft.jsonl"):
        assert filecmp.cmp(tmp_path / "a" / name, DATA / name, shallow=False), name
    assert filecmp.cmp(tmp_path / "a" / "copy.jsonl", EVAL_COPY, shallow=False)
    make_data.make_data(str(tmp_path / "b"), None, seed=2)
    assert (tmp_path / "b" / "eval.jsonl").read_bytes() != (DATA / "eval.jsonl").read_bytes()


def test_make_data_rejects_impossible_split(tmp_path):
    make_data = _load_script("make_data")
    with pytest.raises(ValueError, match="kind .mul. .*at most 1454"):
        make_data.make_data(str(tmp_path), None, n_train_per_kind=5000)


# ---------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def raw_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ASSETS / "tokenizer.json"))


def _probe_strings():
    rng = random.Random(0)
    strings = [r["prompt"] + r["solutions"][0] for r in _read(DATA / "eval.jsonl")[:200]]
    strings += [
        "",
        " ",
        "Compute 37+48.\\boxed{85}<|endoftext|>",
        "<|pad|><|pad|>Compute",
        "it's  the   Computer's 1234567890 boxed{x}\n\n\t end ",
        "ünïcödé 中文 🙂 e\u0301",
        "  leading and trailing  \r\n",
    ]
    alphabet = "abcxyzCBE0123456789 +-*/.{}\\\n\t'é中"
    for _ in range(300):
        strings.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))))
    return strings


def test_vocabulary_size_specials_and_single_digit_tokens(raw_tokenizer):
    vocab = raw_tokenizer.get_vocab()
    assert 260 <= len(vocab) <= 280
    assert vocab["<|endoftext|>"] == 0 and vocab["<|pad|>"] == 1
    for d in "0123456789":
        assert d in vocab
    multi_char_with_digit = [
        t for t in vocab if len(t) > 1 and any(c.isdigit() for c in t) and not t.startswith("<|")
    ]
    assert not multi_char_with_digit
    enc = raw_tokenizer.encode("Compute 37+48.")
    assert enc.tokens == ["Compute", "Ġ", "3", "7", "+", "4", "8", "."]


def test_prompt_answer_boundary_tokenizes_the_same_joined_or_apart(raw_tokenizer):
    for r in _read(DATA / "sft.jsonl"):
        apart = raw_tokenizer.encode(r["prompt"]).ids + raw_tokenizer.encode(r["answer"]).ids
        assert raw_tokenizer.encode(r["prompt"] + r["answer"]).ids == apart


@pytest.mark.parametrize("with_qwen2_config", [False, True])
def test_autotokenizer_gives_exactly_the_trained_ids(tmp_path, raw_tokenizer, with_qwen2_config):
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES:
        shutil.copy(ASSETS / name, tmp_path / name)
    if with_qwen2_config:
        # A checkpoint directory: transformers picks the tokenizer class from the model type.
        (tmp_path / "config.json").write_text(
            json.dumps(
                {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 268}
            )
        )
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_id == 0 and tok.pad_token_id == 1 and tok.bos_token_id is None
    assert len(tok) == raw_tokenizer.get_vocab_size()
    for s in _probe_strings():
        ids = raw_tokenizer.encode(s).ids
        assert tok(s)["input_ids"] == ids, s
        assert tok.decode(ids) == raw_tokenizer.decode(ids, skip_special_tokens=False), s


def test_chat_template_renders_bare_prompt_and_eos_after_answer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS))
    user = [{"role": "user", "content": "Compute 37+48."}]
    assert (
        tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        == "Compute 37+48."
    )
    convo = user + [{"role": "assistant", "content": "\\boxed{85}"}]
    text = tok.apply_chat_template(convo, tokenize=False)
    assert text == "Compute 37+48.\\boxed{85}<|endoftext|>"
    ids = tok(text)["input_ids"]
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == "Compute 37+48.\\boxed{85}"


def test_make_tokenizer_is_deterministic(tmp_path):
    make_tokenizer = _load_script("make_tokenizer")
    tok = make_tokenizer.make_tokenizer(str(DATA), str(tmp_path))
    assert tok.get_vocab_size() == 268
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(tmp_path / name, ASSETS / name, shallow=False), name


def test_make_tokenizer_names_the_missing_data(tmp_path):
    make_tokenizer = _load_script("make_tokenizer")
    with pytest.raises(FileNotFoundError, match="make_data.py"):
        make_tokenizer.make_tokenizer(str(tmp_path / "nope"), str(tmp_path))
