"""Built-in KL penalties: ``low_var_kl`` (k3, alias ``k3``), ``kl`` (k1, alias ``k1``),
``abs`` and ``mse`` (k2, alias ``k2``), and the straight-through ``k1+`` and ``k3+`` (the value
of k1 / k3, the gradient of k2).

Each is a per-token estimate of ``KL(pi || pi_ref)`` from the log-probs of the sampled
tokens, ``kl(logp (B, T), ref_logp (B, T), mask (B, T)) -> (B, T)``, exactly zero where
``mask`` is False even when the inputs there are ``inf`` or ``NaN`` (and with a finite,
zero gradient there). The k1/k2/k3 names follow John Schulman's note "Approximating KL
Divergence" (http://joschu.net/blog/kl-approx.html); the choices and names match verl's
``kl_penalty``.

Every estimator has two optional clamps: ``log_ratio_clamp`` bounds the log-ratio before
the estimator is applied (needed by k3, whose ``exp`` overflows), ``output_clamp`` bounds
the estimate itself. In ``kl``, ``abs``, ``mse`` and ``low_var_kl`` a clamp that is active stops
the gradient through that token. In the straight-through ``k1+`` and ``k3+`` the clamps bound the
value only: the gradient is k2's on every token, clamped or not (the estimator's definition, and
verl's ``kl_penalty``: the clamped k3 value is detached, the k2 surrogate is not clamped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import ConfigDict, Field, field_validator
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import masked_fill_zero
from grpo_core.options import Options

__all__ = [
    "KLOptions",
    "LowVarKLOptions",
    "k1_kl",
    "k2_kl",
    "k3_kl",
    "abs_kl",
    "k1_plus_kl",
    "k3_plus_kl",
    "straight_through",
    "straight_through_kl",
    "clamped_kl",
]


# --------------------------------------------------------------------------- options
def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is not None and not (value > 0 and value != float("inf")):
        raise ValueError(
            f"{name} must be a positive finite number (the clamp bound c, giving [-c, c]) "
            f"or null to disable the clamp; got {value!r}"
        )
    return value


class KLOptions(Options):
    """Options of ``kl``/``k1``, ``abs`` and ``mse``/``k2``."""

    # The clamps' validator refuses .inf and .nan itself, saying what is valid (null disables).
    model_config = ConfigDict(allow_inf_nan=True)

    log_ratio_clamp: float | None = Field(
        None,
        description="Clamp log(pi/pi_ref) to [-c, c] before the estimator; a positive number, or null "
        "(default: these estimators cannot overflow).",
    )
    output_clamp: float | None = Field(
        None,
        description="Clamp the per-token estimate to [-c, c]; a positive number or null "
        "(default) for no clamp, as verl does for these estimators.",
    )

    @field_validator("log_ratio_clamp", "output_clamp")
    @classmethod
    def _check_clamp(cls, value, info):
        return _positive_or_none(info.field_name, value)


class LowVarKLOptions(KLOptions):
    """Options of ``low_var_kl``/``k3``: verl's clamps by default."""

    log_ratio_clamp: float | None = Field(
        20.0,
        description="Clamp log(pi_ref/pi) to [-c, c] before exp, so it cannot overflow; a positive "
        "number or null. Default 20, as verl's low_var_kl. Under k3+ it bounds the value only (the "
        "gradient is k2's).",
    )
    output_clamp: float | None = Field(
        10.0,
        description="Clamp the per-token k3 estimate to [-c, c], so one token cannot dominate the "
        "loss (low_var_kl: a clamped token gets no gradient; k3+: it keeps k2's gradient, as verl's k3+); "
        "a positive number or null. Default 10, as verl.",
    )


# --------------------------------------------------------------------------- estimators
def k1_kl(log_ratio: Tensor) -> Tensor:
    """k1: ``log(pi/pi_ref)``; unbiased for KL(pi || pi_ref) under samples from pi, but
    negative on some tokens and high-variance. ``log_ratio = logp - ref_logp``, any shape."""
    return log_ratio


def abs_kl(log_ratio: Tensor) -> Tensor:
    """``|log(pi/pi_ref)|``: non-negative, biased. ``log_ratio = logp - ref_logp``."""
    return log_ratio.abs()


def k2_kl(log_ratio: Tensor) -> Tensor:
    """k2: ``0.5 * log(pi/pi_ref)^2``: non-negative, biased but low-variance; its gradient
    is that of the true KL to first order. ``log_ratio = logp - ref_logp``."""
    return 0.5 * log_ratio.square()


def k3_kl(log_ratio: Tensor) -> Tensor:
    """k3: ``exp(ref - logp) - (ref - logp) - 1`` with ``ref - logp = -log_ratio``.

    DeepSeekMath's estimator (https://arxiv.org/abs/2402.03300): unbiased for
    KL(pi || pi_ref) under samples from pi, non-negative (``e^x >= 1 + x``), low variance.
    ``log_ratio = logp - ref_logp``, any shape.
    """
    x = -log_ratio
    # expm1 keeps precision for small |x|; the clamp removes rounding below 0.
    return (torch.expm1(x) - x).clamp(min=0.0)


