"""Rollout correction: importance weights for the gap between the sampler's log-probs and the
trainer's (a vLLM backend samples with other kernels and often another precision), as pure
functions. The engine multiplies each completion token's policy loss by the weight
(:func:`grpo_core.train.learner.update.micro_batch_loss`); options: ``algorithm.rollout_correction``.

With ``d_t = logp_trainer_old - logp_sampler`` on the completion tokens:

- ratio ``r``: per token ``exp(d_t)`` (``level="token"``) or per row ``exp(sum_t d_t)`` on each of
  its tokens (``level="sequence"``); ``level="off"`` gives weight 1;
- ``mode="truncate"``: ``w = min(r, cap)`` (truncated importance sampling, TIS: Yao et al.,
  "Your efficient RL framework secretly brings you off-policy RL training", 2025,
  https://fengyao.notion.site/off-policy-rl); ``mode="mask"``: ``w = r`` where ``r <= cap``, else 0;
- ``lower``: ``w = 0`` where ``r < lower``: with ``mode="mask"`` this is IcePop's two-sided mask
  ``M(r) = r if lower <= r <= cap else 0`` (Ring-1T, https://arxiv.org/abs/2510.18855);
- ``reject``: rejection sampling of whole rows: every token of a row whose sequence ratio
  (``geometric``: ``exp(mean_t d_t)``, length-invariant; ``product``: ``exp(sum_t d_t)``) lies outside
  ``[low, high]`` gets ``w = 0`` (verl's ``rollout_rs``, ``seq_mean_k1`` / ``seq_sum_k1`` with the
  threshold ``"{1/high}_{1/low}"``: verl's statistic is ``-log r``);
- ``normalize``: ``w / mean(w)``, the mean over the kept tokens (``token``) or kept rows
  (``sequence``) of the call, so that the kept weights average 1 (verl's
  ``rollout_is_batch_normalize`` averages over the batch, zeroed tokens included). The call is
  one micro-batch: ``train.micro_batch_size`` rows, or with it unset the whole groups within
  ``train.micro_batch_tokens`` positions.

Weights carry no gradient and are exactly 0 on padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo_core.contracts import masked_fill_zero

__all__ = ["importance_ratio", "accepted_rows", "normalized_weights", "rollout_correction"]

#: exp(80) is finite in float32; above it the cap decides.
_MAX_LOG_RATIO = 80.0


def importance_ratio(diff: Tensor, mask: Tensor, level: str) -> Tensor:
    """``r (b, T)`` from ``diff = trainer - sampler`` (zero on padding): ``exp(diff)`` per token,
    or ``exp(sum_t diff)`` broadcast over the row; 1 for ``level="off"``."""
    if level == "token":
        log_ratio = diff
    elif level == "sequence":
        log_ratio = diff.sum(dim=1, keepdim=True).expand_as(diff)
    elif level == "off":
        return torch.ones_like(diff)
    else:
        raise ValueError(f"rollout correction level must be 'off', 'token' or 'sequence', got {level!r}")
    return torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))


def accepted_rows(diff: Tensor, mask: Tensor, *, statistic: str, low: float, high: float) -> Tensor:
    """``bool (b,)``: rows whose sequence ratio lies in ``[low, high]``; the ratio is
    ``exp(mean_t diff)`` (``"geometric"``) or ``exp(sum_t diff)`` (``"product"``) over the row's
    ``mask`` tokens. A row without tokens has ratio 1."""
    total = masked_fill_zero(diff, mask).sum(dim=1)
    if statistic == "geometric":
        log_ratio = total / mask.sum(dim=1).clamp(min=1).to(diff.dtype)
    elif statistic == "product":
        log_ratio = total
    else:
        raise ValueError(f"rejection statistic must be 'geometric' or 'product', got {statistic!r}")
    ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
    return (ratio >= low) & (ratio <= high)


def normalized_weights(weight: Tensor, kept: Tensor, level: str) -> Tensor:
    """``weight / mean``: the mean of ``weight`` over the ``kept`` tokens (``level="token"``) or
    over the rows with a kept token, one weight per row (``"sequence"``). Unchanged when
    nothing is kept or the mean is 0. ``(b, T)`` in and out."""
    if level == "sequence":
        rows = kept.any(dim=1)
        per_row = masked_fill_zero(weight, kept).amax(dim=1)  # the row's one weight (0 if none kept)
        total, count = per_row[rows].sum(), rows.sum()
    else:
        total, count = masked_fill_zero(weight, kept).sum(), kept.sum()
    if int(count) == 0 or float(total) == 0.0:
        return weight
    return weight / (total / count)


def rollout_correction(
    trainer_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    *,
    level: str,
    mode: str,
    cap: float,
    lower: float | None = None,
    reject: tuple[str, float, float] | None = None,
    normalize: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights ``(b, T)`` for sampler/trainer mismatch, and their per-token metrics.

    See the module doc for each option. ``trainer_logp`` and ``sampler_logp`` are ``float (b, T)``
    (the trainer's detached here), ``mask`` ``bool (b, T)``; ``reject`` is ``(statistic, low,
    high)`` or None. Metrics (``(b, T)``, zero on padding): ``rollout_correction/weight``,
    ``/capped`` (``r > cap``), ``/below`` (``r < lower``, when set), ``/rejected`` (tokens of
    rejected rows, when set), ``/logp_diff`` (``|d|``) and its ``/max``, and ``/k3`` (the k3 estimate
    of KL(sampler || trainer), ``exp(d) - d - 1``).
    """
    diff = masked_fill_zero(trainer_logp.detach() - sampler_logp, mask)
    ratio = importance_ratio(diff, mask, level)
    capped = mask & (ratio > cap) & (level != "off")
    if mode == "truncate":
        weight = ratio.clamp(max=cap)
    elif mode == "mask":
        weight = masked_fill_zero(ratio, ~capped)
    else:
        raise ValueError(f"rollout correction mode must be 'truncate' or 'mask', got {mode!r}")
    kept = mask & ~capped if mode == "mask" else mask.clone()
    metrics = {"rollout_correction/capped": capped.to(diff.dtype)}
    if lower is not None and level != "off":
        below = mask & (ratio < lower)
        kept &= ~below
        metrics["rollout_correction/below"] = below.to(diff.dtype)
    if reject is not None:
        statistic, low, high = reject
        rejected = mask & ~accepted_rows(diff, mask, statistic=statistic, low=low, high=high)[:, None]
        kept &= ~rejected
        metrics["rollout_correction/rejected"] = rejected.to(diff.dtype)
    weight = masked_fill_zero(weight, kept)
    if normalize:
        weight = normalized_weights(weight, kept, level)
    metrics.update({
        "rollout_correction/weight": weight,
        "rollout_correction/logp_diff": diff.abs(),
        "rollout_correction/logp_diff/max": diff.abs(),
        "rollout_correction/k3": masked_fill_zero(torch.expm1(diff) - diff, mask),
    })
    return weight, metrics
