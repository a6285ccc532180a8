"""The PPO actor (``ppo_actor``): generate answers, recompute log-probs, train the policy.

Methods (the model worker calls them with a :class:`~realhf.api.core.model_api.Model`
whose ``module`` is a backend engine wrapping the actor's ReaLModel):

- ``generate(model, data, mb_spec)``: ``packed_prompts`` → ``group_size`` answers per prompt
  with the built-in engine over the live weights (see
  :mod:`realhf.impl.model.interface.offline_generation` for the output keys).
- ``inference(model, data, mb_spec)``: ``packed_input_ids`` → ``logprobs`` [L-1 per
  sequence], computed at the generation temperature. The MFC maps the key with
  ``output_key_remap``: ``{"logprobs": "packed_ref_logprobs"}`` on the reference model,
  ``{"logprobs": "proximal_logprobs"}`` for the trainer's recompute.
- ``train_step(model, data, mb_spec)``: rewards, GAE and advantages
  (:func:`~realhf.impl.model.interface.ppo.ppo_data.prepare_ppo_batch`, which documents the
  input keys), then ``ppo_n_minibatches`` optimizer steps (× ``sample_reuse``) over the
  shuffled sequences, each one ``TrainEngine.train_batch`` with the PPO loss. Returns the
  step's statistics (reduced over data-parallel ranks) and advances ``model.version`` by
  one step — the model worker must not increment it again.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch

import realhf.impl.model.interface.toolkit as tk
from realhf.api.core.data_api import MicroBatchSpec, SequenceSample
from realhf.api.core.model_api import Model, ModelInterface, RolloutContext
from realhf.api.core.registry import register_interface
from realhf.base import logging, stats_tracker
from realhf.impl.algorithms import ppo as F
from realhf.impl.model.interface.helpers import all_reduce_min, network_of, stable_seed
from realhf.impl.model.interface.offline_generation import generate_offline
from realhf.impl.model.interface.ppo.ppo_config import PPOHyperparameters
from realhf.impl.model.interface.ppo.ppo_data import prepare_ppo_batch
from realhf.impl.model.nn.parallel_hooks import LOCAL, LocalHooks

logger = logging.getLogger("ppo_actor")

__all__ = [
    "PPOActorInterface",
    "make_kl_controller",
    "policy_loss",
    "loss_weight_fn",
    "shifted_entropy",
    "run_minibatches",
    "INFERENCE_KEY",
]

#: The key ``PPOActorInterface.inference`` writes (remap it in the MFC).
INFERENCE_KEY = "logprobs"


def make_kl_controller(hp: PPOHyperparameters):
    """A fixed or adaptive KL controller as ``hp`` asks."""
    if hp.adaptive_kl_ctl:
        return F.AdaptiveKLController(hp.kl_ctl, hp.adaptive_kl_target, hp.adaptive_kl_horizon)
    return F.FixedKLController(hp.kl_ctl)


def run_minibatches(
    hp: PPOHyperparameters,
    model: Model,
    sample: SequenceSample,
    mb_spec: MicroBatchSpec,
    loss_fn,
    weight_fn,
    scope: str,
) -> None:
    """``sample_reuse`` passes of ``ppo_n_minibatches`` optimizer steps over ``sample``.

    Each pass shuffles the sequences (seeded by seed, global step, pass and rank) and deals
    them round-robin into the minibatches. Engine statistics go to the stats tracker
    under ``scope``. Every data-parallel rank must call it.
    """
    engine = tk.engine_of(model, train=True)
    n = len(sample)
    fewest = all_reduce_min(n, engine.dp_group)
    if fewest < hp.ppo_n_minibatches:
        # Every rank sees the same minimum, so every rank raises: no rank is left waiting.
        raise ValueError(
            f"ppo_n_minibatches={hp.ppo_n_minibatches} but a data-parallel rank holds only "
            f"{fewest} sequences (this rank: {n}); lower ppo_n_minibatches or raise the batch size"
        )
    step = model.version.global_step
    for r in range(hp.sample_reuse):
        # Seeded by step and pass: a resumed run shuffles as the uninterrupted one would.
        rng = np.random.default_rng(
            stable_seed(hp.seed, "ppo-minibatches", step, r, engine.dp_rank)
        )
        perm = rng.permutation(n)
        for k in range(hp.ppo_n_minibatches):
            stats = engine.train_batch(
                sample.select_items(perm[k :: hp.ppo_n_minibatches].tolist()),
                mb_spec,
                loss_fn,
                weight_fn,
                version_steps=step,
            )
            skipped = stats.pop("skipped")
            stats.pop("n_skipped_steps")
            with stats_tracker.scope(scope):
                stats_tracker.scalar(**stats)
                stats_tracker.scalar(reduce_type="sum", skipped_steps=skipped)


def policy_loss(
    hp: PPOHyperparameters,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    proximal_logprobs: Optional[torch.Tensor],
    group,
    *,
    short1cu_seqlens: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The PPO loss of one micro-batch, ``(loss, stats)``, as
    :func:`~realhf.impl.algorithms.ppo.actor_loss_fn` with ``hp``'s loss shape, but with the
    importance ratio averaged over the micro-batches of every data-parallel rank (``group``;
    None: this process only).

    All tensors are [T'] (shifted); ``short1cu_seqlens`` [B+1] (sequence-level ratios and
    per-sequence aggregation), ``ref_logprobs`` (``kl_loss_coef``) and ``entropy``
    (``entropy_coef``) when those options need them. Every rank runs the same number of
    micro-batches (the engine syncs the split), so the k-th calls of all ranks meet in the
    all-reduce and take the same early-stop decision. Weight the micro-batches with
    :func:`loss_weight_fn`.
    """
    terms = F.actor_loss_terms(
        logprobs,
        old_logprobs,
        advantages,
        hp.eps_clip,
        loss_mask,
        c_clip=hp.c_clip,
        proximal_logprobs=proximal_logprobs,
        behav_imp_weight_cap=hp.behav_imp_weight_cap,
        shape=hp.loss_shape,
        short1cu_seqlens=short1cu_seqlens,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
    )
    totals = tk.all_reduce_sum(terms.ratio_totals(), group)
    return F.actor_loss_from_terms(terms, totals, hp.early_stop_imp_ratio)


