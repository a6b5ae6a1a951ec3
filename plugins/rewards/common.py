"""What the built-in reward functions share: a dataset column read with an error that names the
reward (:func:`column`) and the device a model-based reward loads on (:func:`resolve_device`)."""

from __future__ import annotations

from typing import Any

from grpo_core.errors import RunError

__all__ = ["column", "resolve_device"]


def column(reward: str, columns: dict[str, Any], name: str, size: int) -> list:
    """Keyword column ``name`` with ``size`` entries, or a RunError naming the reward."""
    if name not in columns:
        available = ", ".join(sorted(columns)) or "(none)"
        raise RunError(
            f"reward function '{reward}' needs the dataset column '{name}', which the batch "
            f"does not have; columns available: {available}"
        )
    values = list(columns[name])
    if len(values) != size:
        raise RunError(
            f"reward function '{reward}': column '{name}' has {len(values)} entries for "
            f"{size} completions"
        )
    return values


def resolve_device(device: str) -> str:
    """``device``, or for ``"auto"`` this process's GPU (``LOCAL_RANK``) when there is one, else the CPU."""
    if device != "auto":
        return device
    import os

    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"
