"""paired: {id, prompt, chosen, rejected} rows → items of two sequences, chosen first."""

import json
import pathlib

import pytest
from transformers import AutoTokenizer

from realhf.api.core.registry import make_dataset
from realhf.impl.dataset.jsonl import DatasetError
from realhf.impl.dataset.paired_dataset import PairedDataset

ASSETS = pathlib.Path(__file__).resolve().parents[3] / "realhf" / "assets" / "tiny"
ROW = {"id": "add-1-2", "prompt": "Compute 1+2.", "chosen": "\\boxed{3}", "rejected": "\\boxed{4}"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSETS)


def _write(tmp_path, rows):
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_item_holds_chosen_then_rejected_with_prompt_masks(tok, tmp_path):
    ds = PairedDataset(_write(tmp_path, [ROW]), tok)
    (item,) = ds.items
    assert item.ids == ["add-1-2"]
    lc, lr = item.seqlens["packed_input_ids"][0]
    ids = item.data["packed_input_ids"].tolist()
    p = tok(ROW["prompt"], add_special_tokens=False).input_ids
    assert ids[:lc] == p + tok(ROW["chosen"], add_special_tokens=False).input_ids + [0]
    assert ids[lc:] == p + tok(ROW["rejected"], add_special_tokens=False).input_ids + [0]
    mask = item.data["prompt_mask"].tolist()
    assert mask[:lc] == [True] * len(p) + [False] * (lc - len(p))
    assert mask[lc:] == [True] * len(p) + [False] * (lr - len(p))


@pytest.mark.slow
def test_embedded_pairs_load_and_are_registered(tok):
    for split, n in (("pairs_train", 2000), ("pairs_eval", 500), ("pairs_rw_train", 15620)):
        path = str(ASSETS / "data" / f"{split}.jsonl")
        ds = make_dataset("paired", dataset_path=path, tokenizer=tok)
        assert len(ds) == n
    rows = lambda s: [json.loads(l) for l in open(ASSETS / "data" / f"{s}.jsonl")]  # noqa: E731
    # held-out pairs share no problem with the training pairs
    prompts = lambda s: {r["prompt"] for r in rows(s)}  # noqa: E731
    assert not prompts("pairs_train") & prompts("pairs_eval")
    assert not prompts("pairs_rw_train") & prompts("pairs_eval")
    # the rw split: distinct wrong answers of every train problem, each beside the right one
    rw = rows("pairs_rw_train")
    assert len({r["id"] for r in rw}) == len(rw) == len({(r["prompt"], r["rejected"]) for r in rw})
    assert all(r["chosen"] != r["rejected"] for r in rw)
    assert len(prompts("pairs_rw_train")) > 4000


@pytest.mark.parametrize(
    "row, message",
    [
        ("{oops", "pairs.jsonl:2: invalid JSON"),
        (
            {k: v for k, v in ROW.items() if k != "rejected"},
            "pairs.jsonl:2: missing field 'rejected'",
        ),
        ({**ROW, "chosen": 3}, "pairs.jsonl:2: field 'chosen' must be str, got int"),
        (
            {**ROW, "id": "b", "rejected": "\\boxed{3}"},
            "row 2 (id 'b'): 'chosen' and 'rejected' are",
        ),
        ({**ROW, "id": "b", "prompt": " "}, "row 2 (id 'b'): field 'prompt' is empty"),
        (ROW, "id 'add-1-2' appears more than once (row 2)"),
    ],
)
def test_malformed_rows_fail_naming_file_and_row(tok, tmp_path, row, message):
    with pytest.raises(DatasetError) as e:
        PairedDataset(_write(tmp_path, [ROW, row]), tok)
    assert message in str(e.value)


def test_long_pairs_are_dropped_and_an_empty_result_fails(tok, tmp_path):
    long = {**ROW, "id": "long", "rejected": "\\boxed{" + "1" * 50 + "}"}
    ds = PairedDataset(_write(tmp_path, [ROW, long]), tok, max_length=20)
    assert [x.ids[0] for x in ds.items] == ["add-1-2"]
    with pytest.raises(DatasetError, match="no usable rows"):
        PairedDataset(_write(tmp_path, [long]), tok, max_length=20)
