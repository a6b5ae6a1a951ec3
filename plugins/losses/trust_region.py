"""Policy losses ``cispo``, ``sapo``, ``gmpo`` and ``dppo``: four other ways than PPO's hard clip
to keep an update near the sampling policy. CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585) clips
the detached importance weight instead of the objective, so no token loses its gradient; SAPO
(Gao et al., https://arxiv.org/abs/2511.20347) replaces the clip with a sigmoid gate, with
separate temperatures for ``A > 0`` and ``A <= 0``; GMPO (Zhao et al.,
https://arxiv.org/abs/2507.20673) clips each token's log-ratio and takes their geometric mean per
sequence; DPPO (Qi et al., https://arxiv.org/abs/2602.04879) drops the tokens whose probability
moved too far in total variation or binary KL, a trust region on the divergence rather than the
ratio. With ``logp == old_logp`` (``mu = 1``) each gives the vanilla policy gradient
``-A_t grad logp_t`` per token.
"""

from __future__ import annotations

from typing import Literal

import torch
from grpo_plugins.losses.common import (
    CLAMP_DESCRIPTION,
    BoundPolicyLoss,
    clamp_symmetric,
    clip_metrics,
    log_ratio,
    positive_fields,
    ratio_metrics,
)
from pydantic import ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "CISPOOptions", "CISPOPolicyLoss", "DPPOOptions", "DPPOPolicyLoss", "GMPOOptions", "GMPOPolicyLoss",
    "SAPOOptions", "SAPOPolicyLoss", "cispo_loss", "dppo_loss", "gmpo_loss", "sapo_loss",
]


# --------------------------------------------------------------------------- cispo
class CISPOOptions(Options):
    """Options of ``cispo``: ``loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t`` (MiniMax-M1,
    https://arxiv.org/abs/2506.13585, which aggregates with token-mean)."""

    eps_low: float | None = Field(
        None,
        description="Lower clip of the importance-sampling weight at 1 - eps_low, in (0, 1), or null (default) for "
        "none: MiniMax-M1 sets no lower bound (https://arxiv.org/abs/2506.13585), nor does TRL's cispo. verl's cispo "
        "always clips below, at 1 - clip_ratio_low (0.2 by default): eps_low 0.2 is it.",
    )
    eps_high: float = Field(
        0.2,
        description="Upper clip of the importance-sampling weight at 1 + eps_high; a positive number. Default 0.2, "
        "verl's default clip_ratio_high (MiniMax-M1 tunes it). TRL caps the weight at its epsilon_high itself: "
        "eps_high = epsilon_high - 1 (ScaleRL's recommended 5.0 is eps_high 4.0).",
    )
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    @field_validator("eps_low")
    @classmethod
    def _check_eps_low(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"eps_low must be in (0, 1) (the weight is clipped below at 1 - eps_low, which must stay "
                             f"positive) or null for no lower clip; got {value!r}")
        return value

    _check_positive = positive_fields({"eps_high": "a clip bound", "log_ratio_clamp": "a clip bound"})


class CISPOPolicyLoss(BoundPolicyLoss):
    """CISPO: detached clipped IS weight times A times logp; no token loses its gradient (MiniMax-M1)."""


