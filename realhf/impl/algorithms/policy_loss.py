"""The PPO-family policy loss of one micro-batch, as local sums (no collective).

Shapes as in :mod:`realhf.impl.algorithms.ppo`: every tensor is shifted, [T'] =
``sum(L_i - 1)`` entries, sequence i at ``short1cu_seqlens[i]:short1cu_seqlens[i+1]``.

Per valid token t of answer i (π the policy being trained, π_prox the anchor of the clip —
the behaviour policy μ in classic PPO, the recomputed proximal policy in decoupled PPO)::

    ρ_t   = π(t) / π_prox(t)                       importance_level="token"
    ρ_t   = s_i = exp(mean_{t' in i} log ρ_t')     importance_level="sequence" (GSPO); the
                                                   advantage is then A_i = mean_{t in i} A_t
    pg_t  = max(-A ρ, -A clip(ρ, 1 - eps_clip, 1 + eps_clip_high))   (then dual clip)
    pg_t *= w_t = π_prox(t) / μ(t)                 decoupled loss only; ``mask`` drops tokens
                                                   with w outside [floor, cap], ``truncate``
                                                   uses min(w, cap) (TIS)
    l_t   = pg_t + kl_loss_coef · k(π, π_ref) - entropy_coef · H_t

and the micro-batch's loss aggregates ``l`` by ``loss_agg_mode``, one
:class:`Aggregation` of :data:`AGGREGATIONS`. Each mode is a ratio ``loss_sum / denom``
whose denominator is additive over micro-batches and ranks — valid tokens for
``token-mean``, valid sequences (times the constant) for the others — so the train engine,
weighting each micro-batch's loss by that count (:meth:`Aggregation.count`), reproduces the
loss of the whole global batch. The two importance levels are the two entries of
:data:`IMPORTANCE_RATIOS`.

To add a loss aggregation: a member of :class:`LossAggMode` and its :class:`Aggregation`
entry in :data:`AGGREGATIONS`, here, and a case in ``tests/impl/algorithms/
test_policy_loss.py`` (every mode there is checked exact over micro-batches). The config,
its ``--help`` and the engine's micro-batch weight pick it up from the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from realhf.impl.algorithms.choices import Choice
from realhf.impl.model.utils.functional import masked_mean

__all__ = [
    "LossAggMode",
    "Aggregation",
    "AGGREGATIONS",
    "ImportanceLevel",
    "ImportanceRatio",
    "IMPORTANCE_RATIOS",
    "BehavWeightMode",
    "KLEstimator",
    "LossShape",
    "PolicyLossTerms",
    "clipped_surrogate",
    "behaviour_weight",
    "kl_penalty",
    "sequence_index",
    "actor_loss_terms",
    "actor_loss_from_terms",
    "actor_loss_fn",
]


class LossAggMode(Choice):
    """The values of ``loss_agg_mode`` (see :data:`AGGREGATIONS`)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    CONSTANT = "constant"


class ImportanceLevel(Choice):
    """The values of ``importance_level`` (see :data:`IMPORTANCE_RATIOS`)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


class BehavWeightMode(Choice):
    """What the decoupled loss does with behaviour weights beyond the cap: drop the token
    (``mask``), or cap w (``truncate``)."""

    MASK = "mask"
    TRUNCATE = "truncate"


class KLEstimator(Choice):
    """Estimators of KL(π || π_ref) from one sample (see :func:`kl_penalty`)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


