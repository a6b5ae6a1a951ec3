"""What the built-in advantage estimators share: :class:`BoundEstimator` (an advantage function
with its options bound, the component most built-in estimators are) and the descriptions of
their ``eps`` options."""

from __future__ import annotations

from grpo_plugins.binding import OptionsBound

__all__ = ["EPS_DESCRIPTION", "PAPER_EPS_DESCRIPTION", "BoundEstimator"]

#: ``eps`` of ``grpo``, ``dapo-token-scale`` and ``process``.
EPS_DESCRIPTION = "Added to the standard deviation before dividing, >= 0 (verl's default 1e-6)."
#: ``eps`` of ``gpg`` and ``passk``.
PAPER_EPS_DESCRIPTION = "Added to the standard deviation before dividing, >= 0 (1e-6 as the paper's code and verl)."


class BoundEstimator(OptionsBound):
    """An advantage estimator made of a pure function ``function(scores, group_ids, mask,
    **options)`` of :class:`~grpo_core.contracts.AdvantageInputs`' fields (``reads`` names
    them, in order)."""

    reads = ("scores", "group_ids", "mask")
