"""Policy losses ``clip`` and ``gspo``: PPO's clipped surrogate on the token ratio (with
asymmetric eps and an optional dual clip: DeepSeekMath's GRPO loss) and on the sequence-level,
length-normalized ratio (GSPO, Zheng et al., https://arxiv.org/abs/2507.18071). Metrics: those
of :mod:`grpo_plugins.losses`, plus ``clip/dual`` (``clip`` with ``dual_clip`` only): 1 where
the dual clip caps the loss; ``gspo``'s ``ratio`` is the sequence ratio on each of its tokens.
"""

from __future__ import annotations

import math

import torch
from grpo_plugins.losses.common import (
    CLAMP_DESCRIPTION,
    BoundPolicyLoss,
    clamp_symmetric,
    clip_metrics,
    log_ratio,
    ratio_metrics,
)
from pydantic import Field, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "ClipOptions", "ClipPolicyLoss", "GSPOOptions", "GSPOPolicyLoss", "RatioClipOptions", "clip_ratio_metrics",
    "clipped_surrogate", "gspo_loss", "ppo_clip_loss", "sequence_log_ratio",
]


# --------------------------------------------------------------------------- options
class RatioClipOptions(Options):
    """Clip range and log-ratio guard shared by ``clip`` and ``gspo``."""

    eps_low: float
    eps_high: float | None
    log_ratio_clamp: float | None = Field(20.0, description=CLAMP_DESCRIPTION)

    @field_validator("eps_low")
    @classmethod
    def _check_eps_low(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ValueError(
                f"eps_low must be in (0, 1) (the ratio is clipped below at 1 - eps_low, "
                f"which must stay positive); got {value!r}"
            )
        return value

    @field_validator("eps_high", "log_ratio_clamp")
    @classmethod
    def _check_positive(cls, value: float | None, info) -> float | None:
        if value is not None and not 0.0 < value < math.inf:
            valid = {"eps_high": "(the ratio is clipped above at 1 + eps_high) or null for eps_high = eps_low",
                     "log_ratio_clamp": "(clamp to [-c, c]) or null for no clamp"}[info.field_name]
            raise ValueError(f"{info.field_name} must be a positive finite number {valid}; got {value!r}")
        return value

    @property
    def high(self) -> float:
        """``eps_high``, or ``eps_low`` when unset."""
        return self.eps_low if self.eps_high is None else self.eps_high


class ClipOptions(RatioClipOptions):
    """Options of ``clip``."""

    eps_low: float = Field(
        0.2,
        description="Lower clip: the ratio is clipped at 1 - eps_low; in (0, 1). Default 0.2, the "
        "epsilon of PPO and DeepSeekMath's GRPO.",
    )
    eps_high: float | None = Field(
        None,
        description="Upper clip at 1 + eps_high, or null (default) for eps_low, GRPO's symmetric clip. "
        "DAPO's clip-higher uses 0.28 (https://arxiv.org/abs/2503.14476).",
    )
    dual_clip: float | None = Field(
        None,
        description="Dual clip c > 1, or null (default): for A < 0 the loss is capped at -c*A "
        "(Ye et al., https://arxiv.org/abs/1912.09729; verl's clip_ratio_c).",
    )

    @field_validator("dual_clip")
    @classmethod
    def _check_dual_clip(cls, value: float | None) -> float | None:
        if value is not None and not 1.0 < value < math.inf:
            raise ValueError(
                f"dual_clip must be a finite number > 1 (for A < 0 the loss is capped at "
                f"-dual_clip * A, i.e. at ratio dual_clip, which must lie above ratio 1) or "
                f"null for no dual clip; got {value!r}"
            )
        return value


class GSPOOptions(RatioClipOptions):
    """Options of ``gspo``."""

    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp the token-form log-ratio sg(log s_i) + logp_t - sg(logp_t) to [-c, c] before exp, so it "
        "cannot overflow; a sequence whose log s_i lies outside [-c, c] gets no gradient on any of its tokens (the "
        "clamp cuts it, as in clip). A positive number or null. Default 20, symmetric, a guard of grpo-core's: "
        "verl's gspo clamps the same log-ratio from above only, at 10, so the two agree wherever "
        "-20 <= log s_i <= 10.",
    )

    eps_low: float = Field(
        3e-4,
        description="Lower clip of the sequence ratio, at 1 - eps_low; in (0, 1). Default 3e-4, the GSPO "
        "paper's (a geometric-mean ratio needs a tight range).",
    )
    eps_high: float | None = Field(
        4e-4,
        description="Upper clip of the sequence ratio, at 1 + eps_high; a positive number or "
        "null for eps_high = eps_low. Default 4e-4, the GSPO paper's.",
    )


# --------------------------------------------------------------------------- the clipped surrogate
def clipped_surrogate(ratio: Tensor, clipped: Tensor, advantages: Tensor) -> Tensor:
    """``max(-A*ratio, -A*clipped)``; ties go to the unclipped term, so at ratio 1 the
    gradient is the vanilla policy gradient."""
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped
    return torch.where(clipped_loss > unclipped_loss, clipped_loss, unclipped_loss)


