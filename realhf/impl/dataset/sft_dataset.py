"""Prompt/answer pairs for supervised fine-tuning.

Row: ``{"id": str, "prompt": str, "answer": str}``. Each item is the tokenized
``prompt + answer + EOS`` as ``packed_input_ids`` with ``prompt_mask`` (1 over the
prompt) so the loss covers the answer tokens only.

Rows may carry ``images`` for a vision-language model, as in
:mod:`realhf.impl.dataset.math_dataset` (placeholders in the prompt, one per image).
"""

from __future__ import annotations

from typing import Optional

import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import register_dataset
from realhf.base import logging
from realhf.impl.dataset.images import RowImages
from realhf.impl.dataset.jsonl import DatasetError, ItemDataset, read_jsonl, shard

logger = logging.getLogger("sft_dataset")


class PromptAnswerDataset(ItemDataset):
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
        rows = read_jsonl(dataset_path, {"id": (str, int), "prompt": str, "answer": str})
        if tokenizer.eos_token_id is None:
            raise DatasetError("the tokenizer has no eos_token; SFT answers must end with one")
        rows = shard(rows, dp_rank, world_size)
        if max_items is not None:
            rows = rows[:max_items]
        # Prompt and answer are tokenized apart (to know where the answer starts) and taken
        # verbatim: special tokens would put a BOS in front of the answer too.
        prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
        answers = tokenizer([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
        self.items: list[SequenceSample] = []
        if RowImages.needed(rows):
            self.row_images = RowImages(dataset_path, tokenizer)
        seen = set()
        dropped = 0
        for row, p, a in zip(rows, prompts, answers):
            rid = str(row["id"])
            if rid in seen:
                raise DatasetError(f"{dataset_path}: id {rid!r} appears more than once")
            seen.add(rid)
            if self.row_images is not None:
                where = f"{dataset_path} (id {rid})"
                p = self.row_images.expand(len(self.items), row, p, where)
            # EOS is part of the answer: the model learns to stop. An empty prompt leaves no
            # position to predict the first answer token from.
            toks = p + a + [tokenizer.eos_token_id]
            if len(toks) > max_length or not p:
                dropped += 1
                continue
            self.items.append(
                SequenceSample.from_default(
                    ids=[rid],
                    seqlens=[len(toks)],
                    data={
                        "packed_input_ids": torch.tensor(toks, dtype=torch.long),
                        "prompt_mask": torch.tensor(
                            [1] * len(p) + [0] * (len(a) + 1), dtype=torch.bool
                        ),
                    },
                )
            )
        self._finish(
            dataset_path,
            dropped,
            f"rows longer than {max_length} tokens (or empty prompts)",
            dp_rank,
            world_size,
            logger,
        )


register_dataset("prompt_answer", PromptAnswerDataset)
