"""Policy losses of the entropy-mechanism paper: ``clip-cov`` and ``kl-cov`` (Cui et al. 2025,
"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
https://arxiv.org/abs/2505.22617).

Both act on the few tokens whose centred covariance between log-prob and advantage,
``cov_t = (A_t - mean(A)) * (logp_t - mean(logp))`` (means over the valid tokens, ``logp``
detached), is highest: the tokens that drive the policy entropy down.

Where the batch is: the policy-loss contract is called once per forward, that is once per
micro-batch, and the selection, the means and the number of tokens ``N`` are those of that
call, as in the paper's code and verl. A micro-batch is ``train.micro_batch_size`` rows when
that is set; by default (``micro_batch_size: null``) it is as many whole groups as hold at most
``train.micro_batch_tokens`` prompt + completion positions (2048 by default), at least one
group. A mini-batch is therefore one call only when it fits in one micro-batch (rows times the
prompt + completion width within ``micro_batch_tokens``, or at most ``micro_batch_size`` rows):
then the selection is over the whole mini-batch (the paper's setting). Otherwise it is per
micro-batch and, unlike the other built-in losses, the gradient depends on the micro-batch
size. For the same reason neither loss declares ``zero_advantage_is_zero_loss``: skipping rows
would change the means. Under data parallelism each process selects among its own tokens.
"""

from __future__ import annotations

import math

import torch
from grpo_plugins.losses.clip import ClipOptions, ppo_clip_loss
from grpo_plugins.losses.common import BoundPolicyLoss, clamp_symmetric, log_ratio, ratio_metrics
from pydantic import Field, field_validator, model_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import PolicyLossOutput, masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "ClipCovOptions", "ClipCovPolicyLoss", "KLCovOptions", "KLCovPolicyLoss", "centred_covariance", "clip_cov_loss",
    "kl_cov_loss",
]


def _fraction(name: str, value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1] (the fraction of the call's valid tokens selected); got {value!r}")
    return value


class ClipCovOptions(ClipOptions):
    """Options of ``clip-cov``: PPO clip's, plus the selection: the loss (and gradient) of a random
    ``max(1, floor(r N))`` of the unclipped tokens with ``lb < cov_t < ub`` is set to 0,
    ``cov_t = (A_t - mean A)(logp_t - mean logp)`` (https://arxiv.org/abs/2505.22617)."""

    clip_cov_ratio: float = Field(
        2e-4,
        description="Fraction r of the valid tokens whose gradient is cut: max(1, floor(r * N)) tokens drawn at "
        "random among those with clip_cov_lb < cov_t < clip_cov_ub and not already clipped; in (0, 1]. Default "
        "2e-4, verl's, from the entropy-mechanism paper's code (https://arxiv.org/abs/2505.22617).",
    )
    clip_cov_lb: float = Field(1.0, description="Lower bound of the covariance window. Default 1, verl's.")
    clip_cov_ub: float = Field(5.0, description="Upper bound of the covariance window. Default 5, verl's.")
    dual_clip: float | None = Field(
        None,
        description="Dual clip c > 1 on PPO's loss, or null (default): verl's clip_cov has no dual clip (it "
        "ignores clip_ratio_c).",
    )
    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp log(pi/pi_old) to [-c, c] before exp (a clamped token gets no gradient); a positive "
        "number or null. Default 20, a guard of grpo-core's: verl's clip_cov takes exp of the log-ratio "
        "unclamped, so the two agree wherever |log(pi/pi_old)| <= c.",
    )

    @field_validator("clip_cov_ratio")
    @classmethod
    def _check_ratio(cls, value: float) -> float:
        return _fraction("clip_cov_ratio", value)

    @model_validator(mode="after")
    def _check_window(self):
        if not (math.isfinite(self.clip_cov_lb) and math.isfinite(self.clip_cov_ub)
                and self.clip_cov_lb < self.clip_cov_ub):
            raise ValueError(f"clip_cov_lb must be below clip_cov_ub, both finite; got {self.clip_cov_lb!r} and "
                             f"{self.clip_cov_ub!r}")
        return self


class KLCovOptions(Options):
    """Options of ``kl-cov``: ``loss_t = -r_t A_t``, plus ``kl_coef * |logp_t - old_logp_t|`` on the
    ``max(1, floor(k N))`` tokens of largest ``cov_t`` (https://arxiv.org/abs/2505.22617)."""

    kl_cov_ratio: float = Field(
        2e-4,
        description="Fraction k of the valid tokens penalised: the max(1, floor(k * N)) tokens with the largest "
        "cov_t get kl_coef * |logp - old_logp| added; in (0, 1]. Default 2e-4, verl's, from the "
        "entropy-mechanism paper's code (https://arxiv.org/abs/2505.22617).",
    )
    kl_coef: float = Field(
        1.0, description="The penalty's coefficient beta (verl's ppo_kl_coef); a positive number. Default 1, the "
        "entropy-mechanism paper's code and recipes; verl's shipped config sets 0.1 (its kl_cov function falls "
        "back to 1 when the key is unset).",
    )
    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp log(pi/pi_old) to [-c, c] before exp, so it cannot overflow (a clamped token gets no "
        "gradient from the surrogate); a positive number or null. Default 20, a guard of grpo-core's: verl's "
        "kl_cov takes exp of the log-ratio unclamped, so the two agree wherever |log(pi/pi_old)| <= c.",
    )

    @field_validator("kl_cov_ratio")
    @classmethod
    def _check_ratio(cls, value: float) -> float:
        return _fraction("kl_cov_ratio", value)

    @field_validator("kl_coef", "log_ratio_clamp")
    @classmethod
    def _check_positive(cls, value, info):
        if value is None and info.field_name == "log_ratio_clamp":
            return value
        if value is None or not 0.0 < value < math.inf:
            raise ValueError(f"{info.field_name} must be a positive finite number; got {value!r}")
        return value