@CISPOPolicyLoss.binds
def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float | None = None, eps_high: float = 0.2, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1,
    https://arxiv.org/abs/2506.13585).

    ``loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logp_t`` with
    ``r_t = exp(logp_t - old_logp_t)``: the weight is clipped and detached, so every token keeps
    the gradient ``-w_t A_t grad logp_t`` (PPO's clip instead drops the clipped tokens' gradient).
    MiniMax-M1 aggregates with ``token-mean``.

    Args:
        logp: ``float (B, T)`` current log-probs (with grad).
        old_logp: ``float (B, T)`` sampling-policy log-probs (no grad).
        advantages: ``float (B, T)``.
        mask: ``bool (B, T)``.
        eps_low: lower clip ``0 < eps_low < 1``, or None for no lower clip.
        eps_high: upper clip, positive.
        log_ratio_clamp: clamp ``logp - old_logp`` to ``[-c, c]`` before exp, or None.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max``, ``clip/low`` (weight
        clipped below), ``clip/high`` (clipped above), ``clip/region`` (either).
    """
    advantages = masked_fill_zero(advantages, mask)
    safe_logp = masked_fill_zero(logp, mask)
    ratio = torch.exp(clamp_symmetric(safe_logp.detach() - masked_fill_zero(old_logp, mask), log_ratio_clamp))
    low = 0.0 if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(min=low, max=1.0 + eps_high)
    loss = -weight * advantages * safe_logp
    below, above = mask & (ratio < low), mask & (ratio > 1.0 + eps_high)
    metrics = ratio_metrics(ratio, mask)
    metrics.update(clip_metrics(below, above, ratio.dtype))
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


# --------------------------------------------------------------------------- sapo
class SAPOOptions(Options):
    """Options of ``sapo``: ``loss_t = -sigmoid(tau (r_t - 1)) * 4 / tau * A_t``, tau by the sign of A_t
    (https://arxiv.org/abs/2511.20347, which aggregates with seq-mean-token-mean)."""

    tau_pos: float = Field(
        1.0,
        description="Temperature of the gate for tokens with A > 0: gate f(r) = sigmoid(tau (r - 1)) * 4 / tau; "
        "larger is a sharper (narrower) soft trust region. Default 1.0, the SAPO paper's and verl's "
        "(https://arxiv.org/abs/2511.20347).",
    )
    tau_neg: float = Field(
        1.05,
        description="Temperature for tokens with A <= 0; the paper makes it larger than tau_pos, so negative "
        "updates fade faster off-policy. Default 1.05, the paper's and verl's.",
    )
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    # its own validator refuses inf and NaN with a message that says what is valid
    model_config = ConfigDict(allow_inf_nan=True)

    _check_positive = positive_fields(
        {"tau_pos": "a temperature", "tau_neg": "a temperature", "log_ratio_clamp": "the clamp bound c"}
    )


class SAPOPolicyLoss(BoundPolicyLoss):
    """SAPO: a sigmoid gate on the ratio in place of the clip, with separate temperatures for A > 0 and A <= 0."""


@SAPOPolicyLoss.binds
def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    tau_pos: float = 1.0, tau_neg: float = 1.05, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """SAPO: soft adaptive policy optimization (Gao et al., https://arxiv.org/abs/2511.20347).

    A smooth gate replaces the hard clip: ``loss_t = -f(r_t) A_t`` with ``r_t = exp(logp_t -
    old_logp_t)``, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` and ``tau = tau_pos`` where
    ``A_t > 0``, else ``tau_neg``. Its gradient is ``-4 s (1 - s) r_t A_t grad logp_t`` with
    ``s = sigmoid(tau (r_t - 1))``: exactly the vanilla policy gradient at ``r = 1``, decaying
    smoothly as ``r`` leaves 1; as ``tau -> 0`` it tends to the unclipped surrogate's
    ``-r_t A_t grad logp_t``.

    Args:
        logp, old_logp, advantages: ``float (B, T)``; mask: ``bool (B, T)``.
        tau_pos, tau_neg: positive temperatures.
        log_ratio_clamp: clamp ``logp - old_logp`` to ``[-c, c]`` before exp, or None.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max`` and ``gate``
        (``4 s (1 - s)``, the factor on the unclipped gradient: 1 at ``r = 1``).
    """
    advantages = masked_fill_zero(advantages, mask)
    ratio = torch.exp(clamp_symmetric(log_ratio(logp, old_logp, mask), log_ratio_clamp))
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -s * (4.0 / tau) * advantages
    metrics = ratio_metrics(ratio, mask)
    gate = 4.0 * s.detach() * (1.0 - s.detach())
    metrics["gate"] = masked_fill_zero(gate, mask)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


# --------------------------------------------------------------------------- gmpo
class GMPOOptions(Options):
    """Options of ``gmpo``: maximise ``A_i exp(1/|o_i| sum_t c_t)``, ``c_t`` the log-ratio clipped to
    ``[-eps_low, eps_high]`` on the side of A (https://arxiv.org/abs/2507.20673); exact with seq-mean-token-mean."""

    eps_low: float = Field(
        0.4,
        description="Lower clip of each token's log-ratio, at -eps_low (a ratio of exp(-eps_low)), for A < 0; a "
        "positive number. Default 0.4, the GMPO paper's (https://arxiv.org/abs/2507.20673).",
    )
    eps_high: float = Field(
        0.4,
        description="Upper clip of each token's log-ratio, at +eps_high (a ratio of exp(eps_high)), for A > 0; a "
        "positive number. Default 0.4, the GMPO paper's.",
    )
    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp the token-form log-ratio (value: the sequence's log geometric mean) to [-c, c] before exp "
        "(a row outside gets no gradient); a positive number or null. Default 20.",
    )

    _check_positive = positive_fields(dict.fromkeys(("eps_low", "eps_high", "log_ratio_clamp"), "a bound in log space"))


class GMPOPolicyLoss(BoundPolicyLoss):
    """GMPO: the geometric mean of token ratios clipped in log space, per sequence (https://arxiv.org/abs/2507.20673)."""


@GMPOPolicyLoss.binds
def gmpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float = 0.4, eps_high: float = 0.4, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """GMPO: geometric-mean policy optimization (Zhao et al., https://arxiv.org/abs/2507.20673).

    Each token's log-ratio ``l_t = logp_t - old_logp_t`` is clipped PPO-style in log space, on the
    side of its advantage: ``c_t = min(l_t, eps_high)`` where ``A_t > 0``, ``max(l_t, -eps_low)``
    where ``A_t < 0`` (a clipped token gets no gradient). The sequence ratio is their geometric
    mean ``s_i = exp(1/|o_i| sum_t c_t)`` and GMPO maximises ``A_i s_i``. Written per token as GSPO
    is: ``loss_t = -A_t * exp(sg(log s_i) + c_t - sg(c_t))``, whose value is ``-A_t s_i`` and
    whose gradient ``-A_t s_i grad c_t``; aggregated with ``seq-mean-token-mean`` and a
    per-sequence advantage this is exactly the paper's objective ``1/G sum_i A_i s_i``.

    Args:
        logp, old_logp, advantages: ``float (B, T)``; mask: ``bool (B, T)`` (rows without tokens
            get ``s_i = 1`` and loss 0).
        eps_low, eps_high: positive clip bounds in log space.
        log_ratio_clamp: clamp the token-form log-ratio to ``[-c, c]``, or None.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio`` (``s_i`` on each of its tokens),
        ``ratio/max``, ``clip/low``, ``clip/high``, ``clip/region`` (per token).
    """
    advantages = masked_fill_zero(advantages, mask)
    log_ratio_t = log_ratio(logp, old_logp, mask)
    high = mask & (advantages > 0) & (log_ratio_t > eps_high)
    low = mask & (advantages < 0) & (log_ratio_t < -eps_low)
    clipped = torch.where(high, eps_high, torch.where(low, -eps_low, log_ratio_t))
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1).to(clipped.dtype)
    log_s = masked_fill_zero(clipped.detach(), mask).sum(dim=1, keepdim=True) / lengths
    ratio = torch.exp(clamp_symmetric(log_s + clipped - clipped.detach(), log_ratio_clamp))
    loss = -advantages * ratio
    metrics = ratio_metrics(ratio, mask)
    metrics.update(clip_metrics(low, high, ratio.dtype))
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


