"""Components that are a pure function with its options bound: the shape most built-in
advantage estimators and policy losses share.

An algorithm is written once as a pure function of tensors and keyword options (its
docstring gives the paper, the formula and the shapes; tests call it directly). The
component a spec builds is that function with the slot's validated options bound: a
subclass of :class:`OptionsBound` names the function and which attributes of the kind's
inputs object it takes, in order (a base class per kind sets them), and is registered as the
factory; the function, right below the component, says that the component computes it::

    class ClipPolicyLoss(BoundPolicyLoss):
        \"\"\"PPO clipped surrogate ...\"\"\"  # the description grpo-run plugins shows


    @ClipPolicyLoss.binds
    def ppo_clip_loss(logp, old_logp, advantages, mask, *, eps_low=0.2, ...): ...


    register.add("clip", ClipPolicyLoss, options=ClipOptions)

Building it is ``ClipPolicyLoss(options)``; calling the component with an inputs object
``x`` calls ``ppo_clip_loss(x.logp, x.old_logp, x.advantages, x.mask, **options)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

__all__ = ["OptionsBound"]


class OptionsBound:
    """``function(*(getattr(inputs, name) for name in reads), **options.model_dump())``.

    Attributes:
        function: the pure function, set by :meth:`binds`.
        reads: the attributes of the inputs object passed positionally, in order.
        options: the validated options model the component was built with; every field is
            passed to ``function`` as a keyword argument of the same name.
    """

    function: Callable[..., Any]
    reads: tuple[str, ...] = ()

    def __init__(self, options: BaseModel):
        self.options = options

    @classmethod
    def binds(cls, function: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator of the pure function this component computes; returns it unchanged."""
        cls.function = staticmethod(function)
        return function

    def __call__(self, inputs: Any) -> Any:
        return self.function(*(getattr(inputs, name) for name in self.reads), **self.options.model_dump())
