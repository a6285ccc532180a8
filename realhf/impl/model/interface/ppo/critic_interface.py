"""The PPO critic (``ppo_critic``): value inference and the clipped value loss.

- ``inference(model, data, mb_spec)``: ``packed_input_ids`` → ``values`` (L per sequence,
  float32), denormalised when ``value_norm`` is on, so the actor's GAE sees raw values.
- ``train_step(model, data, mb_spec)``: the same rewards and GAE returns as the actor
  (:func:`~realhf.impl.model.interface.ppo.ppo_data.prepare_ppo_batch`; the input keys include
  ``values`` from this critic's inference), then ``ppo_n_minibatches`` optimizer steps on
  ``mean_valid max(½(V − R)², ½(V_old + clip(V − V_old, ±value_eps_clip) − R)²)``. With
  ``value_norm`` the critic learns returns normalised by an EMA of their mean/std
  (updated over all data-parallel ranks before the loss). Advances ``model.version``.

The model is a ReaLModel built with ``is_critic=True`` (one value per token).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch

from realhf.api.core.data_api import MicroBatchSpec, SequenceSample, keys_with_images
from realhf.api.core.model_api import Model, ModelInterface, RolloutContext
from realhf.api.core.registry import register_interface
from realhf.impl.algorithms import ppo as F
from realhf.impl.model.interface.helpers import (
    all_reduce_sum,
    engine_of,
    export_stats,
    require_keys,
)
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.ppo.ppo_data import prepare_ppo_batch
from realhf.impl.model.interface.ppo.ppo_interface import make_kl_controller, run_minibatches
from realhf.impl.model.utils.functional import masked_mean, masked_moments, shift_one_indices

__all__ = ["PPOCriticInterface"]


def _loss_weight(mb: SequenceSample) -> int:
    return int(mb.data["ppo_loss_mask"].count_nonzero())


class PPOCriticInterface(ModelInterface):
    """PPO value function (see the module docstring).

    Args:
        hparams: a :class:`PPOHyperparameters` or a dict of its fields; or the fields as
            keyword arguments. Use the actor's settings so both compute the same returns.
        rollout: the run's group size and temperature, as for ``ppo_actor``.
    """

    def __init__(
        self,
        hparams: Union[PPOHyperparameters, Dict[str, Any], None] = None,
        rollout: Optional[RolloutContext] = None,
        **fields,
    ):
        self.hp = PPOHyperparameters.coerce(hparams, fields, rollout, "ppo_critic")
        if self.hp.disable_value:
            raise ValueError(
                "ppo_critic was built with disable_value=True; with no value function drop the "
                "critic's MFCs"
            )
        # The critic recomputes the actor's rewards (prepare_ppo_batch needs the KL coefficient),
        # so it runs its own copy of the controller; with the same settings and the same
        # global KL it follows the actor's exactly.
        self.kl_ctl = make_kl_controller(self.hp)
        self.rms = (
            F.ExponentialRunningMeanStd(beta=self.hp.value_norm_beta)
            if self.hp.value_norm
            else None
        )

    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """Values of every token (key ``values``)."""
        require_keys(data, ["packed_input_ids"], "ppo_critic inference")
        engine = engine_of(model)
        values = engine.forward(
            data.select(keys_with_images(data, ["packed_input_ids"])), mb_spec
        ).float()
        if values.dim() != 1:
            raise ValueError(
                f"ppo_critic got outputs of shape {tuple(values.shape)}; the critic must be a "
                "ReaLModel with is_critic=True (one value per token)"
            )
        if self.rms is not None:
            values = self.rms.to(values.device).denormalize(values)
        values = values.cpu()
        lens = [list(item) for item in data.seqlens["packed_input_ids"]]
        return SequenceSample(
            keys={"values"},
            trailing_shapes={"values": ()},
            dtypes={"values": torch.float32},
            ids=list(data.ids),
            seqlens={"values": lens},
            data={"values": values},
        )

    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """One PPO critic update; returns reduced statistics."""
        hp = self.hp
        engine = engine_of(model, train=True)
        group = engine.dp_group
        batch = prepare_ppo_batch(
            hp, data, self.kl_ctl.value, group, record_stats=False, device=engine.device
        )
        self.kl_ctl.update(batch.mean_kl, batch.n_seqs_global)
        old_values, returns = batch.values, batch.returns
        if self.rms is not None:
            self.rms.to(engine.device)  # nccl reduces its statistics on the GPU
            # Old values were denormalised with the current statistics: undo that first.
            old_values = self.rms.normalize(old_values)
            # Every replica must fold in the same (global) moments to keep identical statistics.
            moments = all_reduce_sum(masked_moments(returns, batch.loss_mask), group)
            self.rms.update_from_moments(moments)
            returns = self.rms.normalize(returns)

        def loss_fn(values: torch.Tensor, mb: SequenceSample):
            dev = values.device
            # Values are per token [T]; returns and the mask are shifted [T']. Entry t of a
            # sequence is the value of the state before token t+1, i.e. position t.
            shift = shift_one_indices(mb.cu_seqlens("packed_input_ids").to(dev))
            mask = mb.data["ppo_loss_mask"].to(dev)
            new_v = values.float()[shift]
            old_v = mb.data["values"].to(dev)[shift]
            loss, st = F.critic_loss_fn(
                new_v, old_v, mb.data["returns"].to(dev), hp.value_eps_clip, mask
            )
            return loss, {
                "value_clip_ratio": st["clip_ratio"],
                "value_mean": masked_mean(new_v.detach(), mask),
            }

        sample = batch.to_sample(values=old_values, returns=returns)
        run_minibatches(hp, model, sample, mb_spec, loss_fn, _loss_weight, "ppo_critic")
        model.inc_version()
        return export_stats(group)

    def state_dict(self) -> Dict[str, Any]:
        """KL coefficient and value-normaliser statistics, for recovery checkpoints."""
        return {
            "kl_coef": self.kl_ctl.value,
            "rms": (
                None
                if self.rms is None
                else {k: v.clone() for k, v in self.rms.state_dict().items()}
            ),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.kl_ctl.value = float(state["kl_coef"])
        if self.rms is not None and state.get("rms") is not None:
            self.rms.load_state_dict(state["rms"])


register_interface("ppo_critic", PPOCriticInterface)
