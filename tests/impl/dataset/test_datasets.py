import json
import pathlib

import pytest
from transformers import AutoTokenizer

from realhf.api.core.registry import make_dataset
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.math_dataset import MathPromptDataset
from realhf.impl.dataset.sft_dataset import PromptAnswerDataset

ASSETS = pathlib.Path(__file__).resolve().parents[3] / "realhf" / "assets" / "tiny"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS)


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_math_prompts_shard_disjointly(tok):
    path = str(ASSETS / "data" / "train.jsonl")
    a = MathPromptDataset(path, tok, dp_rank=0, world_size=2)
    b = MathPromptDataset(path, tok, dp_rank=1, world_size=2)
    ids_a = {x.ids[0] for x in a.items}
    ids_b = {x.ids[0] for x in b.items}
    assert not ids_a & ids_b and len(ids_a) + len(ids_b) == 4200
    item = a[0]
    assert item.keys == {"packed_prompts"}
    assert tok.decode(item.data["packed_prompts"]).startswith("Compute")
    assert item.metadata["solutions"][0][0].startswith("\\boxed{")


def test_registered_by_name(tok):
    d = make_dataset("math_prompt", dataset_path=str(ASSETS / "data" / "eval.jsonl"), tokenizer=tok)
    assert len(d) == 500


def test_sft_prompt_mask_covers_prompt_only(tok):
    d = PromptAnswerDataset(str(ASSETS / "data" / "sft.jsonl"), tok, max_items=3)
    x = d[0]
    ids, mask = x.data["packed_input_ids"], x.data["prompt_mask"]
    n_prompt = int(mask.sum())
    assert tok.decode(ids[n_prompt:-1]).startswith("\\boxed{")
    assert int(ids[-1]) == tok.eos_token_id and not mask[-1]


@pytest.mark.parametrize(
    "rows, needle",
    [
        (
            [{"query_id": "a", "task": "math", "solutions": ["1"]}],
            r"d.jsonl:1: missing field 'prompt'",
        ),
        (
            [{"query_id": "a", "prompt": "x", "solutions": ["1"]}, "{not json"],
            r"d.jsonl:2: invalid JSON",
        ),
        ([{"query_id": "a", "prompt": 5, "solutions": ["1"]}], r"field 'prompt' must be str"),
        ([{"query_id": "a", "prompt": "x"}], r"needs a non-empty 'solutions'"),
        (
            [{"query_id": "a", "prompt": "x", "solutions": ["1"]}] * 2,
            r"query_id 'a' appears more than once",
        ),
        ([], r"has no rows"),
    ],
)
def test_malformed_math_rows(tmp_path, tok, rows, needle):
    with pytest.raises(DatasetError, match=needle):
        MathPromptDataset(_write(tmp_path, rows), tok)


def test_missing_file_is_named(tok):
    with pytest.raises(DatasetError, match="'/no/such.jsonl' does not exist"):
        PromptAnswerDataset("/no/such.jsonl", tok)


def test_malformed_sft_row(tmp_path, tok):
    with pytest.raises(DatasetError, match=r"d.jsonl:1: missing field 'answer'"):
        PromptAnswerDataset(_write(tmp_path, [{"id": "1", "prompt": "p"}]), tok)
