"""Advantage estimator ``gdpo``: Group reward-Decoupled normalization Policy Optimization (Liu et
al. 2026, https://arxiv.org/abs/2601.05242): each reward function's scores normalized within the
group on their own, the normalized scores summed with the reward weights, the sum normalized
over the batch. Conventions: :mod:`grpo_plugins.advantages`.

It reads :class:`~grpo_core.contracts.AdvantageInputs`' reward table (``reward_scores``,
``reward_weights``), which the engine fills for every estimator; without one (an engine or a
test that passes ``scores`` only) the table is the one column ``scores`` with weight 1.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from grpo_plugins.advantages.common import BoundEstimator
from grpo_plugins.advantages.grpo import grpo_sequence_advantages
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.groups import check_scores, per_token, safe_divide
from grpo_core.options import Options

__all__ = ["GDPOAdvantage", "GDPOOptions", "gdpo_advantages", "normalize_over_batch"]


class GDPOOptions(Options):
    """Options of ``gdpo`` (https://arxiv.org/abs/2601.05242)."""

    scale_by_std: bool = Field(
        True, description="Divide each reward function's group-centred scores by their group std (GDPO, default); "
        "False keeps r - mean(r) per function.",
    )
    std: Literal["population", "unbiased"] = Field(
        "unbiased", description="The group std of each function's scores: 'unbiased' divides by n - 1 (default; "
        "TRL's normalize_then_sum and verl's gdpo), 'population' by n.",
    )
    eps: float = Field(
        1e-6, ge=0.0, allow_inf_nan=False,
        description="Added to each group std before dividing, >= 0. Default 1e-6, verl's; TRL uses 1e-4.",
    )
    batch_norm: Literal["sequence", "token", "none"] = Field(
        "sequence", description="How the weighted sum is normalized over the batch (GDPO's batch-wise "
        "normalization): 'sequence' (default, TRL's normalize_then_sum): (a - mean) / (std + batch_eps) over the "
        "scorable completions, std as `std`; 'token' (verl's gdpo): whitened over every token of the scorable "
        "completions, (a - mean) / sqrt(var + batch_eps), var with n - 1, as verl's masked_whiten; 'none': the "
        "weighted sum as it is (with one reward function: grpo's advantage).",
    )
    batch_eps: float = Field(
        1e-6, ge=0.0, allow_inf_nan=False,
        description="The batch normalization's constant, >= 0: added to the std ('sequence'; TRL uses 1e-4) or to "
        "the variance under the square root ('token'; verl's masked_whiten uses 1e-8).",
    )


def _exact_zero_spread(centred: Tensor, values: Tensor, active: Tensor) -> Tensor:
    """``centred``, or zeros when every ``active`` value is the same: their float mean can miss
    that value by an ulp, and with ``batch_eps`` 0 the rounding left over would be divided by
    a spread of the same size (every completion then gets +-sqrt(2/3) from nothing)."""
    picked = values[active]
    if picked.numel() and bool((picked == picked[0]).all()):
        return torch.zeros_like(centred)
    return centred


def normalize_over_batch(advantage: Tensor, scorable: Tensor, mask: Tensor, *, how: str, std: str,
                         eps: float) -> Tensor:
    """GDPO's batch-wise step on per-completion advantages ``(B,)``: ``(B, T)`` out, 0 on
    padding and on the rows that are not ``scorable`` (``bool (B,)``), which are left out of
    the statistics. ``how`` is ``"sequence"``, ``"token"`` or ``"none"`` (see :class:`GDPOOptions`)."""
    if how == "none":
        return per_token(torch.where(scorable, advantage, 0.0), mask)
    if how == "token":  # verl's masked_whiten: token-weighted mean, n - 1 variance, eps inside the root
        tokens = mask & scorable[:, None]
        values = per_token(advantage, tokens)
        n = tokens.sum().to(advantage.dtype)
        centred = torch.where(tokens, values - values.sum() / n.clamp(min=1), 0.0)
        centred = _exact_zero_spread(centred, values, tokens)
        root = ((centred**2).sum() / (n - 1).clamp(min=1) + eps).sqrt()
        return safe_divide(centred, root.expand_as(centred))
    if how != "sequence":
        raise ValueError(f"batch_norm must be 'sequence', 'token' or 'none', got {how!r}")
    n = scorable.sum().to(advantage.dtype)
    ddof = 1.0 if std == "unbiased" else 0.0
    centred = torch.where(scorable, advantage - torch.where(scorable, advantage, 0.0).sum() / n.clamp(min=1), 0.0)
    centred = _exact_zero_spread(centred, advantage, scorable)
    spread = ((centred**2).sum() / (n - ddof).clamp(min=1)).sqrt()
    normalized = safe_divide(centred, (spread + eps).expand_as(centred))
    return per_token(torch.where(scorable & (n > ddof), normalized, 0.0), mask)


class GDPOAdvantage(BoundEstimator):
    """GDPO: each reward function normalized within its group, then summed and normalized over the batch (https://arxiv.org/abs/2601.05242)."""

    reads = ("reward_scores", "reward_weights", "scores", "group_ids", "mask", "reward_names")


@GDPOAdvantage.binds
def gdpo_advantages(
    reward_scores: Tensor | None, reward_weights: Tensor | None, scores: Tensor, group_ids: Tensor, mask: Tensor,
    reward_names: tuple[str, ...] | None = None, *, scale_by_std: bool = True, std: str = "unbiased",
    eps: float = 1e-6, batch_norm: str = "sequence", batch_eps: float = 1e-6,
) -> Tensor:
    """GDPO's advantages (Group reward-Decoupled normalization Policy Optimization, Liu et al. 2026,
    https://arxiv.org/abs/2601.05242).

    ``A_k,i = (r_k,i - mean_g(r_k)) / (std_g(r_k) + eps)`` for each reward function ``k`` over the
    scorable completions of row ``i``'s group ``g`` (GRPO's normalization, function by function),
    ``a_i = sum_k w_k A_k,i``, then ``a`` normalized over the batch (``batch_norm``). A function's
    ``NaN`` score is left out of its statistics and adds 0 to ``a_i``; a row whose ``scores`` is
    ``NaN`` (every function said None) gets 0 and is left out of the batch statistics. A
    function whose scores are equal within a group adds 0 for that group, whatever the others do.

    Args:
        reward_scores: ``float (B, F)`` each function's scores, or None for the one column ``scores``.
        reward_weights: ``float (F,)`` their weights, or None for all 1.
        scores: ``float (B,)`` the weighted total (``NaN`` = unscorable row).
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        reward_names: the columns' names; a ``kl_penalty`` column (the KL in the reward) is
            normalized like the others, so ``beta`` cancels out: warned once.
        scale_by_std, std, eps: the per-function group normalization, as ``grpo``'s.
        batch_norm: ``"sequence"``, ``"token"`` or ``"none"``; batch_eps: its constant.

    Returns:
        ``float (B, T)``, zero on padding and on unscorable rows. With one reward function and
        ``batch_norm="none"`` it is ``grpo``'s advantage with the same options.
    """
    scores = check_scores(scores, mask)
    table = scores[:, None] if reward_scores is None else reward_scores.to(scores.dtype)
    weights = torch.ones(table.shape[1], dtype=scores.dtype, device=scores.device) if reward_weights is None \
        else reward_weights.to(scores.device, scores.dtype)
    if table.dim() != 2 or table.shape[0] != scores.shape[0] or weights.shape != (table.shape[1],):
        raise ValueError(
            f"gdpo: reward_scores must be (B, F) and reward_weights (F,) with B = {scores.shape[0]}; got "
            f"{tuple(table.shape)} and {tuple(weights.shape)}"
        )
    if reward_names is not None and "kl_penalty" in reward_names:
        warnings.warn("gdpo normalizes the KL-in-reward column (algorithm.kl.placement: reward) like every reward "
                      "function, so its beta has no effect; put the KL in the loss to keep beta's meaning",
                      UserWarning, stacklevel=2)
    summed = torch.zeros_like(scores)
    for k in range(table.shape[1]):
        column = grpo_sequence_advantages(table[:, k], group_ids, scale_by_std=scale_by_std, std=std, eps=eps)
        summed = summed + weights[k] * column
    return normalize_over_batch(summed, ~torch.isnan(scores), mask, how=batch_norm, std=std, eps=batch_eps)


@hookimpl
def register_advantage_estimators(register):
    register.add("gdpo", GDPOAdvantage, options=GDPOOptions)
