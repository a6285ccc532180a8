"""Trajectories of conversations: the one-item ``SequenceSample`` every math agent emits.

A member's sequence is its whole conversation (:class:`Conversation`): the prompt, then its
answers and whatever the environment put between them (feedback, tool output).  Keys (per
sequence j of length ``L_j``): ``packed_input_ids`` [L_j] int64, ``prompt_mask`` [L_j] bool
(True on every token the model did not generate: the prompt and what the environment
added), ``packed_logprobs`` [L_j − 1] float32 (shifted: entry t is the server's logprob of
token t+1, 0 where token t+1 was not generated), ``seq_no_eos_mask`` [1] bool (the last
answer hit the token budget), ``version_start`` / ``version_end`` [1] int64 (the version
of the first answer's first chunk and of the last answer's last chunk), ``rewards`` [1]
float32; and ``packed_prompts`` [prompt_len] once per item.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from realhf.api.core.data_api import IMAGE_KEYS, SequenceSample

__all__ = ["Conversation", "build_conversation_trajectory"]


class Conversation:
    """One member's conversation: its tokens, which of them the model generated, their
    logprobs, and the versions / verdicts of its turns."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.ids: List[int] = list(prompt_ids)
        self.generated: List[bool] = [False] * len(self.ids)
        self.logprobs: List[float] = [0.0] * len(self.ids)
        self.verdicts: List[float] = []
        self.versions: List[int] = []
        self.no_eos = False

    def answer(self, ids, logprobs, version_start: int, version_end: int, no_eos: bool):
        self.ids += list(ids)
        self.generated += [True] * len(ids)
        self.logprobs += list(logprobs)
        self.versions += [version_start, version_end]
        self.no_eos = no_eos

    def feedback(self, ids: Sequence[int]):
        self.ids += list(ids)
        self.generated += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def solved_at(self) -> Optional[int]:
        """The turn (1-based) whose answer was right, or None."""
        return next((k + 1 for k, v in enumerate(self.verdicts) if v > 0), None)


def build_conversation_trajectory(
    prompt: SequenceSample,
    qid: str,
    convs: List[Conversation],
    rewards: Sequence[float],
    extra_metadata: Optional[dict] = None,
    turns: bool = True,
) -> SequenceSample:
    """Pack a group's conversations into a one-item SequenceSample (the module docstring
    lists its keys).  Metadata: the prompt's, ``extra_metadata``, and with ``turns`` the
    per-turn verdicts (``turn_verdicts``: one list per member) and ``n_turns``."""
    if len(rewards) != len(convs):
        raise ValueError(f"trajectory {qid!r}: {len(rewards)} rewards for {len(convs)} answers")
    lens = [len(c.ids) for c in convs]
    one = [[1] * len(convs)]
    data = {
        "packed_input_ids": torch.tensor([t for c in convs for t in c.ids], dtype=torch.long),
        "prompt_mask": torch.tensor([not g for c in convs for g in c.generated]),
        # shifted: entry t is the logprob of token t+1
        "packed_logprobs": torch.tensor(
            [x for c in convs for x in c.logprobs[1:]], dtype=torch.float32
        ),
        "seq_no_eos_mask": torch.tensor([c.no_eos for c in convs], dtype=torch.bool),
        "version_start": torch.tensor([c.versions[0] for c in convs], dtype=torch.long),
        "version_end": torch.tensor([c.versions[-1] for c in convs], dtype=torch.long),
        "rewards": torch.tensor(list(rewards), dtype=torch.float32),
        "packed_prompts": prompt.data["packed_prompts"].clone(),
    }
    seqlens = {
        "packed_input_ids": [lens],
        "prompt_mask": [lens],
        "packed_logprobs": [[n - 1 for n in lens]],
        "seq_no_eos_mask": one,
        "version_start": one,
        "version_end": one,
        "rewards": one,
        "packed_prompts": [[len(prompt.data["packed_prompts"])]],
    }
    # (image_data: the prompt's images as data URLs, for the generation servers only)
    metadata = {k: list(v) for k, v in prompt.metadata.items() if k != "image_data"}
    for k, v in (extra_metadata or {}).items():
        metadata[k] = [v]
    if turns:
        metadata["turn_verdicts"] = [[list(c.verdicts) for c in convs]]
        metadata["n_turns"] = [[len(c.verdicts) for c in convs]]
    out = SequenceSample(
        keys=set(data),
        trailing_shapes={k: () for k in data},
        dtypes={k: v.dtype for k, v in data.items()},
        ids=[qid],
        seqlens=seqlens,
        data=data,
        metadata=metadata,
    )
    if prompt.data is not None and all(k in prompt.keys for k in IMAGE_KEYS):
        # The prompt's images travel with the trajectory: training reads them again.
        images = prompt.select(IMAGE_KEYS)
        images.ids, images.metadata = [qid], {}
        out.update_(images)
    return out