# --------------------------------------------------------------------------- dppo
#: DPPO's divergence bound when the spec leaves it unset: verl's DPPO examples (0.15 for TV, 0.05 for KL).
DPPO_DELTA = {"tv": 0.15, "kl": 0.05}


class DPPOOptions(Options):
    """Options of ``dppo`` (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    https://arxiv.org/abs/2602.04879)."""

    divergence: Literal["tv", "kl"] = Field(
        "tv", description="The sampled token's divergence: 'tv' (default, DPPO-Binary-TV, verl's dppo_tv): p - p_old; "
        "'kl' (DPPO-Binary-KL, verl's dppo_kl): the KL between the two Bernoullis (p_old, 1 - p_old) and (p, 1 - p).",
    )
    delta_low: float | None = Field(
        None, description="The bound for tokens with A <= 0 (the probability falling); null: 0.15 for tv, 0.05 for kl, "
        "verl's DPPO examples (its clip_ratio_low carries it).",
    )
    delta_high: float | None = Field(
        None, description="The bound for tokens with A > 0 (the probability rising); null: as delta_low's default "
        "(verl's clip_ratio_high).",
    )
    truncation: float = Field(
        20.0, description="The importance weight sg(min(r, C)) multiplying the gradient is truncated at C (in place "
        "of a dual clip; the paper recommends a large C). Default 20, the fallback of verl's dppo functions, which "
        "read actor.clip_ratio_c (3 in verl's shipped config) when it is set.",
    )
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    model_config = ConfigDict(allow_inf_nan=True)
    _check_positive = positive_fields(
        {"delta_low": "a divergence bound", "delta_high": "a divergence bound", "truncation": "a weight cap",
         "log_ratio_clamp": "the clamp bound c"}, nullable=("delta_low", "delta_high", "log_ratio_clamp"))

    @model_validator(mode="after")
    def _fill_deltas(self):
        for name in ("delta_low", "delta_high"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, DPPO_DELTA[self.divergence])
        return self


