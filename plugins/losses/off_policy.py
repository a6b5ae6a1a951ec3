"""Policy losses for data that is off the trained policy (stale batches, a sampler whose numerics
differ): ``opsm`` (PPO's clip with DeepSeek-V3.2's off-policy sequence masking), ``m2po`` (the
second-moment trust region, Zheng et al.), ``topr`` (tapered off-policy REINFORCE, Le Roux et al.)
and ``vespo`` (a smooth gamma weight of the sequence ratio, in place of the clip).

``opsm`` and ``m2po`` read :attr:`~grpo_core.contracts.PolicyLossInputs.sampling_logp`, the
sampler's log-probs, when the rollout backend gives them. Metrics: those of
:mod:`grpo_plugins.losses`, plus each loss's own (``opsm/masked``, ``m2po/masked``, ``topr/negative``,
``vespo/weight``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from grpo_plugins.losses.clip import ClipOptions, ppo_clip_loss
from grpo_plugins.losses.common import (
    CLAMP_DESCRIPTION,
    BoundPolicyLoss,
    clamp_symmetric,
    log_ratio,
    positive_fields,
    ratio_metrics,
)
from pydantic import ConfigDict, Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "M2POOptions", "M2POPolicyLoss", "OPSMOptions", "OPSMPolicyLoss", "TOPROptions", "TOPRPolicyLoss", "VESPOOptions",
    "VESPOPolicyLoss", "m2po_loss", "m2po_mask", "opsm_loss", "topr_loss", "vespo_loss", "vespo_weight",
]


class OffPolicyLoss(BoundPolicyLoss):
    """A loss of this module: it also reads the sampler's log-probs (None when not given)."""

    reads = ("logp", "old_logp", "advantages", "mask", "sampling_logp")


# --------------------------------------------------------------------------- opsm
class OPSMOptions(ClipOptions):
    """Options of ``opsm``: ``clip``'s, plus the threshold ``delta`` of the off-policy sequence mask
    (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, eq. 9)."""

    delta: float = Field(
        0.5,
        description="A completion with a negative advantage whose mean per-token KL(sampler || policy), "
        "1/|o| sum_t (log pi_sampler - log pi_theta), exceeds delta is left out of the loss. A positive number; "
        "default 0.5, the example value of TRL's off_policy_mask_threshold.",
    )
    _check_delta = positive_fields({"delta": "the threshold on the mean log-ratio"}, nullable=())


class OPSMPolicyLoss(OffPolicyLoss):
    """OPSM: PPO's clip without the completions with A < 0 that drifted past delta from the sampler (DeepSeek-V3.2)."""


