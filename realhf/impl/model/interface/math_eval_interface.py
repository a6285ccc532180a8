"""Greedy accuracy on held-out math prompts, for evaluation during training.

``evaluate(model, data, mb_spec)`` takes this rank's shard of the eval set (key
``packed_prompts``, metadata ``solutions``), answers every prompt greedily with the
built-in engine over the live model, grades the answers with the math verifier and
returns ``{"eval/greedy_acc", "eval/mean_len"}`` as means over the local items (the
model worker averages the ranks weighted by items).
"""

from __future__ import annotations

from typing import Dict

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import GenerationHyperparameters, Model, ModelInterface
from realhf.api.core.registry import register_interface
from realhf.impl.model.interface.helpers import network_of, require_keys
from realhf.impl.model.interface.math_reward_interface import decode_answers
from realhf.impl.model.interface.offline_generation import generate_offline
from realhf.impl.reward.math_reward import verify_batch


class MathEvalInterface(ModelInterface):
    """See the module docstring.

    Args:
        max_new_tokens: most tokens per greedy answer.
        timeout_s: per-answer verifier timeout.
    """

    def __init__(self, max_new_tokens: int = 32, timeout_s: float = 15.0):
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"math_eval max_new_tokens={max_new_tokens!r}: use an integer >= 1")
        self.gconfig = GenerationHyperparameters(n=1, max_new_tokens=max_new_tokens, greedy=True)
        self.timeout_s = float(timeout_s)

    def evaluate(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        require_keys(data, ["packed_prompts"], "math_eval")
        if "solutions" not in data.metadata:
            raise KeyError(
                "math_eval needs the eval set's reference answers as item metadata 'solutions'"
            )
        out = generate_offline(network_of(model), data, self.gconfig, model.tokenizer)
        texts = decode_answers(out, model.tokenizer)
        correct = verify_batch(
            texts, [list(s) for s in data.metadata["solutions"]], timeout=self.timeout_s
        )
        # one greedy answer per prompt, in item order
        answer_lens = [
            L - p
            for L, p in zip(
                out.flat_seqlens("packed_input_ids"), data.flat_seqlens("packed_prompts")
            )
        ]
        return {
            "eval/greedy_acc": sum(correct) / len(correct),
            "eval/mean_len": sum(answer_lens) / len(answer_lens),
        }


register_interface("math_eval", MathEvalInterface)
