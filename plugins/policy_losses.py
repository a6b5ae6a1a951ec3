"""Built-in policy losses: ``clip`` (PPO clipped surrogate, asymmetric eps, dual clip) and
``gspo`` (sequence-level ratio).

Each maps :class:`~grpo_core.contracts.PolicyLossInputs` (``logp``, ``old_logp``,
``advantages``, ``mask``, all ``(B, T)``) to a per-token loss to *minimise*, exactly zero
on padding, plus per-token metrics ``(B, T)`` (zero on padding; the engine averages them
over the mini-batch's tokens and max-reduces names ending in ``/max``):

- ``ratio``, ``ratio/max``: the importance ratio pi / pi_old the loss used;
- ``clip/low``: 1 where the lower clip is active (ratio < 1 - eps_low and A < 0);
- ``clip/high``: 1 where the upper clip is active (ratio > 1 + eps_high and A > 0);
- ``clip/region``: either of the two; ``clip/dual`` (``clip`` with ``dual_clip`` only):
  1 where the dual clip caps the loss.

Inputs on padding are replaced by 0 before any arithmetic, so inf/NaN there reach
neither the loss nor the gradient.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossInputs, PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = ["ClipOptions", "GSPOOptions", "ppo_clip_loss", "gspo_loss"]


# --------------------------------------------------------------------------- options
class _RatioClipOptions(Options):
    """Clip range and log-ratio guard shared by ``clip`` and ``gspo``."""

    eps_low: float
    eps_high: float | None
    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp log(pi/pi_old) to [-c, c] before exp, so it cannot overflow (a clamped token "
        "gets no gradient); a positive number or null. Default 20, as verl.",
    )

    @field_validator("eps_low")
    @classmethod
    def _check_eps_low(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ValueError(
                f"eps_low must be in (0, 1) (the ratio is clipped below at 1 - eps_low, "
                f"which must stay positive); got {value!r}"
            )
        return value

    @field_validator("eps_high")
    @classmethod
    def _check_eps_high(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < math.inf:
            raise ValueError(
                f"eps_high must be a positive finite number (the ratio is clipped above at "
                f"1 + eps_high) or null for eps_high = eps_low; got {value!r}"
            )
        return value

    @field_validator("log_ratio_clamp")
    @classmethod
    def _check_clamp(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value < math.inf:
            raise ValueError(
                f"log_ratio_clamp must be a positive finite number (clamp to [-c, c]) or "
                f"null for no clamp; got {value!r}"
            )
        return value

    @property
    def high(self) -> float:
        """``eps_high``, or ``eps_low`` when unset."""
        return self.eps_low if self.eps_high is None else self.eps_high


class ClipOptions(_RatioClipOptions):
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


class GSPOOptions(_RatioClipOptions):
    """Options of ``gspo``."""

    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp the token-form log-ratio sg(log s_i) + logp_t - sg(logp_t) to [-c, c] before exp, so it "
        "cannot overflow; a sequence whose log s_i lies outside [-c, c] gets no gradient on any of its tokens (the "
        "clamp cuts it, as in clip). A positive number or null. Default 20, as verl's token ratio.",
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


# --------------------------------------------------------------------------- helpers
def _clipped_surrogate(ratio: Tensor, clipped: Tensor, advantages: Tensor) -> Tensor:
    """``max(-A*ratio, -A*clipped)``; ties go to the unclipped term, so at ratio 1 the
    gradient is the vanilla policy gradient."""
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * clipped
    return torch.where(clipped_loss > unclipped_loss, clipped_loss, unclipped_loss)


def _ratio_metrics(
    ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """The conventional per-token metrics ``(B, T)``, detached, zero on padding."""
    ratio = ratio.detach()
    low = mask & (ratio < 1.0 - eps_low) & (advantages < 0)
    high = mask & (ratio > 1.0 + eps_high) & (advantages > 0)
    shown = masked_fill_zero(ratio, mask)
    return {
        "ratio": shown,
        "ratio/max": shown,
        "clip/low": low.to(ratio.dtype),
        "clip/high": high.to(ratio.dtype),
        "clip/region": (low | high).to(ratio.dtype),
    }


def _clamp(x: Tensor, bound: float | None) -> Tensor:
    return x if bound is None else x.clamp(-bound, bound)


# --------------------------------------------------------------------------- clip
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
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
    log_ratio = masked_fill_zero(logp, mask) - masked_fill_zero(old_logp, mask)
    ratio = torch.exp(_clamp(log_ratio, log_ratio_clamp))
    loss = _clipped_surrogate(ratio, ratio.clamp(1.0 - eps_low, 1.0 + eps_high), advantages)
    metrics = _ratio_metrics(ratio, advantages, mask, eps_low, eps_high)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        capped = mask & (advantages < 0) & (cap < loss)
        loss = torch.where(capped, cap, loss)
        metrics["clip/dual"] = capped.to(ratio.dtype)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


class ClipPolicyLoss:
    """PPO clipped surrogate with asymmetric eps and optional dual clip (DeepSeekMath's GRPO loss)."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: ClipOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        o = self.options
        return ppo_clip_loss(
            inputs.logp,
            inputs.old_logp,
            inputs.advantages,
            inputs.mask,
            eps_low=o.eps_low,
            eps_high=o.high,
            dual_clip=o.dual_clip,
            log_ratio_clamp=o.log_ratio_clamp,
        )


# --------------------------------------------------------------------------- gspo
def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``log s_i = 1/|o_i| sum_t (logp_it - old_logp_it)`` over valid tokens: ``(B,)``;
    0 for rows without tokens."""
    diff = masked_fill_zero(logp, mask) - masked_fill_zero(old_logp, mask)
    lengths = mask.sum(dim=1).clamp(min=1).to(diff.dtype)
    return diff.sum(dim=1) / lengths


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float | None = 4e-4,
    log_ratio_clamp: float | None = 20.0,
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
    ratio = torch.exp(_clamp(log_s[:, None] + safe_logp - safe_logp.detach(), log_ratio_clamp))
    loss = _clipped_surrogate(ratio, ratio.clamp(1.0 - eps_low, 1.0 + eps_high), advantages)
    metrics = _ratio_metrics(ratio, advantages, mask, eps_low, eps_high)
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


class GSPOPolicyLoss:
    """GSPO: clipped surrogate on the sequence-level (length-normalized) ratio (https://arxiv.org/abs/2507.18071)."""

    zero_advantage_is_zero_loss = True

    def __init__(self, options: GSPOOptions):
        self.options = options

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        o = self.options
        return gspo_loss(
            inputs.logp,
            inputs.old_logp,
            inputs.advantages,
            inputs.mask,
            eps_low=o.eps_low,
            eps_high=o.high,
            log_ratio_clamp=o.log_ratio_clamp,
        )


@hookimpl
def register_policy_losses(register):
    register.add("clip", ClipPolicyLoss, options=ClipOptions)
    register.add("gspo", GSPOPolicyLoss, options=GSPOOptions)
