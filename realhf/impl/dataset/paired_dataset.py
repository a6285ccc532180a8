"""Preference pairs for reward-model training and DPO.

Row: ``{"id": str, "prompt": str, "chosen": str, "rejected": str}`` (``id`` may be an int).
Each item is one `SequenceSample` holding two sequences, ``prompt + chosen + EOS`` first and
``prompt + rejected + EOS`` second, as ``packed_input_ids`` with ``prompt_mask`` (True on
the prompt tokens). Interfaces rely on that order: sequence 2i is a chosen answer and
2i + 1 its rejected partner, in every (micro-)batch, because items are never cut.

A malformed row stops loading with a `DatasetError` naming the file and line (bad JSON, a
missing or mistyped field, an empty prompt or answer, ``chosen == rejected``, a repeated
id). Pairs longer than ``max_length`` tokens (either sequence) are dropped with a count.
"""

from __future__ import annotations

from typing import Optional

import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import register_dataset
from realhf.base import logging
from realhf.impl.dataset.jsonl import DatasetError, ItemDataset, read_jsonl, shard

logger = logging.getLogger("paired_dataset")

FIELDS = {"id": (str, int), "prompt": str, "chosen": str, "rejected": str}


def check_pair_rows(path: str, rows: list) -> None:
    """Fail on the first row that cannot be a preference pair (file:line in the message).

    `read_jsonl` has checked fields and types; this checks what a pair means."""
    seen = set()
    for lineno, row in enumerate(rows, start=1):
        where = f"{path}: row {lineno} (id {row['id']!r})"
        for key in ("prompt", "chosen", "rejected"):
            if not row[key].strip():
                raise DatasetError(f"{where}: field '{key}' is empty")
        if row["chosen"] == row["rejected"]:
            raise DatasetError(
                f"{where}: 'chosen' and 'rejected' are the same text; a pair must differ"
            )
        rid = str(row["id"])
        if rid in seen:
            raise DatasetError(f"{path}: id {rid!r} appears more than once (row {lineno})")
        seen.add(rid)


class PairedDataset(ItemDataset):
    """See the module docstring."""

    def __init__(
        self,
        dataset_path: str,
        tokenizer,
        seed: int = 1,
        dp_rank: int = 0,
        world_size: int = 1,
        max_length: int = 1024,
        max_items: Optional[int] = None,
    ):
        del seed  # the model worker owns the epoch order
        rows = read_jsonl(dataset_path, FIELDS)
        check_pair_rows(dataset_path, rows)
        if tokenizer.eos_token_id is None:
            raise DatasetError("the tokenizer has no eos_token; answers must end with one")
        rows = shard(rows, dp_rank, world_size)
        if max_items is not None:
            rows = rows[:max_items]

        def encode(key):  # verbatim, as PromptAnswerDataset: no BOS before the answers
            return tokenizer([r[key] for r in rows], add_special_tokens=False)["input_ids"]

        eos = tokenizer.eos_token_id
        self.items: list[SequenceSample] = []
        dropped = 0
        for row, p, c, r in zip(rows, encode("prompt"), encode("chosen"), encode("rejected")):
            seqs = [p + c + [eos], p + r + [eos]]
            if max(len(s) for s in seqs) > max_length:
                dropped += 1
                continue
            masks = [[1] * len(p) + [0] * (len(s) - len(p)) for s in seqs]
            self.items.append(
                SequenceSample.from_default(
                    ids=[str(row["id"])],
                    seqlens=[[len(s) for s in seqs]],
                    data={
                        "packed_input_ids": torch.tensor(seqs[0] + seqs[1], dtype=torch.long),
                        "prompt_mask": torch.tensor(masks[0] + masks[1], dtype=torch.bool),
                    },
                )
            )
        self._finish(
            dataset_path,
            dropped,
            f"pairs longer than {max_length} tokens",
            dp_rank,
            world_size,
            logger,
        )


register_dataset("paired", PairedDataset)
