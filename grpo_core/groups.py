"""Per-group statistics for advantage estimators: the helpers the built-in estimators use,
public so that a plugin author never re-implements group means.

Rows are grouped by ``group_ids long (B,)`` (any ids; the rows of a group need not be
contiguous). A ``NaN`` score marks an unscorable completion: the helpers that take
``valid`` leave it out of every statistic. Shapes as in :mod:`grpo_core.contracts`.

Typical use, an estimator that centres rewards on the group mean::

    from grpo_core.groups import check_scores, group_mean, per_token

    def centred(inputs):
        scores = check_scores(inputs.scores, inputs.mask)
        advantage = (scores - group_mean(scores, inputs.group_ids)).nan_to_num(0.0)  # unscorable: 0
        return per_token(advantage, inputs.mask)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpo_core.contracts import masked_fill_zero

__all__ = [
    "group_index",
    "group_sum",
    "group_is_constant",
    "group_mean",
    "group_std",
    "safe_divide",
    "per_token",
    "check_scores",
]


def group_index(group_ids: Tensor, rows: int) -> tuple[Tensor, int]:
    """``inverse long (B,)`` mapping each row to a dense group index ``0..n-1``, and ``n``."""
    if group_ids.dim() != 1 or group_ids.shape[0] != rows:
        raise ValueError(f"group_ids must have shape (B,) = ({rows},); got {tuple(group_ids.shape)}")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def group_sum(values: Tensor, inverse: Tensor, n: int) -> Tensor:
    """Sum of ``values (B,)`` per group: ``(n,)``; ``inverse``, ``n`` from :func:`group_index`."""
    return values.new_zeros(n).index_add(0, inverse, values)


def group_is_constant(values: Tensor, valid: Tensor, inverse: Tensor, n: int) -> Tensor:
    """``bool (n,)``: the group's valid values are all exactly equal (or fewer than two)."""
    inf = torch.tensor(math.inf, dtype=values.dtype, device=values.device)
    hi = values.new_full((n,), -math.inf).scatter_reduce(0, inverse, torch.where(valid, values, -inf), reduce="amax")
    lo = values.new_full((n,), math.inf).scatter_reduce(0, inverse, torch.where(valid, values, inf), reduce="amin")
    return hi <= lo


def group_mean(scores: Tensor, group_ids: Tensor) -> Tensor:
    """``float (B,)``: the mean of the scorable (non-NaN) scores of each row's group
    (0 for a group without any)."""
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    count = group_sum(valid.to(scores.dtype), inverse, n)
    return (group_sum(torch.where(valid, scores, 0.0), inverse, n) / count.clamp(min=1))[inverse]


def group_std(scores: Tensor, group_ids: Tensor, *, unbiased: bool = False) -> Tensor:
    """``float (B,)``: the std of the scorable scores of each row's group, dividing by
    ``n`` (DeepSeekMath's GRPO) or, with ``unbiased``, by ``n - 1`` (``torch.std``);
    0 for a group with fewer than ``2`` (unbiased) or ``1`` scorable scores."""
    inverse, n = group_index(group_ids, scores.shape[0])
    valid = ~torch.isnan(scores)
    count = group_sum(valid.to(scores.dtype), inverse, n)
    centred = torch.where(valid, scores - group_mean(scores, group_ids), 0.0)
    ddof = 1.0 if unbiased else 0.0
    return (group_sum(centred**2, inverse, n) / (count - ddof).clamp(min=1)).sqrt()[inverse]


def safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` where the denominator is > 0, else 0."""
    ok = denominator > 0
    return torch.where(ok, numerator / torch.where(ok, denominator, 1.0), 0.0)


def per_token(per_row: Tensor, mask: Tensor) -> Tensor:
    """Broadcast ``(B,)`` to ``(B, T)``, exactly zero where ``mask`` is False."""
    return masked_fill_zero(per_row[:, None].expand(mask.shape), mask)


def check_scores(scores: Tensor, mask: Tensor) -> Tensor:
    """``scores`` as a float tensor after checking ``scores (B,)`` and ``mask (B, T)`` agree
    and that no score is infinite (``NaN``, unscorable, is allowed)."""
    if mask.dim() != 2 or scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"scores must be (B,) and mask (B, T) with the same B; got scores "
            f"{tuple(scores.shape)} and mask {tuple(mask.shape)}"
        )
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    if torch.isinf(scores).any():
        rows = torch.nonzero(torch.isinf(scores)).flatten().tolist()
        raise ValueError(f"scores must be finite, or NaN for an unscorable completion; rows {rows} are infinite")
    return scores