class DPPOPolicyLoss(BoundPolicyLoss):
    """DPPO: the truncated-IS policy gradient on the tokens whose probability stays within a TV or binary-KL bound (https://arxiv.org/abs/2602.04879)."""


@DPPOPolicyLoss.binds
def dppo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    divergence: str = "tv", delta_low: float = 0.15, delta_high: float = 0.15, truncation: float = 20.0,
    log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """Divergence proximal policy optimization, binary approximations (DPPO, Qi et al. 2026,
    https://arxiv.org/abs/2602.04879; verl's ``dppo_tv`` / ``dppo_kl``).

    ``loss_t = -A_t * sg(min(r_t, C)) * logp_t * V_t`` with ``r_t = exp(logp_t - old_logp_t)``: the
    truncated importance-weighted policy gradient, on the tokens ``V_t`` inside the trust region.
    With ``p = exp(logp_t)``, ``p_old = exp(old_logp_t)``: ``tv``: ``V = p - p_old <= delta_high``
    where ``A_t > 0``, ``p - p_old >= -delta_low`` elsewhere; ``kl``: with ``D = p_old log(p_old / p) +
    (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``, ``V = D <= delta_high or p <= p_old``
    where ``A_t > 0``, ``D <= delta_low or p >= p_old`` elsewhere (a move toward the advantage's
    side only is bounded). ``V`` carries no gradient.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max``, ``clip/region`` (1 outside
        the trust region), ``clip/high`` (the weight truncated at C, inside it).
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    advantages = masked_fill_zero(advantages, mask)
    safe_logp, safe_old = masked_fill_zero(logp, mask), masked_fill_zero(old_logp, mask)
    ratio = torch.exp(clamp_symmetric(safe_logp.detach() - safe_old, log_ratio_clamp))
    p, p_old = safe_logp.detach().exp(), safe_old.exp()
    if divergence == "tv":
        rising, falling = p - p_old <= delta_high, p - p_old >= -delta_low
    else:
        binary_kl = p_old * (safe_old - safe_logp.detach()) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        rising, falling = (binary_kl <= delta_high) | (p <= p_old), (binary_kl <= delta_low) | (p >= p_old)
    valid = mask & torch.where(advantages > 0, rising, falling)
    loss = -advantages * ratio.clamp(max=truncation) * safe_logp
    metrics = ratio_metrics(ratio, mask)
    metrics.update(clip_metrics(torch.zeros_like(mask), valid & (ratio > truncation), ratio.dtype))
    metrics["clip/region"] = (mask & ~valid).to(ratio.dtype)
    return PolicyLossOutput(masked_fill_zero(loss, valid), metrics)


@hookimpl
def register_policy_losses(register):
    register.add("cispo", CISPOPolicyLoss, options=CISPOOptions)
    register.add("sapo", SAPOPolicyLoss, options=SAPOOptions)
    register.add("gmpo", GMPOPolicyLoss, options=GMPOOptions)
    register.add("dppo", DPPOPolicyLoss, options=DPPOOptions)
