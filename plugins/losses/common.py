"""What the built-in policy losses share: :class:`BoundPolicyLoss` (a loss function with its
options bound, the component every built-in loss is), the log-ratio and its clamp, the ratio
and clip metrics, and the validator of positive bounds. Shapes: ``(B, T)`` throughout, as in
:mod:`grpo_plugins.losses`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from grpo_plugins.binding import OptionsBound
from pydantic import ValidationInfo, field_validator
from torch import Tensor

from grpo_core.contracts import masked_fill_zero

__all__ = [
    "CLAMP_DESCRIPTION",
    "BoundPolicyLoss",
    "clamp_symmetric",
    "clip_metrics",
    "log_ratio",
    "positive",
    "positive_fields",
    "ratio_metrics",
]

CLAMP_DESCRIPTION = (
    "Clamp log(pi/pi_old) to [-c, c] before exp, so it cannot overflow (a clamped token gets no gradient); "
    "a positive number or null. Default 20, as verl."
)


class BoundPolicyLoss(OptionsBound):
    """A policy loss made of a pure loss function ``function(logp, old_logp, advantages, mask,
    **options)``; its rows with advantage 0 have loss 0 unless a subclass says otherwise."""

    reads = ("logp", "old_logp", "advantages", "mask")
    zero_advantage_is_zero_loss = True


# --------------------------------------------------------------------------- options
def positive(name: str, value: float | None, what: str, *, nullable: bool = True) -> float | None:
    """``value`` if it is a positive finite number (or None, when ``nullable``); else a
    ``ValueError`` saying what ``name`` is (``what``) and what is valid."""
    if value is None and nullable:
        return value
    if value is None or not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number ({what}){' or null' if nullable else ''}; "
                         f"got {value!r}")
    return value


def positive_fields(what: dict[str, str], nullable: tuple[str, ...] = ("log_ratio_clamp",)) -> Any:
    """A pydantic validator of the fields named in ``what``: each a positive finite number (or
    null, for the ``nullable`` ones), else :func:`positive`'s error saying what it is
    (``what[field]``). Assign it to a name in the options model's body."""

    def check(cls: type, value: float | None, info: ValidationInfo) -> float | None:
        return positive(info.field_name, value, what[info.field_name], nullable=info.field_name in nullable)

    return field_validator(*what)(check)


# --------------------------------------------------------------------------- tensors
def log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``logp - old_logp`` with padding replaced by 0 first: ``(B, T)``, with grad through ``logp``."""
    return masked_fill_zero(logp, mask) - masked_fill_zero(old_logp, mask)


def clamp_symmetric(x: Tensor, bound: float | None) -> Tensor:
    """``x`` clamped to ``[-bound, bound]`` (no gradient where the clamp is active); ``x``
    itself when ``bound`` is None."""
    return x if bound is None else x.clamp(-bound, bound)


# --------------------------------------------------------------------------- metrics
def ratio_metrics(ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``ratio`` and ``ratio/max``: the ratio, detached, zero on padding."""
    shown = masked_fill_zero(ratio.detach(), mask)
    return {"ratio": shown, "ratio/max": shown}


def clip_metrics(low: Tensor, high: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """``clip/low``, ``clip/high`` and ``clip/region`` ``(B, T)`` from the tokens clipped below
    and above (bool, already masked)."""
    return {"clip/low": low.to(dtype), "clip/high": high.to(dtype), "clip/region": (low | high).to(dtype)}