@dataclasses.dataclass(frozen=True)
class LossShape:
    """The loss options beyond the classic clip; the defaults are the classic PPO loss.

    Attributes:
        eps_clip_high: upper clip ``1 + eps_clip_high`` (clip-higher); None = eps_clip.
        importance_level: an :class:`ImportanceLevel` (or its value).
        loss_agg_mode: a :class:`LossAggMode` (or its value).
        loss_agg_constant: the constant of ``loss_agg_mode="constant"`` (e.g. the longest
            answer).
        behav_imp_weight_mode: a :class:`BehavWeightMode` (or its value).
        behav_imp_weight_floor: ``mask`` mode: tokens with behaviour weight below it are
            dropped too.
        kl_loss_coef, kl_estimator: the KL-to-reference loss term (0: none).
        entropy_coef: the entropy bonus (0: none).
    """

    eps_clip_high: Optional[float] = None
    importance_level: ImportanceLevel = ImportanceLevel.TOKEN
    loss_agg_mode: LossAggMode = LossAggMode.TOKEN_MEAN
    loss_agg_constant: float = 1.0
    behav_imp_weight_mode: BehavWeightMode = BehavWeightMode.MASK
    behav_imp_weight_floor: Optional[float] = None
    kl_loss_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0

    def __post_init__(self):
        for name, choice in (
            ("importance_level", ImportanceLevel),
            ("loss_agg_mode", LossAggMode),
            ("behav_imp_weight_mode", BehavWeightMode),
            ("kl_estimator", KLEstimator),
        ):
            object.__setattr__(self, name, choice.parse(getattr(self, name), name))
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            raise ValueError(f"eps_clip_high must be > 0 or None, got {self.eps_clip_high}")
        if not self.loss_agg_constant > 0:
            raise ValueError(f"loss_agg_constant must be > 0, got {self.loss_agg_constant}")
        if self.kl_loss_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"kl_loss_coef ({self.kl_loss_coef}) and entropy_coef ({self.entropy_coef}) "
                "must be >= 0"
            )

    @property
    def aggregation(self) -> "Aggregation":
        """How the token losses become the micro-batch's loss."""
        return AGGREGATIONS[self.loss_agg_mode]

    @property
    def importance(self) -> "ImportanceRatio":
        """Where the importance ratio is taken (per token or per answer)."""
        return IMPORTANCE_RATIOS[self.importance_level]

    @property
    def per_sequence(self) -> bool:
        """Whether the loss needs the sequence boundaries."""
        return self.importance.per_sequence or self.aggregation.per_answer


