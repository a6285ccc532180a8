"""REINFORCE with a moving-average baseline: an algorithm of your own, plugged into ppo-math.

From the repository root (README, "Writing an algorithm")::

    python -m realhf.apps.quickstart ppo-math \\
        --import examples.custom_algorithm.reinforce_baseline \\
        actor.train_interface=reinforce_baseline actor.train_interface_args.decay=0.9

ppo-math still generates the answers (``actor_gen``) and grades them (``rew_inf``); this
module replaces ``actor_train``.  For answer i with reward r_i and the baseline b (an
exponential moving average of the batch's mean reward, kept across steps and saved with
the recover checkpoints), the loss is the mean over every answer token t of the batch of

    -(r_i - b) * log pi(token t | tokens before it)
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, RolloutContext
from realhf.api.core.registry import register_interface
from realhf.impl.model.interface import toolkit as tk

#: the keys train_step reads (ppo-math's actor_train also sends packed_logprobs and
#: seq_no_eos_mask, which this algorithm does not need)
KEYS = ("packed_input_ids", "prompt_mask", "rewards")


class ReinforceBaseline(ModelInterface):
    """REINFORCE; the baseline is a moving average of the batch mean reward.

    Args:
        decay: weight of the old baseline in each update, in [0, 1) (0: the batch's mean).
        rollout: the run's group size and sampling temperature (the experiment passes it;
            None, as in a unit test: temperature 1 and any group size).
    """

    def __init__(self, decay: float = 0.9, rollout: Optional[RolloutContext] = None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay!r}: use a value in [0, 1)")
        self.decay, self.rollout = decay, rollout
        self.temperature = 1.0 if rollout is None else rollout.temperature
        self.baseline: Optional[float] = None  # set by the first batch

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        tk.require_keys(data, KEYS, "reinforce_baseline")
        if self.rollout is not None:  # one item per prompt, holding group_size answers
            self.rollout.check_groups(data, "reinforce_baseline")
        engine = tk.engine_of(model, train=True)
        rewards = data.data["rewards"].float()  # one per answer; NaN: the verifier had no verdict
        # A collective: every data-parallel rank gets the mean of the global batch.
        batch_mean = tk.global_mean(rewards, engine.dp_group, mask=~rewards.isnan())
        baseline = batch_mean if self.baseline is None else self.baseline

        def loss_fn(logits: torch.Tensor, mb: SequenceSample):
            dev = logits.device
            cu = mb.cu_seqlens("packed_input_ids").to(dev)
            ids = mb.data["packed_input_ids"].to(dev)
            logp = tk.gather_packed_shifted_log_probs(
                logits, cu, ids, self.temperature, tp=engine.tp
            )
            adv = (mb.data["rewards"].to(dev).float() - baseline).nan_to_num(0.0)
            adv = tk.per_token(adv, tk.short1cu_seqlens(cu))  # [B] -> [T - B]
            mask = tk.answer_mask(mb.data["prompt_mask"].to(dev), cu)
            # A mean over this micro-batch's answer tokens; weighting micro-batches by
            # their answer tokens (answer_token_count) makes it the global batch's mean.
            loss = tk.masked_mean(-adv * logp, mask)
            return loss, {"advantage": tk.masked_mean(adv, mask).detach()}

        stats = engine.train_batch(
            data.select(KEYS),
            mb_spec,
            loss_fn,
            tk.answer_token_count,
            version_steps=model.version.global_step,  # the learning-rate schedule's step
        )
        self.baseline = self.decay * baseline + (1.0 - self.decay) * batch_mean
        model.inc_version()  # one training step done: the model worker does not do it
        stats.update(reward=batch_mean, baseline=baseline)
        return {f"reinforce/{k}": float(v) for k, v in stats.items()}

    # Saved with the recover checkpoints, so that a resumed run keeps its baseline.
    def state_dict(self) -> Dict[str, Any]:
        return {"baseline": self.baseline}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.baseline = state["baseline"]


register_interface("reinforce_baseline", ReinforceBaseline)