def straight_through(forward: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The elementwise estimator whose value is ``forward``'s and whose gradient is k2's:
    ``k2(x) - sg(k2(x)) + sg(forward(x))``, as verl's ``k1+`` / ``k3+`` (no clamps; the
    components add them with :func:`straight_through_kl`).

    k1 and k3 are unbiased estimates of KL(pi || pi_ref) under samples from pi, but their
    gradients are not unbiased estimates of the KL's gradient; k2's is
    (``grad k2 = log(pi/pi_ref) grad log pi``, whose expectation under pi is the gradient of the KL):
    Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; the gradient
    argument and the straight-through form are verl's ``kl_penalty`` (``"k1+"``, ``"k3+"``).
    """

    def estimator(log_ratio: Tensor) -> Tensor:
        surrogate = k2_kl(log_ratio)
        return surrogate - surrogate.detach() + forward(log_ratio).detach()

    estimator.__name__ = f"{forward.__name__}_plus"
    estimator.__doc__ = f"Value of {forward.__name__}, gradient of k2_kl (straight-through)."
    return estimator


k1_plus_kl = straight_through(k1_kl)
k3_plus_kl = straight_through(k3_kl)


def clamped_kl(
    estimator: Callable[[Tensor], Tensor],
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    log_ratio_clamp: float | None = None,
    output_clamp: float | None = None,
) -> Tensor:
    """Apply a per-token KL ``estimator`` to ``logp - ref_logp`` with optional clamps.

    Args:
        estimator: maps the log-ratio ``log(pi/pi_ref)`` to a KL estimate, elementwise.
        logp: ``float (B, T)`` log-probs of the sampled tokens under the policy.
        ref_logp: ``float (B, T)`` their log-probs under the reference model.
        mask: ``bool (B, T)`` completion tokens.
        log_ratio_clamp: clamp the log-ratio to ``[-c, c]`` first, or None.
        output_clamp: clamp the estimate to ``[-c, c]``, or None.

    Returns:
        ``float (B, T)``, exactly zero where ``mask`` is False. Padded inputs are replaced
        by 0 before any arithmetic, so inf/NaN there reach neither output nor gradient.
    """
    log_ratio = masked_fill_zero(logp, mask) - masked_fill_zero(ref_logp, mask)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = estimator(log_ratio)
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return masked_fill_zero(kl, mask)


def straight_through_kl(
    forward: Callable[[Tensor], Tensor],
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    log_ratio_clamp: float | None = None,
    output_clamp: float | None = None,
) -> Tensor:
    """The straight-through estimate: the value of ``forward`` (with the clamps, as
    :func:`clamped_kl`), the gradient of k2 on the unclamped log-ratio.

    ``k2(x) - sg(k2(x)) + sg(clamp(forward(clamp(x))))`` with ``x = logp - ref_logp``: the
    clamps guard the value (k3's ``exp``) and never cut the gradient, which is k2's,
    ``logp - ref_logp`` per token, clamped or not (verl's ``kl_penalty`` with ``"k3+"``:
    logp -3, ref 0 gives value 10, gradient -3). Shapes and padding as :func:`clamped_kl`.
    """
    value = clamped_kl(forward, logp.detach(), ref_logp, mask, log_ratio_clamp=log_ratio_clamp,
                       output_clamp=output_clamp)
    surrogate = clamped_kl(k2_kl, logp, ref_logp, mask)
    return surrogate - surrogate.detach() + value


# --------------------------------------------------------------------------- components
class _ClampedKL:
    """Binds an estimator to its clamp options."""

    estimator: Callable[[Tensor], Tensor]
    combine = staticmethod(clamped_kl)  # how the estimator meets the clamps

    def __init__(self, options: KLOptions):
        self.options = options

    def __call__(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
        return type(self).combine(
            type(self).estimator,
            logp,
            ref_logp,
            mask,
            log_ratio_clamp=self.options.log_ratio_clamp,
            output_clamp=self.options.output_clamp,
        )


class LowVarKL(_ClampedKL):
    """k3 estimator exp(ref - logp) - (ref - logp) - 1: unbiased, non-negative (DeepSeekMath's KL)."""

    estimator = staticmethod(k3_kl)


class K1KL(_ClampedKL):
    """k1 estimator logp - ref_logp: unbiased, can be negative."""

    estimator = staticmethod(k1_kl)


class AbsKL(_ClampedKL):
    """|logp - ref_logp|: non-negative, biased."""

    estimator = staticmethod(abs_kl)


class MseKL(_ClampedKL):
    """k2 estimator 0.5 * (logp - ref_logp)^2: non-negative, low variance, biased."""

    estimator = staticmethod(k2_kl)


class _StraightThroughKL(_ClampedKL):
    """Binds a straight-through estimator (the value of ``estimator``, k2's gradient) to its clamps."""

    combine = staticmethod(straight_through_kl)


class K1PlusKL(_StraightThroughKL):
    """k1+: the value of k1 (logp - ref_logp), the gradient of k2 (straight-through, verl's k1+)."""

    estimator = staticmethod(k1_kl)


class K3PlusKL(_StraightThroughKL):
    """k3+: the value of k3 (verl's clamps, on the value only), the gradient of k2 (straight-through, verl's k3+)."""

    estimator = staticmethod(k3_kl)


@hookimpl
def register_kl_penalties(register):
    register.add("low_var_kl", LowVarKL, options=LowVarKLOptions)
    register.add("k3", LowVarKL, options=LowVarKLOptions, description="alias of low_var_kl")
    register.add("kl", K1KL, options=KLOptions)
    register.add("k1", K1KL, options=KLOptions, description="alias of kl")
    register.add("abs", AbsKL, options=KLOptions)
    register.add("mse", MseKL, options=KLOptions)
    register.add("k2", MseKL, options=KLOptions, description="alias of mse")
    register.add("k1+", K1PlusKL, options=KLOptions)
    register.add("k3+", K3PlusKL, options=LowVarKLOptions)