@OPSMPolicyLoss.binds
def opsm_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, sampling_logp: Tensor | None = None, *,
    delta: float = 0.5, **clip_options: float | None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate with off-policy sequence masking (DeepSeek-V3.2,
    https://arxiv.org/abs/2512.02556, eq. 9).

    ``M_i = 0`` where ``A_it < 0`` and ``1/|o_i| sum_t (log pi_b(o_it) - log pi_theta(o_it)) > delta``,
    else 1; ``loss_it = M_i * clip_loss_it``. ``pi_b`` is the sampler (``sampling_logp``), or the
    policy that sampled as the trainer computes it (``old_logp``) when the backend gives no
    log-probs (TRL's ``off_policy_mask_threshold`` does the same); ``pi_theta`` the current policy,
    detached. So the mask sees both the sampler's drift and the update's. Masked tokens keep their
    place in the aggregator's normalizer.

    Args:
        logp, old_logp, advantages: ``float (B, T)``; mask: ``bool (B, T)``.
        sampling_logp: ``float (B, T)`` the sampler's log-probs, or None.
        delta: the threshold; clip_options: ``clip``'s (``eps_low``, ``eps_high``, ``dual_clip``,
            ``log_ratio_clamp``).

    Returns:
        ``clip``'s loss times the mask, and its metrics plus ``opsm/masked`` (1 on the tokens left
        out) and ``opsm/kl`` (the completion's mean log-ratio on each of its tokens).
    """
    out = ppo_clip_loss(logp, old_logp, advantages, mask, **clip_options)
    behaviour = old_logp if sampling_logp is None else sampling_logp
    drift = masked_fill_zero(behaviour.detach() - logp.detach(), mask)
    mean_kl = drift.sum(dim=1) / mask.sum(dim=1).clamp(min=1).to(drift.dtype)
    dropped = mask & (masked_fill_zero(advantages, mask) < 0) & (mean_kl > delta)[:, None]
    metrics = dict(out.metrics)
    metrics["opsm/masked"] = dropped.to(drift.dtype)
    metrics["opsm/kl"] = masked_fill_zero(mean_kl[:, None].expand_as(drift), mask)
    return PolicyLossOutput(masked_fill_zero(out.loss, ~dropped), metrics)


# --------------------------------------------------------------------------- m2po
class M2POOptions(Options):
    """Options of ``m2po`` (Zheng et al. 2025, https://arxiv.org/abs/2510.01161)."""

    threshold: float = Field(
        0.04,
        description="tau_M2: the tokens with the largest (log pi_prox - log pi_sampler)^2 are left out until the mean "
        "of the rest is below it. A positive number; default 0.04, the paper's and AReaL's example "
        "(m2_threshold).",
    )
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    model_config = ConfigDict(allow_inf_nan=True)
    _check_positive = positive_fields({"threshold": "the second-moment bound", "log_ratio_clamp": "the clamp bound c"},
                                      nullable=("log_ratio_clamp",))


def m2po_mask(behaviour_logp: Tensor, proximal_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """``bool (B, T)``: the tokens M2PO keeps. With ``m2_t = (proximal - behaviour)^2`` over the
    ``mask`` tokens sorted from the largest, the fewest largest ones are dropped so that the mean
    ``m2`` of the rest is below ``threshold`` (at least one token is kept); AReaL's
    ``_apply_m2po_masking``. Ties are broken by position (the earlier token first)."""
    m2 = (proximal_logp.detach() - behaviour_logp.detach()).square()[mask]
    keep = torch.zeros_like(mask)
    if m2.numel() == 0:
        return keep
    order = torch.argsort(m2, descending=True, stable=True)
    ranked = m2[order]
    rest_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(len(ranked), 0, -1, dtype=ranked.dtype,
                                                                 device=ranked.device)
    below = torch.nonzero(rest_mean < threshold)
    dropped = int(below[0]) if len(below) else len(ranked) - 1
    kept_sorted = torch.ones_like(ranked, dtype=torch.bool)
    kept_sorted[:dropped] = False
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep[mask] = kept
    return keep


class M2POPolicyLoss(OffPolicyLoss):
    """M2PO: the unclipped surrogate, minus the tokens whose squared sampler log-ratio pushes its mean over tau (https://arxiv.org/abs/2510.01161)."""


@M2POPolicyLoss.binds
def m2po_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, sampling_logp: Tensor | None = None, *,
    threshold: float = 0.04, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """Second-Moment Trust Policy Optimization (M2PO, Zheng et al. 2025, "Prosperity before Collapse:
    How Far Can Off-Policy RL Reach with Stale Data on LLMs?", https://arxiv.org/abs/2510.01161).

    ``loss_t = -M_t * r_t * A_t`` with ``r_t = exp(logp_t - old_logp_t)`` (no clip: the second-moment
    mask is the trust region), ``M`` from :func:`m2po_mask` of the sampler's log-probs against
    ``old_logp`` (the policy the learner holds when the batch arrives, AReaL's proximal policy),
    over the tokens of this call (one micro-batch, as AReaL's). Without sampler log-probs every
    token is kept. Masked tokens keep their place in the aggregator's normalizer (AReaL divides
    a micro-batch by its kept tokens).

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max``, ``m2po/masked`` (1 on the
        tokens left out) and ``m2po/m2`` (each token's squared log-ratio).
    """
    advantages = masked_fill_zero(advantages, mask)
    ratio = torch.exp(clamp_symmetric(log_ratio(logp, old_logp, mask), log_ratio_clamp))
    metrics = ratio_metrics(ratio, mask)
    if sampling_logp is None:
        keep, m2 = mask, torch.zeros_like(ratio)
    else:
        keep = m2po_mask(sampling_logp, old_logp, mask, threshold)
        m2 = masked_fill_zero((old_logp.detach() - sampling_logp).square(), mask)
    metrics["m2po/masked"] = (mask & ~keep).to(ratio.dtype)
    metrics["m2po/m2"] = m2.to(ratio.dtype)
    return PolicyLossOutput(masked_fill_zero(-ratio * advantages, keep), metrics)


# --------------------------------------------------------------------------- topr
class TOPROptions(Options):
    """Options of ``topr`` (Le Roux et al. 2025, https://arxiv.org/abs/2503.14286)."""

    level: Literal["token", "sequence"] = Field(
        "token",
        description="The ratio pi/pi_old of the tokens with A < 0, truncated to [0, 1]: 'token' (default, ROLL's "
        "ratio_type token) per token; 'sequence' the completion's product of token ratios, the paper's "
        "trajectory ratio.",
    )
    positive_weight: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="Weight of the tokens with A > 0 (ROLL's topr_positive_weight)."
    )
    negative_weight: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="Weight of the tokens with A <= 0 (topr_negative_weight)."
    )
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    model_config = ConfigDict(allow_inf_nan=True)
    _check_positive = positive_fields({"log_ratio_clamp": "the clamp bound c"})


class TOPRPolicyLoss(BoundPolicyLoss):
    """TOPR: plain -A logp where A > 0, the ratio truncated to [0, 1] as a weight where A <= 0 (https://arxiv.org/abs/2503.14286)."""


@TOPRPolicyLoss.binds
def topr_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    level: str = "token", positive_weight: float = 1.0, negative_weight: float = 1.0,
    log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, https://arxiv.org/abs/2503.14286, eq. 8).

    ``loss_t = -w_+ A_t logp_t`` where ``A_t > 0`` (a supervised update: no importance weight) and
    ``loss_t = -w_- sg(clip(rho, 0, 1)) A_t logp_t`` elsewhere, ``rho`` the token ratio
    ``exp(logp_t - old_logp_t)`` or, with ``level="sequence"``, the completion's
    ``exp(sum_t (logp_t - old_logp_t))``. ROLL (``pg_variant: topr``) splits by the completion's
    score (``> 0`` positive) where this loss, which sees advantages only, splits by the sign of the
    advantage: the same for 0/1 rewards under group-relative advantages.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max``, ``topr/negative`` (1 on the
        tokens with A <= 0) and ``clip/high`` (those whose ratio the truncation at 1 cut).
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    advantages = masked_fill_zero(advantages, mask)
    safe_logp = masked_fill_zero(logp, mask)
    diff = log_ratio(logp.detach(), old_logp, mask)
    if level == "sequence":
        diff = diff.sum(dim=1, keepdim=True).expand_as(diff)
    ratio = torch.exp(clamp_symmetric(diff, log_ratio_clamp))
    negative = mask & (advantages <= 0)
    weight = torch.where(negative, negative_weight * ratio.clamp(0.0, 1.0), positive_weight)
    metrics = ratio_metrics(ratio, mask)
    metrics["topr/negative"] = negative.to(ratio.dtype)
    metrics["clip/high"] = (negative & (ratio > 1.0)).to(ratio.dtype)
    return PolicyLossOutput(masked_fill_zero(-weight * advantages * safe_logp, mask), metrics)


# --------------------------------------------------------------------------- vespo
class VESPOOptions(Options):
    """Options of ``vespo``: the gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence
    ratio w, with (k, lambda) by the sign of A (https://arxiv.org/abs/2602.10693); defaults TRL's."""

    k_pos: float = Field(2.0, description="k for A >= 0: phi's power of w (how fast w < 1 fades). TRL's vespo_k_pos.")
    lambda_pos: float = Field(3.0, description="lambda for A >= 0: phi's decay in w (how fast w > 1 fades).")
    k_neg: float = Field(3.0, description="k for A < 0. TRL's vespo_k_neg.")
    lambda_neg: float = Field(2.0, description="lambda for A < 0. TRL's vespo_lambda_neg.")

    model_config = ConfigDict(allow_inf_nan=True)
    _check_positive = positive_fields({"k_pos": "an exponent", "lambda_pos": "a decay", "k_neg": "an exponent",
                                       "lambda_neg": "a decay"}, nullable=())


def vespo_weight(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, k_pos: float = 2.0,
                 lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0) -> Tensor:
    """``phi (B, T)``, detached: ``exp(lambda + k log w - lambda w)`` with ``log w = clamp(sum_t
    clamp(logp_t - old_logp_t, -20, 20), log 1e-8, 20)`` per completion (TRL's clamps), ``(k, lambda)``
    the ``pos`` pair where ``A_t >= 0``; ``phi(1) = 1``; 0 where it is not finite or on padding."""
    per_token = clamp_symmetric(log_ratio(logp.detach(), old_logp, mask), 20.0)
    log_w = per_token.sum(dim=1, keepdim=True).clamp(math.log(1e-8), 20.0).expand_as(per_token)
    nonneg = masked_fill_zero(advantages, mask) >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return masked_fill_zero(torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0), mask)


