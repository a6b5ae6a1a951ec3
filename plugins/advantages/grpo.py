"""Advantage estimators ``grpo``, ``dapo-token-scale``, ``gpg`` and ``opo``: the reward centred
on its group's mean (DeepSeekMath's GRPO, https://arxiv.org/abs/2402.03300), divided by the group's
std, and its variants: DAPO's per-completion token scale, GPG's rescale for the rows without
signal, OPO's length-weighted baseline. Conventions: :mod:`grpo_plugins.advantages`.
"""

from __future__ import annotations

from typing import Literal

import torch
from grpo_plugins.advantages.common import EPS_DESCRIPTION, PAPER_EPS_DESCRIPTION, BoundEstimator
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.groups import check_scores, group_index, group_is_constant, group_sum, per_token, safe_divide
from grpo_core.options import Options

__all__ = [
    "DAPOTokenScaleAdvantage", "GPGAdvantage", "GPGOptions", "GRPOAdvantage", "GRPOOptions", "OPOAdvantage",
    "OPOOptions", "dapo_token_scale_advantages", "gpg_advantages", "grpo_outcome_advantages",
    "grpo_sequence_advantages", "opo_advantages",
]


# --------------------------------------------------------------------------- options
class GRPOOptions(Options):
    """Options of ``grpo`` and ``dapo-token-scale``."""

    scale_by_std: bool = Field(
        True,
        description="Divide the centred rewards by their std, as DeepSeekMath's GRPO (default). False is "
        "Dr. GRPO's r_i - mean(r) (https://arxiv.org/abs/2503.20783).",
    )
    std: Literal["population", "unbiased"] = Field(
        "population",
        description="'population' divides by n (DeepSeekMath's formula, default); 'unbiased' by n - 1, "
        "as TRL and verl (torch.std).",
    )
    std_scope: Literal["group", "batch"] = Field(
        "group",
        description="'group' takes the std over each prompt's rewards (DeepSeekMath, default); 'batch' "
        "one std over the whole batch, the mean staying per group (TRL's scale_rewards='batch').",
    )
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=EPS_DESCRIPTION)


class GPGOptions(Options):
    """Options of ``gpg`` (Group Policy Gradient, Chu et al. 2025, https://arxiv.org/abs/2504.02546)."""

    scale_by_std: bool = Field(
        False,
        description="F_norm of GPG (https://arxiv.org/abs/2504.02546): False divides the centred reward "
        "r_i - mean(r) by 1 (the paper's default), True by the group's std (n - 1, as the paper's code) + eps.",
    )
    rescale: bool = Field(
        True,
        description="GPG's accurate gradient estimation: multiply every advantage by alpha = B / (B - M), B the "
        "rows of the batch, M the rows whose advantage is forced to 0 (groups whose rewards are all equal, "
        "unscorable rows), so the batch mean of the gradient is not shrunk by them. False: alpha = 1.",
    )
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=PAPER_EPS_DESCRIPTION)


class OPOOptions(Options):
    """``opo`` has no options: A_i = r_i - sum_j |o_j| r_j / sum_j |o_j| over the group, the
    length-weighted mean baseline of On-Policy RL with Optimal reward baseline (Hao et al. 2025,
    https://arxiv.org/abs/2505.23585)."""


