"""More built-in policy losses: ``cispo`` (MiniMax-M1), ``sapo`` (soft gate), ``gmpo``
(geometric mean of token ratios), and the ratio-free ``gpg`` and ``reinforce``.

Same contract as :mod:`grpo_plugins.policy_losses`: :class:`~grpo_core.contracts.PolicyLossInputs`
(``logp``, ``old_logp``, ``advantages``, ``mask``, all ``(B, T)``) to a per-token loss to
*minimise*, exactly zero on padding, and per-token metrics ``(B, T)``, zero on padding, detached.
Every loss here gives the vanilla policy gradient ``-A_t grad logp_t`` per token when the
policy has not moved since sampling (``logp == old_logp``, ``mu = 1``). Inputs on padding are
replaced by 0 before any arithmetic, so inf/NaN there reach neither the loss nor the gradient.
"""

from __future__ import annotations

import math

import torch
from grpo_plugins.policy_losses import _clamp
from pydantic import ConfigDict, Field, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossInputs, PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "CISPOOptions", "SAPOOptions", "GMPOOptions", "PolicyGradientOptions",
    "cispo_loss", "sapo_loss", "gmpo_loss", "policy_gradient_loss",
]

_CLAMP_DESCRIPTION = (
    "Clamp log(pi/pi_old) to [-c, c] before exp, so it cannot overflow (a clamped token gets no gradient); "
    "a positive number or null. Default 20, as verl."
)