class PolicyLossTerms(NamedTuple):
    """Local sums of the PPO policy loss over one micro-batch on one rank (nothing reduced).

    ``loss_sum`` [] (with grad) over ``denom`` [] is the micro-batch's loss (``denom``: the
    valid tokens for ``token-mean``, the valid sequences, times the constant for
    ``constant``, otherwise; None means ``n_valid``). ``n_valid`` [] int64 counts the valid
    tokens; ``ratio_sum`` [] (detached, float32) with ``n_valid`` gives the mean token
    importance ratio, which the early stop takes over all data-parallel ranks (see
    :meth:`ratio_totals`). ``stats`` are this micro-batch's detached scalars: ``approx_kl``,
    ``clip_ratio``, ``dual_clip_ratio``, ``behave_imp_weight`` (means over valid tokens) and
    ``behave_mask_dropped`` (a count), plus, when their option is on, ``seq_clip_ratio``
    (share of answers whose sequence ratio was clipped), ``behave_truncated_ratio`` (share of
    tokens whose behaviour weight was capped), ``kl_loss`` and ``entropy`` (token means).
    """

    loss_sum: torch.Tensor
    n_valid: torch.Tensor
    ratio_sum: torch.Tensor
    stats: Dict[str, torch.Tensor]
    denom: Optional[torch.Tensor] = None

    def ratio_totals(self) -> torch.Tensor:
        """``[sum of rho, n_valid]`` float64 [2]: sum it over ranks for the global mean ratio."""
        return torch.stack([self.ratio_sum, self.n_valid.float()]).double()


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    c_clip: Optional[float],
    eps_clip_high: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (or per-sequence) clipped, optionally dual-clipped, PPO objective as a loss.

    Args:
        ratio: [N] ``rho`` (with grad).
        advantages: [N] A (float32, detached).
        eps_clip: rho is clipped to [1 - eps_clip, 1 + eps_clip_high].
        c_clip: dual clip (> 1) or None: for A < 0 the loss is at most ``c_clip * |A|``.
        eps_clip_high: the upper clip (DAPO's clip-higher); None = eps_clip.

    Returns:
        ``(pg, clipped, dual_clipped)``, all [N]: ``pg = max(-A rho, -A clip(rho))`` (then
        ``min(pg, c |A|)`` where A < 0), and bool masks of the entries where the clipped
        term, respectively the dual clip, took over (those carry no gradient).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    pg = torch.maximum(pg1, pg2)
    clipped = (pg1 < pg2).detach()
    dual_clipped = torch.zeros_like(clipped)
    if c_clip is not None:
        # With A < 0 a huge ratio makes -A rho unbounded: the plain clip only bounds rho
        # from above for A > 0. Dual clip (Ye et al., 2020) caps that side too.
        bound = c_clip * advantages.abs()
        dual_clipped = (advantages < 0) & (bound < pg).detach()
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    return pg, clipped, dual_clipped


def behaviour_weight(
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: Optional[float],
    mode: str = "mask",
    floor: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's behaviour importance weight ``w = exp(pi_prox - mu_b)``.

    Args:
        proximal_logprobs: [T'] pi_prox (float32, detached).
        old_logprobs: [T'] mu_b, the log-probs the tokens were sampled with.
        mask: [T'] bool, valid tokens (others get w = 1: their log-probs may be garbage).
        cap: ``mode="mask"``: tokens with ``w > cap`` are dropped; ``mode="truncate"``:
            ``w = min(w, cap)`` (truncated importance sampling). None: no cap.
        mode: a :class:`BehavWeightMode` (or its value).
        floor: ``mode="mask"`` only: tokens with ``w < floor`` are dropped too (the weight
            must lie in [floor, cap]).

    Returns:
        ``(w, dropped)``, both [T']: the (possibly capped) weights and a bool mask of the
        dropped tokens.
    """
    mode = BehavWeightMode.parse(mode, "behav_imp_weight_mode")
    if mode is BehavWeightMode.TRUNCATE and (cap is None or floor is not None):
        raise ValueError("behav_imp_weight_mode='truncate' needs a cap and takes no floor")
    log_w = proximal_logprobs - old_logprobs.detach().float()
    w = torch.exp(torch.where(mask, log_w, torch.zeros_like(log_w)))
    dropped = torch.zeros_like(mask)
    if mode is BehavWeightMode.TRUNCATE:
        return w.clamp(max=cap), dropped
    if cap is not None:
        dropped = dropped | (mask & (w > cap))
    if floor is not None:
        dropped = dropped | (mask & (w < floor))
    return w, dropped


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token sample estimate of KL(π || π_ref), with ``Δ = log π_ref - log π``.

    ``k1 = -Δ`` (unbiased, can be negative), ``k2 = Δ² / 2``, ``k3 = e^Δ - Δ - 1``
    (unbiased and >= 0; Δ is clamped to [-20, 20] inside the exponential so that one
    garbage token cannot overflow it). [T'] in, [T'] out, float32, differentiable in
    ``logprobs``.
    """
    fn = _KL[KLEstimator.parse(estimator, "kl_estimator")]
    return fn(ref_logprobs.detach().float() - logprobs.float())


_KL: Dict[KLEstimator, Callable[[torch.Tensor], torch.Tensor]] = {
    KLEstimator.K1: lambda d: -d,
    KLEstimator.K2: lambda d: 0.5 * d * d,
    KLEstimator.K3: lambda d: torch.exp(d.clamp(-20.0, 20.0)) - d - 1.0,
}


def sequence_index(short1cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T'] the sequence each shifted entry belongs to."""
    lens = (short1cu_seqlens[1:] - short1cu_seqlens[:-1]).long()
    ids = torch.arange(lens.numel(), device=short1cu_seqlens.device)
    return torch.repeat_interleave(ids, lens)


def _per_sequence_counts(mask: torch.Tensor, short1cu_seqlens: torch.Tensor) -> torch.Tensor:
    seq = sequence_index(short1cu_seqlens)
    n_seq = short1cu_seqlens.numel() - 1
    return torch.zeros(n_seq, device=mask.device).index_add(0, seq, mask.float())


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How one ``loss_agg_mode`` turns the token losses of a micro-batch into its loss
    ``sum(weights * l over valid tokens) / denom``.

    Attributes:
        mode: its ``loss_agg_mode`` value.
        summary: what it computes, one line (``--help``).
        per_answer: the denominator counts answers with a valid token (otherwise: valid
            tokens). The engine weighs each micro-batch by that count, so it must add up
            over micro-batches and ranks.
        answer_token_mean: each token weighs ``1 / n_i`` (n_i: its answer's valid tokens).
        scaled: the denominator is multiplied by ``loss_agg_constant``.
    """

    mode: LossAggMode
    summary: str
    per_answer: bool
    answer_token_mean: bool = False
    scaled: bool = False

    def count(self, mask: torch.Tensor, short1cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """How much one micro-batch weighs in the global loss: its valid tokens, or its
        sequences with at least one valid token (``per_answer``). [] float.

        Args:
            mask: [T'] valid tokens.
            short1cu_seqlens: [B+1] offsets (``per_answer`` modes only; None otherwise).
        """
        mask = mask.bool()
        if not self.per_answer:
            return mask.sum().float()
        if short1cu_seqlens is None:
            raise ValueError(
                f"loss_agg_mode={self.mode!r} needs short1cu_seqlens (sequence boundaries)"
            )
        return (_per_sequence_counts(mask, short1cu_seqlens) > 0).sum().float()

    def weights(
        self, mask: torch.Tensor, short1cu_seqlens: Optional[torch.Tensor], constant: float = 1.0
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T'] float32, denom [] float32)`` of the micro-batch (arguments as
        :meth:`count`; ``constant`` for ``scaled`` modes)."""
        count = self.count(mask, short1cu_seqlens)
        if self.scaled:
            count = count * float(constant)
        if self.answer_token_mean:
            n_i = _per_sequence_counts(mask.bool(), short1cu_seqlens).clamp(min=1.0)
            return 1.0 / n_i[sequence_index(short1cu_seqlens)], count
        return torch.ones(mask.shape, dtype=torch.float32, device=mask.device), count


#: every loss aggregation, by mode
AGGREGATIONS: Dict[LossAggMode, Aggregation] = {
    a.mode: a
    for a in (
        Aggregation(
            LossAggMode.TOKEN_MEAN,
            "every valid token of the global batch weighs the same",
            per_answer=False,
        ),
        Aggregation(
            LossAggMode.SEQ_MEAN_TOKEN_MEAN,
            "mean over answers of each answer's token mean",
            per_answer=True,
            answer_token_mean=True,
        ),
        Aggregation(
            LossAggMode.SEQ_MEAN_TOKEN_SUM,
            "mean over answers of each answer's token sum",
            per_answer=True,
        ),
        Aggregation(
            LossAggMode.CONSTANT,
            "token sum / (loss_agg_constant x answers), Dr. GRPO",
            per_answer=True,
            scaled=True,
        ),
    )
}


#: ``(log_ratio [T'], adv [T'], mask [T'], short1cu_seqlens [B+1] or None, eps_clip, c_clip,
#: eps_clip_high) -> (pg, clipped, dual_clipped, stats)``: the per-token loss and masks
Surrogate = Callable[..., Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]]


def _token_surrogate(log_ratio, adv, mask, short1cu_seqlens, eps_clip, c_clip, eps_clip_high):
    pg, clipped, dual = clipped_surrogate(
        torch.exp(log_ratio), adv, eps_clip, c_clip, eps_clip_high
    )
    return pg, clipped, dual, {}


def _sequence_surrogate(log_ratio, adv, mask, short1cu_seqlens, eps_clip, c_clip, eps_clip_high):
    # GSPO: one ratio per answer, the geometric mean of its token ratios, and the answer's
    # mean advantage; each valid token carries its answer's loss.
    seq = sequence_index(short1cu_seqlens)
    n_seq = short1cu_seqlens.numel() - 1
    seq_log_ratio, n_tok = _segment_mean(log_ratio, mask, seq, n_seq)
    seq_adv, _ = _segment_mean(adv, mask, seq, n_seq)
    pg_s, clip_s, dual_s = clipped_surrogate(
        torch.exp(seq_log_ratio), seq_adv, eps_clip, c_clip, eps_clip_high
    )
    stats = {"seq_clip_ratio": masked_mean(clip_s.float(), n_tok > 0)}
    return pg_s[seq], clip_s[seq], dual_s[seq], stats


@dataclasses.dataclass(frozen=True)
class ImportanceRatio:
    """Where one ``importance_level`` takes the importance ratio.

    Attributes:
        level: its ``importance_level`` value.
        per_sequence: it needs the sequence boundaries.
        surrogate: the clipped objective per token, see :data:`Surrogate`.
    """

    level: ImportanceLevel
    per_sequence: bool
    surrogate: Surrogate


#: both importance levels: per token (PPO) or per answer (GSPO)
IMPORTANCE_RATIOS: Dict[ImportanceLevel, ImportanceRatio] = {
    ImportanceLevel.TOKEN: ImportanceRatio(ImportanceLevel.TOKEN, False, _token_surrogate),
    ImportanceLevel.SEQUENCE: ImportanceRatio(ImportanceLevel.SEQUENCE, True, _sequence_surrogate),
}


def _segment_mean(x: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, n_seq: int):
    zeros = torch.zeros(n_seq, dtype=x.dtype, device=x.device)
    s = zeros.index_add(0, seq, torch.where(mask, x, torch.zeros_like(x)))
    n = zeros.index_add(0, seq, mask.to(x.dtype))
    return s / n.clamp(min=1.0), n


def _check_actor_loss_args(
    logprobs, old_logprobs, advantages, mask, eps_clip, c_clip, proximal_logprobs, cap, shape
) -> None:
    if not eps_clip > 0:
        raise ValueError(f"eps_clip must be > 0, got {eps_clip}")
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(
            f"c_clip must be > 1 (dual clip bounds the loss by c_clip*|A|), got {c_clip}"
        )
    if cap is not None and proximal_logprobs is None:
        raise ValueError(
            "behav_imp_weight_cap needs proximal_logprobs (it is a decoupled-loss option)"
        )
    if shape.behav_imp_weight_floor is not None and proximal_logprobs is None:
        raise ValueError(
            "behav_imp_weight_floor needs proximal_logprobs (it is a decoupled-loss option)"
        )
    if not (logprobs.shape == old_logprobs.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)}, "
            f"advantages {tuple(advantages.shape)} and loss_mask {tuple(mask.shape)} must have one "
            "shape [T']"
        )


# Long on purpose: the loss is one formula (ratio -> clip -> behaviour weight -> extra terms
# -> aggregation) whose stages share the masks; split, each piece would need all of them.
def actor_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    c_clip: Optional[float] = None,
    proximal_logprobs: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    *,
    shape: LossShape = LossShape(),
    short1cu_seqlens: Optional[torch.Tensor] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> PolicyLossTerms:
    """PPO policy loss of one micro-batch as local sums (no collective; see
    :class:`PolicyLossTerms` and the module docstring). Finish it with
    :func:`actor_loss_from_terms`.

    Args:
        logprobs: [T'] current policy log-probs pi (with grad).
        old_logprobs: [T'] behaviour log-probs mu_b (those the tokens were sampled with).
        advantages: [T'] A.
        eps_clip: the ratio is clipped to [1 - eps, 1 + eps] (upper: ``shape.eps_clip_high``).
        loss_mask: [T'] bool, tokens that count.
        c_clip: dual clip (> 1): for A < 0 the loss is at most ``c_clip * |A|``.
        proximal_logprobs: [T'] pi_prox for the decoupled loss (recomputed by the trainer before
            the update).  None: classic PPO, pi_prox = mu_b.
        behav_imp_weight_cap: decoupled only: the cap of the behaviour weight
            ``exp(pi_prox - mu_b)`` (see :func:`behaviour_weight` for the modes).
        shape: the other loss options (:class:`LossShape`).
        short1cu_seqlens: [B+1] sequence offsets; needed when ``shape.per_sequence``.
        ref_logprobs: [T'] reference log-probs; needed when ``shape.kl_loss_coef > 0``.
        entropy: [T'] token entropy (with grad); needed when ``shape.entropy_coef > 0``.
    """
    mask = loss_mask.bool()
    _check_actor_loss_args(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        eps_clip,
        c_clip,
        proximal_logprobs,
        behav_imp_weight_cap,
        shape,
    )
    if shape.per_sequence and short1cu_seqlens is None:
        raise ValueError(
            f"importance_level={shape.importance_level!r} / loss_agg_mode="
            f"{shape.loss_agg_mode!r} need short1cu_seqlens (sequence boundaries)"
        )
    if shape.kl_loss_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_loss_coef > 0 needs ref_logprobs (the reference model's log-probs)")
    if shape.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the token entropy")
    # Ratios and losses in float32 whatever the inputs' dtype: a difference of two bf16
    # log-probs near -5 is resolved to ~0.03, i.e. ratios off by ~3%.
    adv = advantages.detach().float()
    prox = (old_logprobs if proximal_logprobs is None else proximal_logprobs).detach().float()
    stats: Dict[str, torch.Tensor] = {}

    # The behaviour weight comes first: the tokens it drops take no part in a sequence's ratio.
    behav_w = torch.ones_like(prox)
    dropped = torch.zeros_like(mask)
    if proximal_logprobs is not None:
        behav_w, dropped = behaviour_weight(
            prox,
            old_logprobs,
            mask,
            behav_imp_weight_cap,
            shape.behav_imp_weight_mode,
            shape.behav_imp_weight_floor,
        )
        mask = mask & ~dropped
        if shape.behav_imp_weight_mode is BehavWeightMode.TRUNCATE:
            stats["behave_truncated_ratio"] = masked_mean(
                (behav_w >= behav_imp_weight_cap).float(), mask
            )

    # Masked tokens may hold garbage (e.g. prompt positions): keep them out of exp().
    log_ratio = torch.where(mask, logprobs.float() - prox, torch.zeros_like(prox))
    pg, clipped, dual_clipped, ratio_stats = shape.importance.surrogate(
        log_ratio, adv, mask, short1cu_seqlens, eps_clip, c_clip, shape.eps_clip_high
    )
    stats.update(ratio_stats)
    per_token = pg * behav_w

    if shape.kl_loss_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs, shape.kl_estimator)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        per_token = per_token + shape.kl_loss_coef * kl
        stats["kl_loss"] = masked_mean(kl.detach(), mask)
    if shape.entropy_coef > 0:
        ent = torch.where(mask, entropy.float(), torch.zeros_like(prox))
        per_token = per_token - shape.entropy_coef * ent
        stats["entropy"] = masked_mean(ent.detach(), mask)

    weights, denom = shape.aggregation.weights(mask, short1cu_seqlens, shape.loss_agg_constant)
    n_valid = mask.sum()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        ratio_sum = torch.where(mask, ratio, torch.zeros_like(ratio)).sum()
    stats = {
        "approx_kl": masked_mean(log_ratio.detach(), mask),
        "clip_ratio": masked_mean(clipped.float(), mask),
        "dual_clip_ratio": masked_mean(dual_clipped.float(), mask),
        "behave_imp_weight": masked_mean(behav_w.detach(), mask),
        "behave_mask_dropped": dropped.sum(),
        **stats,
    }
    loss_sum = torch.where(mask, per_token * weights, torch.zeros_like(per_token)).sum()
    return PolicyLossTerms(loss_sum, n_valid, ratio_sum, stats, denom)


def actor_loss_from_terms(
    terms: PolicyLossTerms,
    ratio_totals: torch.Tensor,
    early_stop_imp_ratio: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The micro-batch's policy loss and its statistics.

    Args:
        terms: :func:`actor_loss_terms` of the micro-batch.
        ratio_totals: [2] ``terms.ratio_totals()``, summed over the data-parallel ranks by the
            caller (or as is, in a single process).
        early_stop_imp_ratio: when the mean ratio ``ratio_totals[0] / ratio_totals[1]``
            exceeds it, the loss is multiplied by 0 (the batch drifted too far; gradients
            would be harmful).

    Returns:
        ``(loss, stats)``: ``loss_sum / denom`` (a scalar; 0 over an empty denominator) and
        detached scalar tensors ``importance_weight`` (the mean ratio of ``ratio_totals``),
        the terms' statistics, ``n_valid_tokens`` and ``early_stopped``.
    """
    denom = terms.n_valid if terms.denom is None else terms.denom
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    loss = terms.loss_sum / denom
    mean_ratio = (ratio_totals[0] / ratio_totals[1].clamp(min=1)).float()
    early_stopped = early_stop_imp_ratio is not None and bool(mean_ratio > early_stop_imp_ratio)
    if early_stopped:
        # Multiply rather than return a constant: the graph (and every rank's backward) stays
        # intact.
        loss = loss * 0.0
    stats = {
        "importance_weight": mean_ratio,
        **terms.stats,
        "n_valid_tokens": terms.n_valid,
        "early_stopped": torch.tensor(float(early_stopped), device=loss.device),
    }
    return loss, stats


def actor_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    c_clip: Optional[float] = None,
    proximal_logprobs: Optional[torch.Tensor] = None,
    behav_imp_weight_cap: Optional[float] = None,
    early_stop_imp_ratio: Optional[float] = None,
    **extra,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO policy loss of a batch held by one process: :func:`actor_loss_terms` finished by
    :func:`actor_loss_from_terms` with this batch's own mean ratio.

    Arguments as :func:`actor_loss_terms` (``extra``: its keyword-only ones), plus
    ``early_stop_imp_ratio`` (see :func:`actor_loss_from_terms`); returns ``(loss, stats)``
    as the latter. Data-parallel callers sum ``terms.ratio_totals()`` over ranks and call
    the two pieces themselves.
    """
    terms = actor_loss_terms(
        logprobs,
        old_logprobs,
        advantages,
        eps_clip,
        loss_mask,
        c_clip=c_clip,
        proximal_logprobs=proximal_logprobs,
        behav_imp_weight_cap=behav_imp_weight_cap,
        **extra,
    )
    return actor_loss_from_terms(terms, terms.ratio_totals(), early_stop_imp_ratio)
