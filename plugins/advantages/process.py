"""Advantage estimator ``process``: GRPO's process supervision (DeepSeekMath,
https://arxiv.org/abs/2402.03300), suffix sums of the group-normalized scores of the reasoning
steps. Conventions: :mod:`grpo_plugins.advantages`.
"""

from __future__ import annotations

import math

import torch
from grpo_plugins.advantages.common import EPS_DESCRIPTION
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs, masked_fill_zero
from grpo_core.groups import group_index, group_sum, safe_divide
from grpo_core.options import Options

__all__ = ["ProcessAdvantage", "ProcessOptions", "process_advantages"]


class ProcessOptions(Options):
    """Options of ``process``."""

    scale_by_std: bool = Field(
        True,
        description="Divide the centred step scores by the group's step-score std (DeepSeekMath's "
        "process supervision, default). False keeps r - mean(R) only.",
    )
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=EPS_DESCRIPTION)


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
    step_scores: Tensor, step_ends: Tensor, step_mask: Tensor, group_ids: Tensor, mask: Tensor, *,
    scale_by_std: bool = True, eps: float = 1e-6,
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
    register.add("process", ProcessAdvantage, options=ProcessOptions)