def _positive(name: str, value: float | None, what: str, *, nullable: bool = True) -> float | None:
    if value is None and nullable:
        return value
    if value is None or not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number ({what}){' or null' if nullable else ''}; "
                         f"got {value!r}")
    return value


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``logp - old_logp`` with padding replaced by 0 first: ``(B, T)``, with grad through ``logp``."""
    return masked_fill_zero(logp, mask) - masked_fill_zero(old_logp, mask)


def _clip_metrics(low: Tensor, high: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """``clip/low``, ``clip/high`` and ``clip/region`` ``(B, T)`` from the tokens clipped below
    and above (bool, already masked)."""
    return {"clip/low": low.to(dtype), "clip/high": high.to(dtype), "clip/region": (low | high).to(dtype)}


def _shown_ratio(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    shown = masked_fill_zero(ratio.detach(), mask)
    return {"ratio": shown, "ratio/max": shown}


# --------------------------------------------------------------------------- cispo
class CISPOOptions(Options):
    """Options of ``cispo``: ``loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t logp_t`` (MiniMax-M1,
    https://arxiv.org/abs/2506.13585, which aggregates with token-mean)."""

    eps_low: float | None = Field(
        None,
        description="Lower clip of the importance-sampling weight at 1 - eps_low, in (0, 1), or null (default) for "
        "none: MiniMax-M1 sets no lower bound (https://arxiv.org/abs/2506.13585).",
    )
    eps_high: float = Field(
        0.2,
        description="Upper clip of the importance-sampling weight at 1 + eps_high; a positive number. Default 0.2, "
        "as verl's CISPO example (MiniMax-M1 tunes it).",
    )
    log_ratio_clamp: float | None = Field(20.0, description=_CLAMP_DESCRIPTION)

    @field_validator("eps_low")
    @classmethod
    def _check_eps_low(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < 1.0:
            raise ValueError(f"eps_low must be in (0, 1) (the weight is clipped below at 1 - eps_low, which must stay "
                             f"positive) or null for no lower clip; got {value!r}")
        return value

    @field_validator("eps_high", "log_ratio_clamp")
    @classmethod
    def _check_positive(cls, value, info):
        return _positive(info.field_name, value, "a clip bound", nullable=info.field_name == "log_ratio_clamp")


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 0.2,
    log_ratio_clamp: float | None = 20.0,
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
    ratio = torch.exp(_clamp(safe_logp.detach() - masked_fill_zero(old_logp, mask), log_ratio_clamp))
    low = 0.0 if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(min=low, max=1.0 + eps_high)
    loss = -weight * advantages * safe_logp
    below, above = mask & (ratio < low), mask & (ratio > 1.0 + eps_high)
    metrics = _shown_ratio(ratio, mask)
    metrics.update(_clip_metrics(below, above, ratio.dtype))
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


class CISPOPolicyLoss:
    """CISPO: detached clipped IS weight times A times logp; no token loses its gradient (MiniMax-M1)."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: CISPOOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        o = self.options
        return cispo_loss(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask,
                          eps_low=o.eps_low, eps_high=o.eps_high, log_ratio_clamp=o.log_ratio_clamp)


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
    log_ratio_clamp: float | None = Field(20.0, description=_CLAMP_DESCRIPTION)

    # its own validator refuses inf and NaN with a message that says what is valid
    model_config = ConfigDict(allow_inf_nan=True)

    @field_validator("tau_pos", "tau_neg", "log_ratio_clamp")
    @classmethod
    def _check_positive(cls, value, info):
        return _positive(info.field_name, value, "a temperature" if info.field_name != "log_ratio_clamp"
                         else "the clamp bound c", nullable=info.field_name == "log_ratio_clamp")


def sapo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = 20.0,
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
    ratio = torch.exp(_clamp(_log_ratio(logp, old_logp, mask), log_ratio_clamp))
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -s * (4.0 / tau) * advantages
    metrics = _shown_ratio(ratio, mask)
    gate = 4.0 * s.detach() * (1.0 - s.detach())
    metrics["gate"] = masked_fill_zero(gate, mask)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


class SAPOPolicyLoss:
    """SAPO: a sigmoid gate on the ratio in place of the clip, with separate temperatures for A > 0 and A <= 0."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: SAPOOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        o = self.options
        return sapo_loss(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask,
                         tau_pos=o.tau_pos, tau_neg=o.tau_neg, log_ratio_clamp=o.log_ratio_clamp)


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

    @field_validator("eps_low", "eps_high", "log_ratio_clamp")
    @classmethod
    def _check_positive(cls, value, info):
        return _positive(info.field_name, value, "a bound in log space", nullable=info.field_name == "log_ratio_clamp")


def gmpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
    log_ratio_clamp: float | None = 20.0,
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
    log_ratio = _log_ratio(logp, old_logp, mask)
    high = mask & (advantages > 0) & (log_ratio > eps_high)
    low = mask & (advantages < 0) & (log_ratio < -eps_low)
    clipped = torch.where(high, eps_high, torch.where(low, -eps_low, log_ratio))
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1).to(clipped.dtype)
    log_s = masked_fill_zero(clipped.detach(), mask).sum(dim=1, keepdim=True) / lengths
    ratio = torch.exp(_clamp(log_s + clipped - clipped.detach(), log_ratio_clamp))
    loss = -advantages * ratio
    metrics = _shown_ratio(ratio, mask)
    metrics.update(_clip_metrics(low, high, ratio.dtype))
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


class GMPOPolicyLoss:
    """GMPO: the geometric mean of token ratios clipped in log space, per sequence (https://arxiv.org/abs/2507.20673)."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: GMPOOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        o = self.options
        return gmpo_loss(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask,
                         eps_low=o.eps_low, eps_high=o.eps_high, log_ratio_clamp=o.log_ratio_clamp)


# --------------------------------------------------------------------------- gpg, reinforce
class PolicyGradientOptions(Options):
    """``gpg`` and ``reinforce`` take no options: ``loss_t = -A_t * logp_t``, no ratio and no clip
    (GPG, https://arxiv.org/abs/2504.02546; REINFORCE, Williams 1992)."""


def policy_gradient_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> PolicyLossOutput:
    """The plain policy-gradient loss ``loss_t = -A_t * logp_t`` (REINFORCE, Williams 1992,
    https://doi.org/10.1007/BF00992696; GPG, Chu et al., https://arxiv.org/abs/2504.02546).

    No importance ratio and no clip: the gradient is ``-A_t grad logp_t`` whatever ``old_logp``
    is (with ``mu > 1`` the later passes are biased, as the papers accept). ``old_logp`` only
    feeds the ``ratio`` metric. Shapes ``(B, T)``; returns ``loss (B, T)`` zero on padding and
    metrics ``ratio``, ``ratio/max`` (``exp(logp - old_logp)``, logged, not used).
    """
    advantages = masked_fill_zero(advantages, mask)
    safe_logp = masked_fill_zero(logp, mask)
    ratio = torch.exp((safe_logp.detach() - masked_fill_zero(old_logp, mask)).clamp(max=20.0))
    return PolicyLossOutput(masked_fill_zero(-advantages * safe_logp, mask), _shown_ratio(ratio, mask))


class GPGPolicyLoss:
    """GPG: the plain policy gradient -A * logp, no ratio, clip, critic or reference (https://arxiv.org/abs/2504.02546);
    the paper aggregates with token-mean."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: PolicyGradientOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        return policy_gradient_loss(inputs.logp, inputs.old_logp, inputs.advantages, inputs.mask)


class REINFORCEPolicyLoss(GPGPolicyLoss):
    """REINFORCE: -A * logp, no ratio (Williams 1992); with seq-mean-token-sum it is -1/B sum_i A_i log pi(o_i)."""


@hookimpl
def register_policy_losses(register):
    register.add("cispo", CISPOPolicyLoss, options=CISPOOptions)
    register.add("sapo", SAPOPolicyLoss, options=SAPOOptions)
    register.add("gmpo", GMPOPolicyLoss, options=GMPOOptions)
    register.add("gpg", GPGPolicyLoss, options=PolicyGradientOptions)
    register.add("reinforce", REINFORCEPolicyLoss, options=PolicyGradientOptions)
