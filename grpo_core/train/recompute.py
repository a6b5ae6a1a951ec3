"""What a checkpointed layer's recomputation runs under: the contexts its forward ran in.

``model.gradient_checkpointing`` keeps each decoder layer's input only and runs the layer again
in the backward (``torch.utils.checkpoint``, non-reentrant). The learner's forwards run some
decoder calls inside contexts that change what a layer computes: the packed attention
(:func:`grpo_core.train.learner.packing.attention_switched`) and the routes forced on a
mixture-of-experts policy's routers (:func:`grpo_core.train.learner.routing.replayed`). The
backward runs after those contexts have closed, so a recomputation outside them would compute
another function of the same input (attention across the packed rows, the live routes) and the
gradient would be that other function's.

Each such context registers, while it is open, how to open it again (:func:`on_recompute`);
:func:`checkpoint_contexts`, the ``context_fn`` the policy's checkpointing is enabled with
(:func:`grpo_core.train.model.enable_checkpointing`), reads them when a checkpointed layer runs
its forward and reopens them, in the same order, around that layer's recomputation. A layer
checkpointed by any other function is told apart (:func:`recomputes_in_context`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from torch import nn

__all__ = ["on_recompute", "checkpoint_contexts", "recomputes_in_context", "checkpointed_otherwise"]

#: The factories of the contexts open around the decoder call being run, outermost first.
_OPEN: contextvars.ContextVar[tuple[Callable[[], AbstractContextManager], ...]] = contextvars.ContextVar(
    "grpo_recompute_contexts", default=())


@contextlib.contextmanager
def on_recompute(reopen: Callable[[], AbstractContextManager]) -> Iterator[None]:
    """While inside, a checkpointed layer whose forward runs is recomputed under ``reopen()``."""
    token = _OPEN.set((*_OPEN.get(), reopen))
    try:
        yield
    finally:
        _OPEN.reset(token)


@contextlib.contextmanager
def _reopened(factories: tuple[Callable[[], AbstractContextManager], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for reopen in factories:
            stack.enter_context(reopen())
        yield


def checkpoint_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``: the forward runs as called; the
    recomputation in the backward runs under the contexts open at the forward (:func:`on_recompute`)."""
    factories = _OPEN.get()
    return contextlib.nullcontext(), (_reopened(factories) if factories else contextlib.nullcontext())


def recomputes_in_context(module: nn.Module) -> bool:
    """Whether ``module``'s checkpointing function recomputes under :func:`checkpoint_contexts`."""
    func = getattr(module, "_gradient_checkpointing_func", None)
    return isinstance(func, functools.partial) and func.keywords.get("context_fn") is checkpoint_contexts


def checkpointed_otherwise(model: nn.Module) -> bool:
    """Whether a layer of ``model`` is checkpointed by a function that would recompute it outside
    the learner's contexts (not :func:`checkpoint_contexts`)."""
    return any(getattr(m, "gradient_checkpointing", False) and not recomputes_in_context(m) for m in model.modules())
