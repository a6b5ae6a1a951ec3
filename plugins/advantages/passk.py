"""Advantage estimator ``passk``: Pass@k training (Chen et al. 2025,
https://arxiv.org/abs/2508.10751), each completion's advantage for its group's pass@k, in closed
form. Conventions: :mod:`grpo_plugins.advantages`.
"""

from __future__ import annotations

import math

import torch
from grpo_plugins.advantages.common import PAPER_EPS_DESCRIPTION, BoundEstimator
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.groups import check_scores, group_index, group_sum, per_token
from grpo_core.options import Options

__all__ = ["PassKAdvantage", "PassKOptions", "passk_advantages", "passk_group_advantages"]


class PassKOptions(Options):
    """Options of ``passk`` (Chen et al. 2025, Pass@k Training, https://arxiv.org/abs/2508.10751)."""

    k: int = Field(
        ...,
        ge=1,
        description="k of the group's pass@k (Chen et al. 2025, https://arxiv.org/abs/2508.10751), 1 <= k <= G. "
        "With n scorable completions of which c are correct (binary rewards 0/1), rho = 1 - C(n-c, k)/C(n, k), "
        "sigma = sqrt(rho (1 - rho)); a correct completion gets (1 - rho)/(sigma + eps), a wrong one "
        "(1 - rho - C(n-c-1, k-1)/C(n-1, k-1))/(sigma + eps). k = 1 is GRPO's advantage (population std).",
    )
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=PAPER_EPS_DESCRIPTION)


def _ratio_of_combs(top: int, bottom: int, k: int) -> float:
    """``C(top, k) / C(bottom, k)`` exactly (0 when ``top < k``); needs ``bottom >= k``."""
    return math.comb(top, k) / math.comb(bottom, k) if top >= k else 0.0


def passk_group_advantages(n: int, c: int, k: int, eps: float = 1e-6) -> tuple[float, float]:
    """The pass@k advantages ``(correct, wrong)`` of a group of ``n`` completions, ``c`` correct.

    Chen et al. 2025 (https://arxiv.org/abs/2508.10751), analytical form:
    ``rho = 1 - C(n-c, k)/C(n, k)`` is the mean pass@k over the ``C(n, k)`` subsets of size
    ``k``, ``sigma = sqrt(rho (1 - rho))`` its std; a correct completion's expected subset
    reward is 1, a wrong one's ``1 - C(n-c-1, k-1)/C(n-1, k-1)``; each minus ``rho``, divided
    by ``sigma + eps``. ``(0, 0)`` when ``sigma = 0`` (every subset passes, or none does).
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={n}")
    rho = 1.0 - _ratio_of_combs(n - c, n, k)
    sigma = math.sqrt(rho * (1.0 - rho))
    if sigma == 0.0:
        return 0.0, 0.0
    wrong_reward = 1.0 - _ratio_of_combs(n - c - 1, n - 1, k - 1)
    return (1.0 - rho) / (sigma + eps), (wrong_reward - rho) / (sigma + eps)


class PassKAdvantage(BoundEstimator):
    """Pass@k training: each completion's advantage for its group's pass@k, closed form (https://arxiv.org/abs/2508.10751)."""


@PassKAdvantage.binds
def passk_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, *, k: int, eps: float = 1e-6) -> Tensor:
    """Pass@k training advantages (Chen et al. 2025, https://arxiv.org/abs/2508.10751).

    Each group's reward is its pass@k; each completion gets the advantage of that reward
    averaged over the size-``k`` subsets that contain it, in closed form
    (:func:`passk_group_advantages`). With ``k = 1`` it is GRPO's
    ``(r_i - mean(r)) / (std(r) + eps)`` with the population std.

    Args:
        scores: ``float (B,)`` binary rewards, each 0 or 1; ``NaN`` = unscorable (left out,
            advantage 0).
        group_ids: ``long (B,)``.
        mask: ``bool (B, T)``.
        k: the ``k`` of pass@k, at most the largest group's size.
        eps: added to ``sigma``.

    Returns:
        ``float (B, T)``: zero on padding, on unscorable rows, in groups where every or no
        ``k``-subset passes, and in groups with fewer than ``k`` scorable completions.

    Raises:
        ValueError: a scorable reward is not 0 or 1, or ``k`` exceeds every group's size.
    """
    scores = check_scores(scores, mask)
    valid = ~torch.isnan(scores)
    bad = valid & (scores != 0) & (scores != 1)
    if bad.any():
        rows = torch.nonzero(bad).flatten().tolist()
        raise ValueError(
            f"pass@k needs binary rewards, each 0 or 1; rows {rows[:8]} have {scores[bad][:8].tolist()} (use a 0/1 "
            "reward such as accuracy alone, and put the KL penalty in the loss, not in the reward)"
        )
    inverse, n_groups = group_index(group_ids, scores.shape[0])
    sizes = torch.bincount(inverse, minlength=n_groups)
    if k > int(sizes.max()):
        raise ValueError(f"pass@k: k={k} exceeds the group size {int(sizes.max())}; choose 1 <= k <= G")
    n = group_sum(valid.to(torch.float64), inverse, n_groups).long().tolist()
    c = group_sum(torch.where(valid, scores, 0.0).to(torch.float64), inverse, n_groups).long().tolist()
    pairs = [passk_group_advantages(ni, ci, k, eps) if ni >= k else (0.0, 0.0) for ni, ci in zip(n, c)]
    table = torch.tensor(pairs, dtype=torch.float64).reshape(n_groups, 2)
    per_row = torch.where(scores == 1, table[inverse, 0], table[inverse, 1]).to(scores.dtype)
    return per_token(torch.where(valid, per_row, 0.0), mask)


@hookimpl
def register_advantage_estimators(register):
    register.add("passk", PassKAdvantage, options=PassKOptions)
