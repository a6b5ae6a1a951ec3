"""More advantage estimators: ``passk``, ``opo``, ``gpg``, ``remax``,
``reinforce++-no-baseline``.

Same conventions as :mod:`grpo_plugins.advantages`: each maps
:class:`~grpo_core.contracts.AdvantageInputs` to advantages ``float (B, T)``, exactly zero
where ``inputs.mask`` is False; rows are grouped by ``inputs.group_ids``; a ``NaN`` score
marks an unscorable completion, left out of every statistic and given advantage 0.
``remax`` declares ``needs_greedy_baseline``: the engine then fills
``inputs.baseline_scores`` with the score of one greedy completion per prompt.

Shape vocabulary: ``P`` prompts, ``G`` group size, ``B = P*G`` rows, ``T`` completion
tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from grpo_plugins.advantages import grpo_sequence_advantages, masked_whiten
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs
from grpo_core.groups import check_scores, group_index, group_is_constant, group_mean, group_sum, per_token
from grpo_core.options import Options

__all__ = [
    "PassKOptions",
    "OPOOptions",
    "GPGOptions",
    "ReMaxOptions",
    "ReinforceNoBaselineOptions",
    "passk_advantages",
    "opo_advantages",
    "gpg_advantages",
    "remax_advantages",
    "reinforce_no_baseline_advantages",
]

_EPS_DOC = "Added to the standard deviation before dividing, >= 0 (1e-6 as the paper's code and verl)."


# --------------------------------------------------------------------------- options
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
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=_EPS_DOC)


class OPOOptions(Options):
    """``opo`` has no options: A_i = r_i - sum_j |o_j| r_j / sum_j |o_j| over the group, the
    length-weighted mean baseline of On-Policy RL with Optimal reward baseline (Hao et al. 2025,
    https://arxiv.org/abs/2505.23585)."""


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
    eps: float = Field(1e-6, ge=0.0, allow_inf_nan=False, description=_EPS_DOC)


class ReMaxOptions(Options):
    """Options of ``remax`` (Li et al. 2023, https://arxiv.org/abs/2310.10505)."""

    missing_baseline: Literal["zero", "group-mean"] = Field(
        "zero",
        description="ReMax (https://arxiv.org/abs/2310.10505) uses A_i = r_i - r(greedy completion of the "
        "prompt). When the greedy completion is unscorable (a reward function returned None): 'zero' gives "
        "the prompt's rows advantage 0 (default), 'group-mean' falls back to the mean of the group's rewards.",
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
    eps: float = Field(
        1e-8,
        gt=0.0,
        allow_inf_nan=False,
        description="Added to the token variance before the square root when whitening, > 0 (verl's 1e-8).",
    )


# --------------------------------------------------------------------------- pass@k
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


class PassKAdvantage:
    """Pass@k training: each completion's advantage for its group's pass@k, closed form (https://arxiv.org/abs/2508.10751)."""

    def __init__(self, options: PassKOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return passk_advantages(inputs.scores, inputs.group_ids, inputs.mask, k=self.options.k, eps=self.options.eps)


# --------------------------------------------------------------------------- opo
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


class OPOAdvantage:
    """OPO: reward minus the group's length-weighted mean reward (https://arxiv.org/abs/2505.23585)."""

    def __init__(self, options: OPOOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return opo_advantages(inputs.scores, inputs.group_ids, inputs.mask)


# --------------------------------------------------------------------------- gpg
def gpg_advantages(
    scores: Tensor, group_ids: Tensor, mask: Tensor, *, scale_by_std: bool = False, rescale: bool = True,
    eps: float = 1e-6,
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


class GPGAdvantage:
    """GPG: group-centred reward times B / (B - M) for the rows without signal (https://arxiv.org/abs/2504.02546)."""

    def __init__(self, options: GPGOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return gpg_advantages(inputs.scores, inputs.group_ids, inputs.mask, **self.options.model_dump())


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


# --------------------------------------------------------------------------- reinforce++ without baseline
def discounted_returns(scores: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``float (B, T)``: ``gamma^m * r_i`` on each token of row ``i``, ``m`` the number of
    ``mask`` tokens after it; the return of a reward placed on the row's last token and
    discounted once per completion token (tokens outside ``mask`` are not steps). Zero
    outside ``mask``."""
    after = mask.flip(1).cumsum(1).flip(1) - 1  # mask tokens at or after t, minus t itself
    returns = scores[:, None] * torch.pow(torch.as_tensor(gamma, dtype=scores.dtype), after.to(scores.dtype))
    return torch.where(mask, returns, 0.0)


def reinforce_no_baseline_advantages(
    scores: Tensor, mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> Tensor:
    """REINFORCE++ without a baseline (Hu et al., https://arxiv.org/abs/2501.03262; verl's
    ``reinforce_plus_plus``, OpenRLHF's ``reinforce``).

    The sequence reward ``r_i`` is put on the last completion token, returns are
    discounted per token (:func:`discounted_returns`, ``G_it = gamma^m r_i``), then
    whitened over every scorable token of the batch with
    :func:`~grpo_plugins.advantages.masked_whiten`: ``A_it = (G_it - m) / sqrt(v + eps)``.
    No group statistic: ``group_ids`` are not used. A KL penalty in the reward arrives
    summed into ``r_i`` (the engine's contract), so it sits on the last token where the
    paper spreads ``-beta KL_t`` over the tokens; with ``beta = 0`` the two agree.

    Args:
        scores: ``float (B,)``; ``NaN`` = unscorable (left out of the whitening, 0).
        mask: ``bool (B, T)``.
        gamma: discount, ``0 < gamma <= 1``.
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
    return masked_whiten(returns, scorable, eps)


class ReinforceNoBaselineAdvantage:
    """REINFORCE++ without baseline: discounted per-token returns, batch whitening (https://arxiv.org/abs/2501.03262)."""

    def __init__(self, options: ReinforceNoBaselineOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        return reinforce_no_baseline_advantages(inputs.scores, inputs.mask, gamma=self.options.gamma,
                                                eps=self.options.eps)


@hookimpl
def register_advantage_estimators(register):
    register.add("passk", PassKAdvantage, options=PassKOptions)
    register.add("opo", OPOAdvantage, options=OPOOptions)
    register.add("gpg", GPGAdvantage, options=GPGOptions)
    register.add("remax", ReMaxAdvantage, options=ReMaxOptions)
    register.add("reinforce++-no-baseline", ReinforceNoBaselineAdvantage, options=ReinforceNoBaselineOptions)