def clip_ratio_metrics(
    ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """The ratio and clip metrics of a PPO clip at ``[1 - eps_low, 1 + eps_high]``: a token is
    clipped below where ratio < 1 - eps_low and A < 0, above where ratio > 1 + eps_high and A > 0."""
    ratio = ratio.detach()
    low = mask & (ratio < 1.0 - eps_low) & (advantages < 0)
    high = mask & (ratio > 1.0 + eps_high) & (advantages > 0)
    return {**ratio_metrics(ratio, mask), **clip_metrics(low, high, ratio.dtype)}


# --------------------------------------------------------------------------- clip
class ClipPolicyLoss(BoundPolicyLoss):
    """PPO clipped surrogate with asymmetric eps and optional dual clip (DeepSeekMath's GRPO loss)."""


@ClipPolicyLoss.binds
def ppo_clip_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
    log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """PPO clipped surrogate, per token (Schulman et al., https://arxiv.org/abs/1707.06347;
    GRPO's, https://arxiv.org/abs/2402.03300).

    ``loss_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)`` with
    ``rho_t = exp(logp_t - old_logp_t)``. With ``dual_clip = c``, for ``A_t < 0`` the loss
    is further capped: ``min(loss_t, -c A_t)`` (verl's dual clip).

    Args:
        logp: ``float (B, T)`` current log-probs (with grad).
        old_logp: ``float (B, T)`` log-probs of the sampling policy (no grad).
        advantages: ``float (B, T)``.
        mask: ``bool (B, T)``.
        eps_low: lower clip range, ``0 < eps_low < 1``.
        eps_high: upper clip range, or None for ``eps_low``.
        dual_clip: ``c > 1``, or None.
        log_ratio_clamp: clamp ``logp - old_logp`` to ``[-c, c]`` before exp, or None.

    Returns:
        :class:`PolicyLossOutput`: ``loss (B, T)`` zero on padding, and the module's
        metrics (``clip/dual`` when ``dual_clip`` is set).
    """
    eps_high = eps_low if eps_high is None else eps_high
    advantages = masked_fill_zero(advantages, mask)
    ratio = torch.exp(clamp_symmetric(log_ratio(logp, old_logp, mask), log_ratio_clamp))
    loss = clipped_surrogate(ratio, ratio.clamp(1.0 - eps_low, 1.0 + eps_high), advantages)
    metrics = clip_ratio_metrics(ratio, advantages, mask, eps_low, eps_high)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        capped = mask & (advantages < 0) & (cap < loss)
        loss = torch.where(capped, cap, loss)
        metrics["clip/dual"] = capped.to(ratio.dtype)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


# --------------------------------------------------------------------------- gspo
def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``log s_i = 1/|o_i| sum_t (logp_it - old_logp_it)`` over valid tokens: ``(B,)``;
    0 for rows without tokens."""
    diff = log_ratio(logp, old_logp, mask)
    lengths = mask.sum(dim=1).clamp(min=1).to(diff.dtype)
    return diff.sum(dim=1) / lengths


class GSPOPolicyLoss(BoundPolicyLoss):
    """GSPO: clipped surrogate on the sequence-level (length-normalized) ratio (https://arxiv.org/abs/2507.18071)."""


@GSPOPolicyLoss.binds
def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float = 3e-4, eps_high: float | None = 4e-4, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """GSPO: group sequence policy optimization (Zheng et al., https://arxiv.org/abs/2507.18071).

    Sequence ratio ``s_i = exp(1/|o_i| sum_t (logp_it - old_logp_it))`` (a geometric mean
    of token ratios), in the paper's token form ``s_it = sg(s_i) * exp(logp_it -
    sg(logp_it))``: its value is ``s_i`` and its gradient ``s_i * grad logp_it``, so with
    ``seq-mean-token-mean`` aggregation and a per-sequence advantage this is exactly GSPO's
    sequence-level objective, and per-token advantages still work (GSPO-token).
    ``loss_it = -min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)``: the clip
    decision is per sequence (all tokens of a sequence share its ratio).

    Args:
        logp: ``float (B, T)`` current log-probs (with grad).
        old_logp: ``float (B, T)`` sampling-policy log-probs (no grad).
        advantages: ``float (B, T)``.
        mask: ``bool (B, T)``; rows with no tokens get ratio 1 and loss 0.
        eps_low: lower clip range, ``0 < eps_low < 1``.
        eps_high: upper clip range, or None for ``eps_low``.
        log_ratio_clamp: clamp the token-form log-ratio (value ``log s_i``) to ``[-c, c]``
            before exp, or None; a row whose ``log s_i`` is outside gets no gradient.

    Returns:
        :class:`PolicyLossOutput`: ``loss (B, T)`` zero on padding, and the module's
        metrics, with ``ratio`` the sequence ratio ``s_i`` on each of its tokens.
    """
    eps_high = eps_low if eps_high is None else eps_high
    advantages = masked_fill_zero(advantages, mask)
    log_s = sequence_log_ratio(logp.detach(), old_logp, mask)
    safe_logp = masked_fill_zero(logp, mask)
    # clamp the token form, not the detached log s_i: where the clamp is active it cuts the gradient
    ratio = torch.exp(clamp_symmetric(log_s[:, None] + safe_logp - safe_logp.detach(), log_ratio_clamp))
    loss = clipped_surrogate(ratio, ratio.clamp(1.0 - eps_low, 1.0 + eps_high), advantages)
    metrics = clip_ratio_metrics(ratio, advantages, mask, eps_low, eps_high)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


@hookimpl
def register_policy_losses(register):
    register.add("clip", ClipPolicyLoss, options=ClipOptions)
    register.add("gspo", GSPOPolicyLoss, options=GSPOOptions)
