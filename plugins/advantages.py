"""Built-in advantage estimators: ``grpo``, ``process``, ``dapo-token-scale``, ``rloo``,
``reinforce++``.

Every estimator maps :class:`~grpo_core.contracts.AdvantageInputs` to advantages
``float (B, T)``, exactly zero where ``inputs.mask`` is False. Rows are grouped by
``inputs.group_ids`` (any ids, rows of one group need not be contiguous). A ``NaN`` score
marks an unscorable completion: it is left out of every statistic and gets advantage 0.

Shape vocabulary: ``P`` prompts, ``G`` group size, ``B = P*G`` rows, ``T`` completion
tokens, ``K`` steps per completion (process supervision).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs, masked_fill_zero
from grpo_core.groups import check_scores, group_index, group_is_constant, group_sum, per_token, safe_divide
from grpo_core.options import Options

__all__ = [
    "GRPOOptions",
    "ProcessOptions",
    "ReinforcePlusPlusOptions",
    "grpo_outcome_advantages",
    "process_advantages",
    "dapo_token_scale_advantages",
    "rloo_advantages",
    "reinforce_plus_plus_advantages",
    "masked_whiten",
]

_EPS_DOC = "Added to the standard deviation before dividing, >= 0 (verl's default 1e-6)."


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
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=_EPS_DOC)


class ProcessOptions(Options):
    """Options of ``process``."""

    scale_by_std: bool = Field(
        True,
        description="Divide the centred step scores by the group's step-score std (DeepSeekMath's "
        "process supervision, default). False keeps r - mean(R) only.",
    )
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=_EPS_DOC)


class ReinforcePlusPlusOptions(Options):
    """Options of ``reinforce++``."""

    eps: float = Field(
        1e-8,
        gt=0.0,
        allow_inf_nan=False,
        description="Added to the token variance before the square root when whitening, > 0 (verl's "
        "masked_whiten constant 1e-8).",
    )


# --------------------------------------------------------------------------- grpo
def grpo_sequence_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    scale_by_std: bool = True,
    std: str = "population",
    std_scope: str = "group",
    eps: float = 1e-6,
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


def grpo_outcome_advantages(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    scale_by_std: bool = True,
    std: str = "population",
    std_scope: str = "group",
    eps: float = 1e-6,
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


class GRPOAdvantage:
    """Outcome-supervision group-relative advantage (DeepSeekMath, https://arxiv.org/abs/2402.03300)."""

    def __init__(self, options: GRPOOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return grpo_outcome_advantages(
            inputs.scores, inputs.group_ids, inputs.mask, **self.options.model_dump()
        )


# --------------------------------------------------------------------------- dapo token scale
def dapo_token_scale_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, **grpo_options
) -> Tensor:
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


class DAPOTokenScaleAdvantage:
    """GRPO advantages scaled by |o_i| * B / sum_j |o_j| (DAPO's token-level loss, https://arxiv.org/abs/2503.14476)."""

    def __init__(self, options: GRPOOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return dapo_token_scale_advantages(
            inputs.scores, inputs.group_ids, inputs.mask, **self.options.model_dump()
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
def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the ``n`` positions where ``mask`` is True.

    ``var`` uses Bessel's correction (divides by ``n - 1``), as verl's ``masked_whiten``;
    with ``n < 2`` the centred values are 0 and so is the result.

    Args:
        values: ``float (B, T)``.
        mask: ``bool (B, T)``.
        eps: added to the variance.

    Returns:
        ``float (B, T)``, zero where ``mask`` is False.
    """
    n = mask.sum().to(values.dtype)
    mean = torch.where(mask, values, 0.0).sum() / n.clamp(min=1)
    centered = torch.where(mask, values - mean, 0.0)
    var = (centered**2).sum() / (n - 1).clamp(min=1)
    return masked_fill_zero(centered * torch.rsqrt(var + eps), mask)


def reinforce_plus_plus_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, eps: float = 1e-8
) -> Tensor:
    """REINFORCE++ with a group-mean baseline (Hu et al., https://arxiv.org/abs/2501.03262).

    ``a_i = r_i - mean(r)`` over the scorable completions of row ``i``'s group, broadcast
    to its tokens, then whitened over every valid token of the batch with
    :func:`masked_whiten`: ``A_it = (a_i - m) / sqrt(v + eps)``, ``m`` and ``v`` the mean
    and Bessel-corrected variance of ``a`` over those tokens (verl's
    ``reinforce_plus_plus_baseline``). Longer completions weigh more in ``m`` and ``v``.

    Differences from verl, both so that ``NaN`` and tiny groups behave as in ``grpo``: the
    tokens of unscorable rows are left out of the whitening and get 0, and a group with a
    single scorable completion gets baseline ``r_i`` (so ``a_i = 0``) where verl uses 0.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable.
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        eps: added to the variance before the square root.

    Returns:
        ``float (B, T)``, zero on padding and on unscorable rows.
    """
    scores = check_scores(scores, mask)
    baseline_adv = grpo_sequence_advantages(scores, group_ids, scale_by_std=False)
    scorable = mask & ~torch.isnan(scores)[:, None]
    return masked_whiten(per_token(baseline_adv, scorable), scorable, eps)


class ReinforcePlusPlusAdvantage:
    """REINFORCE++ with group-mean baseline and batch whitening (https://arxiv.org/abs/2501.03262)."""

    def __init__(self, options: ReinforcePlusPlusOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return reinforce_plus_plus_advantages(
            inputs.scores, inputs.group_ids, inputs.mask, eps=self.options.eps
        )


# --------------------------------------------------------------------------- process
def _check_steps(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor]:
    """The step tensors, after checking they are present, shaped (B, K) and in range."""
    names = ("step_scores", "step_ends", "step_mask")
    missing = [name for name in names if getattr(inputs, name) is None]
    if missing:
        raise ValueError(
            "the 'process' advantage estimator needs per-step scores: inputs."
            + ", inputs.".join(missing)
            + " missing (use a process reward function that returns one score per step, "
            "or an outcome estimator such as 'grpo')"
        )
    scores, ends, step_mask = (getattr(inputs, name) for name in names)
    rows, length = inputs.mask.shape
    if (
        not (scores.shape == ends.shape == step_mask.shape)
        or scores.dim() != 2
        or scores.shape[0] != rows
    ):
        raise ValueError(
            f"step_scores, step_ends and step_mask must all be (B, K) with B = {rows}; got "
            f"{tuple(scores.shape)}, {tuple(ends.shape)}, {tuple(step_mask.shape)}"
        )
    step_mask = step_mask.bool()
    bad = step_mask & ((ends < 0) | (ends >= length))
    if bad.any():
        raise ValueError(
            f"step_ends must index completion tokens, 0 <= end < T = {length}; "
            f"out of range at (row, step) {torch.nonzero(bad).tolist()}"
        )
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    return scores, ends.long(), step_mask


def process_advantages(
    step_scores: Tensor,
    step_ends: Tensor,
    step_mask: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO process-supervision advantages (DeepSeekMath, https://arxiv.org/abs/2402.03300).

    ``rhat_ij = (r_ij - mean(R)) / (std(R) + eps)`` with one mean and one population std
    over every existing step of every completion of the group, then
    ``A_it = sum_{j : end_ij >= t} rhat_ij``: the sum over the steps that end at or after
    token ``t``. Computed by scattering ``rhat`` at the step ends and a reverse cumsum.

    Args:
        step_scores: ``float (B, K)``; a ``NaN`` step counts as absent.
        step_ends: ``long (B, K)`` token index in ``0..T-1`` where each step ends.
        step_mask: ``bool (B, K)`` which steps exist.
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        scale_by_std: divide by ``std + eps``; False keeps ``r_ij - mean(R)``.
        eps: added to the std.

    Returns:
        ``float (B, T)``; zero on padding, for rows without steps, and in groups whose
        step scores are all exactly equal (or that have a single step).
    """
    inverse, n = group_index(group_ids, mask.shape[0])
    if step_scores.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=step_scores.dtype, device=mask.device)
    exists = step_mask & ~torch.isnan(step_scores)
    r = torch.where(exists, step_scores, 0.0)
    count = group_sum(exists.sum(dim=1).to(r.dtype), inverse, n)
    mean = group_sum(r.sum(dim=1), inverse, n) / count.clamp(min=1)
    centered = torch.where(exists, r - mean[inverse][:, None], 0.0)
    row_hi = torch.where(exists, r, -math.inf).amax(dim=1)
    row_lo = torch.where(exists, r, math.inf).amin(dim=1)
    hi = r.new_full((n,), -math.inf).scatter_reduce(0, inverse, row_hi, reduce="amax")
    lo = r.new_full((n,), math.inf).scatter_reduce(0, inverse, row_lo, reduce="amin")
    if scale_by_std:
        var = group_sum((centered**2).sum(dim=1), inverse, n) / count.clamp(min=1)
        centered = safe_divide(centered, (var.sqrt() + eps)[inverse][:, None])
    normalized = torch.where(exists & (hi > lo)[inverse][:, None], centered, 0.0)
    at_ends = normalized.new_zeros(mask.shape).scatter_add(
        1, torch.where(exists, step_ends, 0), normalized
    )
    suffix = at_ends.flip(1).cumsum(1).flip(1)
    return masked_fill_zero(suffix, mask)


class ProcessAdvantage:
    """Process-supervision group-relative advantage: suffix sums of normalized step scores (https://arxiv.org/abs/2402.03300)."""

    #: The engine fills ``step_scores``/``step_ends``/``step_mask`` for it.
    needs_step_scores = True

    def __init__(self, options: ProcessOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        scores, ends, step_mask = _check_steps(inputs)
        return process_advantages(
            scores,
            ends,
            step_mask,
            inputs.group_ids,
            inputs.mask,
            scale_by_std=self.options.scale_by_std,
            eps=self.options.eps,
        )


@hookimpl
def register_advantage_estimators(register):
    register.add("grpo", GRPOAdvantage, options=GRPOOptions)
    register.add("process", ProcessAdvantage, options=ProcessOptions)
    register.add("dapo-token-scale", DAPOTokenScaleAdvantage, options=GRPOOptions)
    register.add("rloo", rloo)
    register.add("reinforce++", ReinforcePlusPlusAdvantage, options=ReinforcePlusPlusOptions)