# --------------------------------------------------------------------------- grpo
def grpo_sequence_advantages(
    scores: Tensor, group_ids: Tensor, *,
    scale_by_std: bool = True, std: str = "population", std_scope: str = "group", eps: float = 1e-6,
) -> Tensor:
    """Per-completion GRPO advantages ``(B,)``; see :func:`grpo_outcome_advantages`."""
    if std not in ("population", "unbiased") or std_scope not in ("group", "batch"):
        raise ValueError(
            f"std must be 'population' or 'unbiased' and std_scope 'group' or 'batch'; "
            f"got std={std!r}, std_scope={std_scope!r}"
        )
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    r = torch.where(valid, scores, 0.0)
    count = group_sum(valid.to(r.dtype), inverse, n)
    mean = group_sum(r, inverse, n) / count.clamp(min=1)
    centered = torch.where(valid, r - mean[inverse], 0.0)
    degenerate = group_is_constant(r, valid, inverse, n)[inverse]
    if scale_by_std:
        ddof = 1.0 if std == "unbiased" else 0.0
        if std_scope == "batch":
            total = valid.sum().to(r.dtype)
            deviation = torch.where(valid, r - r.sum() / total.clamp(min=1), 0.0)
            var = (deviation**2).sum() / (total - ddof).clamp(min=1)
        else:
            var = (group_sum(centered**2, inverse, n) / (count - ddof).clamp(min=1))[inverse]
        centered = safe_divide(centered, var.sqrt() + eps)
    return torch.where(degenerate | ~valid, 0.0, centered)


class GRPOAdvantage(BoundEstimator):
    """Outcome-supervision group-relative advantage (DeepSeekMath, https://arxiv.org/abs/2402.03300)."""


@GRPOAdvantage.binds
def grpo_outcome_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *,
    scale_by_std: bool = True, std: str = "population", std_scope: str = "group", eps: float = 1e-6,
) -> Tensor:
    """GRPO outcome-supervision advantages (DeepSeekMath, https://arxiv.org/abs/2402.03300).

    ``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the scorable completions of the prompt
    of row ``i``, the same value on every token of completion ``i``.

    Args:
        scores: ``float (B,)`` rewards; ``NaN`` = unscorable: left out of mean and std,
            advantage 0.
        group_ids: ``long (B,)`` prompt of each row; rows of a group need not be contiguous.
        mask: ``bool (B, T)`` completion tokens.
        scale_by_std: divide by ``std + eps``; False is Dr. GRPO's ``r_i - mean(r)``.
        std: ``"population"`` (divide by n) or ``"unbiased"`` (by n - 1).
        std_scope: ``"group"`` (std per prompt) or ``"batch"`` (one std of all scorable
            rewards around the batch mean; the mean subtracted stays per group).
        eps: added to the std.

    Returns:
        ``float (B, T)``; exactly 0 on padding, for unscorable rows, and for every row of a
        group whose scorable rewards are all exactly equal (or that has fewer than two).
    """
    scores = check_scores(scores, mask)
    per_row = grpo_sequence_advantages(
        scores, group_ids, scale_by_std=scale_by_std, std=std, std_scope=std_scope, eps=eps
    )
    return per_token(per_row, mask)


# --------------------------------------------------------------------------- dapo token scale
class DAPOTokenScaleAdvantage(BoundEstimator):
    """GRPO advantages scaled by |o_i| * B / sum_j |o_j| (DAPO's token-level loss, https://arxiv.org/abs/2503.14476)."""


@DAPOTokenScaleAdvantage.binds
def dapo_token_scale_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, **grpo_options) -> Tensor:
    """GRPO advantages scaled per completion for DAPO's token-level loss
    (https://arxiv.org/abs/2503.14476).

    ``A'_i = A_i * |o_i| * B / sum_j |o_j|`` with ``A_i`` from
    :func:`grpo_outcome_advantages`, ``|o_i| = mask[i].sum()``, ``B`` rows. Then
    ``1/B sum_i 1/|o_i| sum_t A'_i l_t = 1/sum_j |o_j| sum_i sum_t A_i l_t``: aggregated
    with ``seq-mean-token-mean`` the loss equals GRPO's with ``token-mean`` when the
    mini-batch is this whole batch.

    Args:
        scores, group_ids, mask: as :func:`grpo_outcome_advantages` (``(B,)``, ``(B,)``,
            ``(B, T)``).
        grpo_options: ``scale_by_std``, ``std``, ``std_scope``, ``eps`` of ``grpo``.

    Returns:
        ``float (B, T)``, zero on padding; all zero when the batch has no tokens.
    """
    advantages = grpo_outcome_advantages(scores, group_ids, mask, **grpo_options)
    lengths = mask.sum(dim=1).to(advantages.dtype)
    scale = safe_divide(lengths * mask.shape[0], lengths.sum().expand_as(lengths))
    return advantages * scale[:, None]


