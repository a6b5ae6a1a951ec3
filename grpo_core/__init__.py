"""grpo-core: Group Relative Policy Optimization as a small engine plus plugins.

Two ways in: a YAML spec and ``grpo-run``, or :class:`Trainer` from Python (imported on first
use, so that plugins importing ``hookimpl`` do not pay for the training stack); and for a
script written for TRL, ``grpo_core.trl``'s ``GRPOConfig`` and ``GRPOTrainer``."""

from grpo_core.hookspecs import hookimpl
from grpo_core.version import __version__

__all__ = ["Callback", "TrainResult", "Trainer", "hookimpl", "__version__"]

_LAZY = {"Trainer", "TrainResult", "Callback"}


def __getattr__(name: str):
    if name in _LAZY:
        from grpo_core import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'grpo_core' has no attribute {name!r}")