def centred_covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``cov_t = (A_t - mean(A)) * (logp_t - mean(logp))`` with means over the ``mask`` tokens;
    ``logp`` detached. ``(B, T)`` in, ``(B, T)`` out, zero on padding."""
    logp = masked_fill_zero(logp.detach(), mask)
    advantages = masked_fill_zero(advantages, mask)
    n = mask.sum().clamp(min=1).to(logp.dtype)
    cov = (advantages - advantages.sum() / n) * (logp - logp.sum() / n)
    return masked_fill_zero(cov, mask)


def _count(ratio: float, mask: Tensor) -> int:
    return max(1, int(ratio * int(mask.sum())))


class ClipCovPolicyLoss(BoundPolicyLoss):
    """Clip-Cov: PPO clip, plus the gradient cut on a few random high-covariance tokens (entropy-mechanism paper)."""

    zero_advantage_is_zero_loss = False  # skipping rows would move the covariance's means


@ClipCovPolicyLoss.binds
def clip_cov_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None, **clip_options: float | None,
) -> PolicyLossOutput:
    """Clip-Cov (https://arxiv.org/abs/2505.22617): PPO's clipped surrogate
    (:func:`grpo_plugins.losses.clip.ppo_clip_loss`), then ``max(1, floor(r N))`` tokens drawn
    uniformly at random among the valid tokens with ``lb < cov_t < ub`` that PPO has not
    already clipped have their loss, and so their gradient, set to 0.

    Args:
        logp, old_logp, advantages: ``float (B, T)``; mask: ``bool (B, T)``.
        clip_cov_ratio: ``r`` in (0, 1]; clip_cov_lb, clip_cov_ub: the covariance window.
        generator: the random draw's generator (None: torch's global one, seeded by the run).
        clip_options: ``eps_low``, ``eps_high``, ``dual_clip``, ``log_ratio_clamp``, as ``clip``
            (:func:`~grpo_plugins.losses.clip.ppo_clip_loss`, whose defaults apply).

    Returns:
        ``loss (B, T)`` zero on padding and on the cut tokens; ``clip``'s metrics plus
        ``cov/selected`` (1 on the cut tokens) and ``cov`` (``cov_t``).
    """
    out = ppo_clip_loss(logp, old_logp, advantages, mask, **clip_options)
    cov = centred_covariance(logp, advantages, mask)
    eligible = mask & (out.metrics["clip/region"] == 0) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    flat = torch.nonzero(eligible.reshape(-1)).squeeze(1)
    draw = torch.randperm(len(flat), generator=generator)[: _count(clip_cov_ratio, mask)]
    selected = torch.zeros_like(mask).reshape(-1)
    selected[flat[draw.to(flat.device)]] = True
    selected = selected.reshape(mask.shape)
    metrics = dict(out.metrics)
    metrics["cov/selected"] = selected.to(cov.dtype)
    metrics["cov"] = cov
    return PolicyLossOutput(masked_fill_zero(out.loss, ~selected), metrics)


class KLCovPolicyLoss(BoundPolicyLoss):
    """KL-Cov: unclipped surrogate plus an |log ratio| penalty on the top-covariance tokens (entropy paper)."""

    zero_advantage_is_zero_loss = False  # the penalty does not vanish with A, and the means would move


@KLCovPolicyLoss.binds
def kl_cov_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    kl_cov_ratio: float = 2e-4, kl_coef: float = 1.0, log_ratio_clamp: float | None = 20.0,
) -> PolicyLossOutput:
    """KL-Cov (https://arxiv.org/abs/2505.22617): the unclipped surrogate
    ``-r_t A_t`` on every token, plus ``kl_coef * |logp_t - old_logp_t|`` on the
    ``max(1, floor(k N))`` valid tokens with the largest ``cov_t`` (the paper's KL penalty on
    them, in verl's absolute-log-ratio form).

    Args:
        logp, old_logp, advantages: ``float (B, T)``; mask: ``bool (B, T)``.
        kl_cov_ratio: ``k`` in (0, 1]; kl_coef: the penalty's coefficient.
        log_ratio_clamp: clamp ``logp - old_logp`` to ``[-c, c]`` before exp, or None.

    Returns:
        ``loss (B, T)`` zero on padding; metrics ``ratio``, ``ratio/max``, ``cov/selected``,
        ``cov`` and ``cov/abs_log_ratio`` (``|logp - old_logp|``).
    """
    advantages = masked_fill_zero(advantages, mask)
    log_ratio_t = log_ratio(logp, old_logp, mask)
    ratio = torch.exp(clamp_symmetric(log_ratio_t, log_ratio_clamp))
    cov = centred_covariance(logp, advantages, mask)
    ranked = torch.where(mask, cov, -math.inf).reshape(-1)
    top = torch.topk(ranked, min(_count(kl_cov_ratio, mask), int(mask.sum()))).indices
    selected = torch.zeros_like(mask).reshape(-1)
    selected[top] = True
    selected = selected.reshape(mask.shape) & mask
    loss = -advantages * ratio + torch.where(selected, kl_coef * log_ratio_t.abs(), 0.0)
    metrics = {**ratio_metrics(ratio, mask), "cov/selected": selected.to(cov.dtype), "cov": cov,
               "cov/abs_log_ratio": masked_fill_zero(log_ratio_t.detach().abs(), mask)}
    return PolicyLossOutput(masked_fill_zero(loss, mask), metrics)


@hookimpl
def register_policy_losses(register):
    register.add("clip-cov", ClipCovPolicyLoss, options=ClipCovOptions)
    register.add("kl-cov", KLCovPolicyLoss, options=KLCovOptions)
