"""Prompts of math (and code) problems for RL, from AReaL's JSONL format.

Row: ``{"query_id": str, "prompt": str, "task": "math", "solutions": ["\\boxed{42}", ...]}``
(code rows carry ``input_output`` instead of ``solutions``). Each item is one
`SequenceSample` with key ``packed_prompts`` (the tokenized prompt) and metadata
``query_id``, ``task``, ``solutions`` / ``input_output`` for the reward.
Prompts longer than ``max_prompt_len`` tokens are dropped, with a count in the log.

Rows may carry ``images`` (paths relative to the file, or data URLs) for a
vision-language model: the prompt then holds one image placeholder per image (what the
model's chat template writes, e.g. ``<|vision_start|><|image_pad|><|vision_end|>``),
expanded to the image's token count, and each item gains the image keys
(:mod:`realhf.impl.dataset.images`).  A missing, unreadable or oversized image fails the
load naming its row.
"""

from __future__ import annotations

from typing import Optional

import torch

from realhf.api.core.data_api import SequenceSample
from realhf.api.core.registry import register_dataset
from realhf.base import logging
from realhf.impl.dataset.images import RowImages
from realhf.impl.dataset.jsonl import DatasetError, ItemDataset, read_jsonl, shard

logger = logging.getLogger("math_dataset")

TASKS = ("math", "code", "stem")


class MathPromptDataset(ItemDataset):
    """One prompt per item; see the module docstring for the format."""

    def __init__(
        self,
        dataset_path: str,
        tokenizer,
        seed: int = 1,
        dp_rank: int = 0,
        world_size: int = 1,
        max_prompt_len: int = 1024,
        max_items: Optional[int] = None,
    ):
        del seed  # the model worker owns the epoch order
        rows = read_jsonl(dataset_path, {"query_id": (str, int), "prompt": str})
        for i, row in enumerate(rows):
            task = row.get("task", "math")
            if task not in TASKS:
                raise DatasetError(
                    f"{dataset_path}: row {i + 1} has task {task!r}; use one of {TASKS}"
                )
            if task in ("math", "stem") and not (
                isinstance(row.get("solutions"), list) and row["solutions"]
            ):
                raise DatasetError(
                    f"{dataset_path}: row {i + 1} ({row['query_id']}) needs a non-empty "
                    "'solutions' list"
                )
            if task == "code" and not isinstance(row.get("input_output"), str):
                raise DatasetError(
                    f"{dataset_path}: row {i + 1} ({row['query_id']}) needs 'input_output' (a JSON "
                    "string)"
                )
        # Unique over the whole file, before sharding: the system addresses items by id
        # across all ranks (the master's buffer, recovery state).
        ids = [str(r["query_id"]) for r in rows]
        if len(set(ids)) != len(ids):
            dup = next(x for x in ids if ids.count(x) > 1)
            raise DatasetError(f"{dataset_path}: query_id {dup!r} appears more than once")
        rows = shard(rows, dp_rank, world_size)
        if max_items is not None:
            rows = rows[:max_items]
        # Verbatim, nothing added: a prompt is the exact token prefix the policy continues
        # (any chat template is part of the dataset's prompt text).
        encoded = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
        self.items: list[SequenceSample] = []
        if RowImages.needed(rows):
            self.row_images = RowImages(dataset_path, tokenizer)
        dropped = 0
        for row, toks in zip(rows, encoded):
            if self.row_images is not None:
                where = f"{dataset_path} (query_id {row['query_id']})"
                toks = self.row_images.expand(len(self.items), row, toks, where)
            if len(toks) > max_prompt_len or not toks:
                dropped += 1
                continue
            meta = {"query_id": [str(row["query_id"])], "task": [row.get("task", "math")]}
            meta["solutions"] = [row.get("solutions", [])]
            meta["input_output"] = [row.get("input_output")]
            self.items.append(
                SequenceSample.from_default(
                    ids=[str(row["query_id"])],
                    seqlens=[len(toks)],
                    data={"packed_prompts": torch.tensor(toks, dtype=torch.long)},
                    metadata=meta,
                )
            )
        self._finish(
            dataset_path,
            dropped,
            f"prompts longer than {max_prompt_len} tokens (or empty)",
            dp_rank,
            world_size,
            logger,
        )


register_dataset("math_prompt", MathPromptDataset)
