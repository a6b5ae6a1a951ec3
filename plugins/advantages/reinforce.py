"""Advantage estimators of the REINFORCE family, each with its own baseline: ``rloo`` (the
leave-one-out mean of the group, https://arxiv.org/abs/2402.14740), ``reinforce++`` (the group
mean, then whitening over the batch) and ``reinforce++-no-baseline`` (discounted returns, then
whitening; https://arxiv.org/abs/2501.03262), ``remax`` (the reward of the prompt's greedy
completion, https://arxiv.org/abs/2310.10505). Conventions: :mod:`grpo_plugins.advantages`.
"""

from __future__ import annotations

from typing import Literal

import torch
from grpo_plugins.advantages.common import BoundEstimator
from grpo_plugins.advantages.grpo import grpo_sequence_advantages
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs, masked_fill_zero
from grpo_core.groups import check_scores, group_index, group_is_constant, group_mean, group_sum, per_token
from grpo_core.options import Options

__all__ = [
    "ReMaxAdvantage", "ReMaxOptions", "ReinforceNoBaselineAdvantage", "ReinforceNoBaselineOptions",
    "ReinforcePlusPlusAdvantage", "ReinforcePlusPlusOptions", "discounted_returns", "masked_whiten",
    "reinforce_no_baseline_advantages", "reinforce_plus_plus_advantages", "remax_advantages", "rloo",
    "rloo_advantages",
]


# --------------------------------------------------------------------------- options
#: ``variance`` of the two REINFORCE++ estimators.
VARIANCE_DESCRIPTION = (
    "The whitening's variance over the batch's n tokens: 'unbiased' divides by n - 1 (default, verl's "
    "masked_whiten); 'population' by n (OpenRLHF's reinforce_baseline and reinforce)."
)


class ReinforcePlusPlusOptions(Options):
    """Options of ``reinforce++``."""

    variance: Literal["population", "unbiased"] = Field("unbiased", description=VARIANCE_DESCRIPTION)
    eps: float = Field(
        1e-8,
        gt=0.0,
        allow_inf_nan=False,
        description="Added to the token variance before the square root when whitening, > 0 (verl's "
        "masked_whiten constant 1e-8).",
    )


class ReinforceNoBaselineOptions(Options):
    """Options of ``reinforce++-no-baseline`` (Hu et al., https://arxiv.org/abs/2501.03262)."""

    gamma: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Discount of REINFORCE++ (https://arxiv.org/abs/2501.03262), 0 < gamma <= 1: the "
        "return of completion token t is gamma^m * r_i, m the completion tokens after t (the sequence "
        "reward sits on the last token); then all returns of the batch are whitened. Default 1 (verl's).",
    )
    variance: Literal["population", "unbiased"] = Field("unbiased", description=VARIANCE_DESCRIPTION)
    eps: float = Field(
        1e-8,
        gt=0.0,
        allow_inf_nan=False,
        description="Added to the token variance before the square root when whitening, > 0 (verl's 1e-8).",
    )


class ReMaxOptions(Options):
    """Options of ``remax`` (Li et al. 2023, https://arxiv.org/abs/2310.10505)."""

    missing_baseline: Literal["zero", "group-mean"] = Field(
        "zero",
        description="ReMax (https://arxiv.org/abs/2310.10505) uses A_i = r_i - r(greedy completion of the "
        "prompt). When the greedy completion is unscorable (a reward function returned None): 'zero' gives "
        "the prompt's rows advantage 0 (default), 'group-mean' falls back to the mean of the group's rewards.",
    )