# --------------------------------------------------------------------------- gpg
class GPGAdvantage(BoundEstimator):
    """GPG: group-centred reward times B / (B - M) for the rows without signal (https://arxiv.org/abs/2504.02546)."""


@GPGAdvantage.binds
def gpg_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *,
    scale_by_std: bool = False, rescale: bool = True, eps: float = 1e-6,
) -> Tensor:
    """GPG's advantages (Group Policy Gradient, Chu et al. 2025, https://arxiv.org/abs/2504.02546).

    ``A_i = alpha * (r_i - mean(r)) / F_norm`` over the scorable completions of row ``i``'s
    group; ``F_norm`` is 1 or, with ``scale_by_std``, the group's std (``n - 1``) plus
    ``eps``; ``alpha = B / (B - M)`` with ``B`` the rows of the batch and ``M`` those whose
    advantage is forced to 0 (every row of a group whose scorable rewards are all equal,
    and every unscorable row), or 1 without ``rescale``. ``alpha`` is a batch statistic:
    the engine passes the whole step's batch.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable.
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        scale_by_std, rescale, eps: as above.

    Returns:
        ``float (B, T)``, zero on padding, on unscorable rows and in constant groups; all
        zero when every row is such.
    """
    scores = check_scores(scores, mask)
    centred = grpo_sequence_advantages(scores, group_ids, scale_by_std=scale_by_std, std="unbiased", eps=eps)
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    zeroed = (~valid) | group_is_constant(torch.where(valid, scores, 0.0), valid, inverse, n)[inverse]
    kept = int((~zeroed).sum())
    alpha = scores.shape[0] / kept if rescale and kept else 1.0
    return per_token(alpha * centred, mask)


# --------------------------------------------------------------------------- opo
class OPOAdvantage(BoundEstimator):
    """OPO: reward minus the group's length-weighted mean reward (https://arxiv.org/abs/2505.23585)."""


@OPOAdvantage.binds
def opo_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor) -> Tensor:
    """OPO's advantages (On-Policy RL with Optimal reward baseline, Hao et al. 2025,
    https://arxiv.org/abs/2505.23585).

    ``A_i = r_i - b``, ``b = sum_j |o_j| r_j / sum_j |o_j|`` over the scorable completions
    of row ``i``'s group, ``|o_j| = mask[j].sum()``: the optimal baseline
    ``E[|grad log pi|^2 r] / E[|grad log pi|^2]`` with the squared gradient norm taken
    proportional to the length. The same value on every token.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable (left out, advantage 0).
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``: its row sums are the lengths (tokens that are trained).

    Returns:
        ``float (B, T)``; 0 on padding, on unscorable rows and in groups whose scorable
        rewards are all equal (or that have fewer than two).
    """
    scores = check_scores(scores, mask)
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    r = torch.where(valid, scores, 0.0)
    lengths = torch.where(valid, mask.sum(dim=1).to(r.dtype), 0.0)
    weight = group_sum(lengths, inverse, n)
    baseline = torch.where(weight > 0, group_sum(lengths * r, inverse, n) / weight.clamp(min=1), 0.0)
    degenerate = group_is_constant(r, valid, inverse, n)[inverse]
    return per_token(torch.where(degenerate | ~valid, 0.0, r - baseline[inverse]), mask)


@hookimpl
def register_advantage_estimators(register):
    register.add("grpo", GRPOAdvantage, options=GRPOOptions)
    register.add("dapo-token-scale", DAPOTokenScaleAdvantage, options=GRPOOptions)
    register.add("gpg", GPGAdvantage, options=GPGOptions)
    register.add("opo", OPOAdvantage, options=OPOOptions)
