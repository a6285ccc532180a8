"""The ``null`` interface: runs through the whole system without touching weights.

Every method reads its inputs, and ``train_step`` reports token counts; nothing is
computed with the model. `quickstart null` uses it to exercise the master, the model
workers, data transfer and the run outputs at the speed of the plumbing alone.
"""

from __future__ import annotations

from typing import Dict

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.impl.model.interface.helpers import require_keys


class NullInterface(ModelInterface):
    """See the module docstring."""

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        require_keys(data, ["packed_input_ids"], "null train_step")
        n_tokens = float(data.data["packed_input_ids"].numel())
        model.inc_version()
        return {
            "null/n_seqs": float(len(data.flat_seqlens("packed_input_ids"))),
            "null/n_tokens": n_tokens,
        }

    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        require_keys(data, ["packed_input_ids"], "null inference")
        lens = [[1] * len(item) for item in data.seqlens["packed_input_ids"]]
        n = sum(len(x) for x in lens)
        return SequenceSample(
            keys={"rewards"},
            trailing_shapes={"rewards": ()},
            dtypes={"rewards": torch.float32},
            ids=list(data.ids),
            seqlens={"rewards": lens},
            data={"rewards": torch.zeros(n)},
        )


register_interface("null", NullInterface)