# --------------------------------------------------------------------------- rloo
def rloo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al., https://arxiv.org/abs/2402.14740).

    ``A_i = r_i - 1/(n-1) sum_{j != i} r_j = (n r_i - sum_j r_j) / (n - 1)`` over the ``n``
    scorable completions of row ``i``'s group, the same value on every token.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable (left out, advantage 0).
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.

    Returns:
        ``float (B, T)``; 0 on padding, on unscorable rows, in groups with fewer than two
        scorable completions and in groups whose scorable rewards are all exactly equal.
    """
    scores = check_scores(scores, mask)
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    r = torch.where(valid, scores, 0.0)
    count = group_sum(valid.to(r.dtype), inverse, n)[inverse]
    total = group_sum(r, inverse, n)[inverse]
    advantage = (count * r - total) / (count - 1).clamp(min=1)
    degenerate = group_is_constant(r, valid, inverse, n)[inverse]
    return per_token(torch.where(degenerate | ~valid, 0.0, advantage), mask)


def rloo(inputs: AdvantageInputs) -> Tensor:
    """Leave-one-out baseline r_i - mean_{j != i} r_j (RLOO, https://arxiv.org/abs/2402.14740)."""
    return rloo_advantages(inputs.scores, inputs.group_ids, inputs.mask)


# --------------------------------------------------------------------------- reinforce++
def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8, unbiased: bool = True) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the ``n`` positions where ``mask`` is True.

    ``var`` uses Bessel's correction (divides by ``n - 1``), as verl's ``masked_whiten``, or
    with ``unbiased=False`` divides by ``n``, as OpenRLHF's advantage normalization (which
    takes ``max(var, eps)`` where this adds ``eps``: equal up to ``eps``); with ``n < 2`` the
    centred values are 0 and so is the result.

    Args:
        values: ``float (B, T)``.
        mask: ``bool (B, T)``.
        eps: added to the variance.
        unbiased: divide the squared deviations by ``n - 1`` (True) or ``n``.

    Returns:
        ``float (B, T)``, zero where ``mask`` is False.
    """
    n = mask.sum().to(values.dtype)
    mean = torch.where(mask, values, 0.0).sum() / n.clamp(min=1)
    centered = torch.where(mask, values - mean, 0.0)
    var = (centered**2).sum() / ((n - 1) if unbiased else n).clamp(min=1)
    return masked_fill_zero(centered * torch.rsqrt(var + eps), mask)


class ReinforcePlusPlusAdvantage(BoundEstimator):
    """REINFORCE++ with group-mean baseline and batch whitening (https://arxiv.org/abs/2501.03262)."""


@ReinforcePlusPlusAdvantage.binds
def reinforce_plus_plus_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, variance: str = "unbiased", eps: float = 1e-8
) -> Tensor:
    """REINFORCE++ with a group-mean baseline (Hu et al., https://arxiv.org/abs/2501.03262).

    ``a_i = r_i - mean(r)`` over the scorable completions of row ``i``'s group, broadcast
    to its tokens, then whitened over every valid token of the batch with
    :func:`masked_whiten`: ``A_it = (a_i - m) / sqrt(v + eps)``, ``m`` and ``v`` the mean
    and Bessel-corrected variance of ``a`` over those tokens (verl's
    ``reinforce_plus_plus_baseline``; with ``variance="population"`` the variance divides by the
    token count, OpenRLHF's ``reinforce_baseline``). Longer completions weigh more in ``m`` and ``v``.

    Differences from verl, both so that ``NaN`` and tiny groups behave as in ``grpo``: the
    tokens of unscorable rows are left out of the whitening and get 0, and a group with a
    single scorable completion gets baseline ``r_i`` (so ``a_i = 0``) where verl uses 0.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable.
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        variance: ``"unbiased"`` (n - 1, verl's) or ``"population"`` (n, OpenRLHF's).
        eps: added to the variance before the square root.

    Returns:
        ``float (B, T)``, zero on padding and on unscorable rows.
    """
    scores = check_scores(scores, mask)
    baseline_adv = grpo_sequence_advantages(scores, group_ids, scale_by_std=False)
    scorable = mask & ~torch.isnan(scores)[:, None]
    return masked_whiten(per_token(baseline_adv, scorable), scorable, eps, unbiased=variance == "unbiased")