def loss_weight_fn(hp: PPOHyperparameters):
    """The engine's micro-batch weight for ``hp.loss_agg_mode``: the denominator of the
    micro-batch's loss without its constant (:meth:`~realhf.impl.algorithms.policy_loss.
    Aggregation.count`: valid tokens, or answers with a valid token), so that weighting by
    it gives the global batch's loss."""
    aggregation = hp.loss_shape.aggregation

    def weight(mb: SequenceSample) -> float:
        s1 = tk.short1cu_seqlens(mb.cu_seqlens("packed_input_ids"))
        return float(aggregation.count(mb.data["ppo_loss_mask"], s1))

    return weight


def shifted_entropy(
    logits: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    tp: Optional[LocalHooks] = None,
) -> torch.Tensor:
    """[T - B] float32 entropy of the next-token distribution ``softmax(logits / temperature)``
    at every position that predicts a token of its sequence (the shifted layout of
    :func:`~realhf.impl.model.utils.functional.gather_packed_shifted_log_probs`, ``tp``
    likewise: vocabulary-sharded logits are reduced over the tensor-parallel group)."""
    rows = tk.shift_one_indices(cu_seqlens)
    return (tp or LOCAL).token_entropy(logits, rows=rows, temperature=temperature)


class PPOActorInterface(ModelInterface):
    """PPO / GRPO / decoupled-PPO policy (see the module docstring).

    Args:
        hparams: a :class:`PPOHyperparameters` or a dict of its fields; or pass the fields
            as keyword arguments (``PPOActorInterface(eps_clip=0.1, group_size=4)``).
        rollout: the run's group size and temperature (the experiment passes
            ``hparams.rollout``); options that disagree with it are refused, and keyword
            options without ``group_size`` take it from here.
    """

    def __init__(
        self,
        hparams: Union[PPOHyperparameters, Dict[str, Any], None] = None,
        rollout: Optional[RolloutContext] = None,
        **fields,
    ):
        self.hp = PPOHyperparameters.coerce(hparams, fields, rollout, "ppo_actor")
        self.kl_ctl = make_kl_controller(self.hp)

    # ------------------------------------------------------------------ generate
    def generate(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """``group_size`` answers per prompt of ``packed_prompts`` (``mb_spec`` is unused:
        the engine batches continuously)."""
        hp = self.hp
        out = generate_offline(
            network_of(model),
            data,
            hp.generation,
            model.tokenizer,
            seed=hp.seed,
            version=model.version.global_step,
            max_running_requests=hp.gen_max_running_requests,
            timeout_s=hp.gen_timeout_s,
        )
        with stats_tracker.scope("gen"):
            lens = torch.tensor(out.flat_seqlens("packed_input_ids"), dtype=torch.float32)
            mask = torch.ones(len(lens), dtype=torch.bool)
            stats_tracker.denominator(n_seqs=mask)
            stats_tracker.stat(
                denominator="n_seqs", seq_len=lens, no_eos_ratio=out.data["seq_no_eos_mask"].float()
            )
        return out

    # ------------------------------------------------------------------ inference
    def inference(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> SequenceSample:
        """Log-probs of every next token (key ``logprobs``, L - 1 per sequence, float32)."""
        tk.require_keys(data, ["packed_input_ids"], "ppo_actor inference")
        return tk.sample_logprobs(model, data, mb_spec, self.hp.logprob_temperature, INFERENCE_KEY)

    # ------------------------------------------------------------------ train
    def train_step(
        self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec
    ) -> Dict[str, float]:
        """PPO update on ``data`` (see the module docstring); returns reduced statistics."""
        hp = self.hp
        engine = tk.engine_of(model, train=True)
        group = engine.dp_group
        batch = prepare_ppo_batch(hp, data, self.kl_ctl.value, group, device=engine.device)
        self.kl_ctl.update(batch.mean_kl, batch.n_seqs_global)
        temperature = hp.logprob_temperature

        def loss_fn(logits: torch.Tensor, mb: SequenceSample):
            dev = logits.device
            d = {k: v.to(dev) for k, v in mb.data.items()}
            cu = mb.cu_seqlens("packed_input_ids").to(dev)
            logp = tk.gather_packed_shifted_log_probs(
                logits, cu, d["packed_input_ids"], temperature, tp=engine.tp
            )
            entropy = None
            if hp.entropy_coef > 0:
                entropy = shifted_entropy(logits, cu, temperature, tp=engine.tp)
            # With one optimizer step per batch, the policy before the step is the one this
            # forward runs, so its own (detached) log-probs serve as pi_prox.
            prox = logp.detach() if hp.proximal_from_train_forward else d.get("proximal_logprobs")
            loss, st = policy_loss(
                hp,
                logp,
                d["old_logp"],
                d["advantages"],
                d["ppo_loss_mask"],
                prox,
                group,
                short1cu_seqlens=tk.short1cu_seqlens(cu),
                ref_logprobs=d.get("ref_logp"),
                entropy=entropy,
            )
            st.pop("n_valid_tokens")  # the engine reports n_tokens, weighted over ranks already
            return loss, st

        weight_fn = loss_weight_fn(hp)
        run_minibatches(hp, model, batch.to_sample(), mb_spec, loss_fn, weight_fn, "ppo_actor")
        model.inc_version()
        return tk.export_stats(group)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The interface's own state (the KL coefficient), for recovery checkpoints."""
        return {"kl_coef": self.kl_ctl.value}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.kl_ctl.value = float(state["kl_coef"])


register_interface("ppo_actor", PPOActorInterface)