class VESPOPolicyLoss(BoundPolicyLoss):
    """VESPO: -phi(w) A logp with phi a smooth gamma weight of the sequence ratio w, in place of the clip (https://arxiv.org/abs/2602.10693)."""


@VESPOPolicyLoss.binds
def vespo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
) -> PolicyLossOutput:
    """Variational sequence-level soft policy optimization (VESPO, https://arxiv.org/abs/2602.10693;
    TRL's ``loss_type="vespo"``).

    ``loss_t = -sg(phi(w_i)) * A_t * logp_t`` with ``w_i = prod_t pi/pi_old`` the completion's
    ratio and ``phi`` of :func:`vespo_weight`, so the gradient is ``phi(w_i) A_t grad logp_t``: a
    smooth weight, 1 on-policy, fading for stale completions in either direction. TRL aggregates
    it like ``token-mean``. TRL also folds its vLLM importance ratio into ``w``; here the rollout
    correction weighs the loss after it instead (``algorithm.rollout_correction``).

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio`` and ``ratio/max`` (the sequence ratio
        ``w_i`` on its tokens) and ``vespo/weight`` (``phi``).
    """
    advantages = masked_fill_zero(advantages, mask)
    phi = vespo_weight(logp, old_logp, advantages, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                       lambda_neg=lambda_neg)
    w = torch.exp(log_ratio(logp.detach(), old_logp, mask).sum(dim=1, keepdim=True).clamp(max=20.0))
    metrics = ratio_metrics(w.expand_as(phi), mask)
    metrics["vespo/weight"] = phi
    return PolicyLossOutput(masked_fill_zero(-phi * advantages * masked_fill_zero(logp, mask), mask), metrics)


@hookimpl
def register_policy_losses(register):
    register.add("opsm", OPSMPolicyLoss, options=OPSMOptions)
    register.add("m2po", M2POPolicyLoss, options=M2POOptions)
    register.add("topr", TOPRPolicyLoss, options=TOPROptions)
    register.add("vespo", VESPOPolicyLoss, options=VESPOOptions)