# --------------------------------------------------------------------------- reinforce++ without baseline
def discounted_returns(scores: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``float (B, T)``: ``gamma^m * r_i`` on each token of row ``i``, ``m`` the number of
    ``mask`` tokens after it; the return of a reward placed on the row's last token and
    discounted once per completion token (tokens outside ``mask`` are not steps). Zero
    outside ``mask``."""
    after = mask.flip(1).cumsum(1).flip(1) - 1  # mask tokens at or after t, minus t itself
    returns = scores[:, None] * torch.pow(torch.as_tensor(gamma, dtype=scores.dtype), after.to(scores.dtype))
    return torch.where(mask, returns, 0.0)


class ReinforceNoBaselineAdvantage(BoundEstimator):
    """REINFORCE++ without baseline: discounted per-token returns, batch whitening (https://arxiv.org/abs/2501.03262)."""

    reads = ("scores", "mask")  # no group statistic


@ReinforceNoBaselineAdvantage.binds
def reinforce_no_baseline_advantages(
    scores: Tensor, mask: Tensor, *, gamma: float = 1.0, variance: str = "unbiased", eps: float = 1e-8
) -> Tensor:
    """REINFORCE++ without a baseline (Hu et al., https://arxiv.org/abs/2501.03262; verl's
    ``reinforce_plus_plus``, OpenRLHF's ``reinforce``).

    The sequence reward ``r_i`` is put on the last completion token, returns are
    discounted per token (:func:`discounted_returns`, ``G_it = gamma^m r_i``), then
    whitened over every scorable token of the batch with
    :func:`masked_whiten`: ``A_it = (G_it - m) / sqrt(v + eps)``.
    No group statistic: ``group_ids`` are not used. A KL penalty in the reward arrives
    summed into ``r_i`` (the engine's contract), so it sits on the last token where the
    paper spreads ``-beta KL_t`` over the tokens; with ``beta = 0`` the two agree.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable (left out of the whitening, 0).
        mask: ``bool (B, T)``.
        gamma: discount, ``0 < gamma <= 1``.
        variance: ``"unbiased"`` (n - 1, verl's) or ``"population"`` (n, OpenRLHF's).
        eps: added to the variance.

    Returns:
        ``float (B, T)``, zero on padding and on unscorable rows.
    """
    scores = check_scores(scores, mask)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1]; got {gamma}")
    valid = ~torch.isnan(scores)
    scorable = mask & valid[:, None]
    returns = discounted_returns(torch.where(valid, scores, 0.0), scorable, gamma)
    return masked_whiten(returns, scorable, eps, unbiased=variance == "unbiased")


# --------------------------------------------------------------------------- remax
def remax_advantages(
    scores: Tensor, baseline_scores: Tensor, group_ids: Tensor, mask: Tensor, *, missing_baseline: str = "zero",
) -> Tensor:
    """ReMax's advantages (Li et al. 2023, https://arxiv.org/abs/2310.10505).

    ``A_i = r_i - r(y_greedy)``: the reward of the sampled completion minus the reward of
    the prompt's greedy (argmax) completion, scored by the same reward functions; the same
    value on every token. With the KL penalty in the reward, ``r_i`` carries it and the
    greedy score does not (no log-probs are computed for the greedy completion), as in
    verl's ``remax``.

    Args:
        scores: ``float (B,)`` rewards of the sampled completions; ``NaN`` = unscorable
            (advantage 0).
        baseline_scores: ``float (B,)`` greedy completion's reward of each row's prompt;
            ``NaN`` where it was unscorable: then ``missing_baseline`` decides.
        group_ids: ``long (B,)`` (used for the ``"group-mean"`` fallback).
        mask: ``bool (B, T)``.
        missing_baseline: ``"zero"`` (advantage 0) or ``"group-mean"`` (the mean of the
            group's scorable rewards instead).

    Returns:
        ``float (B, T)``, zero on padding and on unscorable rows.
    """
    if missing_baseline not in ("zero", "group-mean"):
        raise ValueError(f"missing_baseline must be 'zero' or 'group-mean'; got {missing_baseline!r}")
    scores = check_scores(scores, mask)
    baseline = check_scores(baseline_scores, mask)
    if missing_baseline == "group-mean":
        baseline = torch.where(torch.isnan(baseline), group_mean(scores, group_ids), baseline)
    advantage = scores - baseline
    return per_token(torch.nan_to_num(advantage, nan=0.0), mask)


class ReMaxAdvantage:
    """ReMax: reward minus the reward of the prompt's greedy completion (https://arxiv.org/abs/2310.10505)."""

    #: The engine generates one greedy completion per prompt, scores it and fills ``baseline_scores``.
    needs_greedy_baseline = True

    def __init__(self, options: ReMaxOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        if inputs.baseline_scores is None:
            raise ValueError(
                "the 'remax' advantage estimator needs inputs.baseline_scores, the score of one greedy "
                "completion per prompt (the engine fills it for an estimator with needs_greedy_baseline = True)"
            )
        return remax_advantages(inputs.scores, inputs.baseline_scores, inputs.group_ids, inputs.mask,
                                missing_baseline=self.options.missing_baseline)


@hookimpl
def register_advantage_estimators(register):
    register.add("rloo", rloo)
    register.add("reinforce++", ReinforcePlusPlusAdvantage, options=ReinforcePlusPlusOptions)
    register.add("reinforce++-no-baseline", ReinforceNoBaselineAdvantage, options=ReinforceNoBaselineOptions)
    register.add("remax", ReMaxAdvantage, options=ReMaxOptions)
