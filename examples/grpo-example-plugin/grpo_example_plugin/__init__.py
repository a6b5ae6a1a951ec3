"""An example third-party grpo-core plugin.

It registers two components, each with its own options model:

- ``length_penalty`` (reward function): ``-scale * |chars - target_chars| / target_chars``
  per completion, so 0 at the target length and more negative the further away; with
  ``only_longer: true`` completions shorter than the target are not penalized.
- ``sign`` (advantage estimator): ``sign(r_i - mean(r))`` within each prompt's group on
  every completion token, a scale-free cousin of GRPO's ``(r_i - mean) / std``.

Installed, it is found through its entry point (group ``grpo``) and selected by name in a
spec::

    rewards:
      - name: length_penalty
        target_chars: 200
        weight: 0.1
    algorithm:
      advantage: {name: sign}
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from grpo_core import hookimpl
from grpo_core.contracts import AdvantageInputs, masked_fill_zero
from grpo_core.options import Options

__version__ = "0.1.0"
__all__ = ["LengthPenaltyOptions", "LengthPenalty", "SignOptions", "SignAdvantage"]


# --------------------------------------------------------------------------- reward
def _text(completion: Any) -> str:
    """A completion's text: a string as is, or the contents of TRL's conversational form
    ``[{"role": "assistant", "content": text}]`` (a single message dict works too)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content")
        return content if isinstance(content, str) else ""
    if isinstance(completion, (list, tuple)):
        return "".join(_text(message) for message in completion)
    raise TypeError(
        f"length_penalty: a completion must be a string or a list of chat messages, "
        f"got {type(completion).__name__}"
    )


class LengthPenaltyOptions(Options):
    """Options of the ``length_penalty`` reward."""

    target_chars: int = Field(
        200, ge=1, description="Completion length, in characters, that gets no penalty."
    )
    scale: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="Penalty for a completion whose length is off by target_chars characters "
        "(the penalty grows linearly with the distance).",
    )
    only_longer: bool = Field(
        False, description="Penalize only completions longer than target_chars."
    )


class LengthPenalty:
    """Penalty proportional to a completion's distance from a target length in characters."""

    def __init__(self, options: LengthPenaltyOptions):
        self.options = options
        self.__name__ = "length_penalty"  # TRL logs a reward function under its __name__

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        """TRL's reward signature: one float per completion; extra columns are ignored."""
        target, scale = self.options.target_chars, self.options.scale
        rewards: list[float | None] = []
        for completion in completions:
            off = len(_text(completion)) - target
            if self.options.only_longer:
                off = max(off, 0)
            penalty = scale * abs(off) / target
            rewards.append(-penalty if penalty else 0.0)  # 0.0, not -0.0, at the target
        return rewards


# --------------------------------------------------------------------------- advantage
class SignOptions(Options):
    """Options of the ``sign`` advantage estimator."""

    dead_zone: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Rewards within this distance of their group's mean get advantage 0.",
    )


class SignAdvantage:
    """Advantage sign(r_i - mean(r)) within each prompt's group, the same on every token."""

    def __init__(self, options: SignOptions):
        self.options = options

    def __call__(self, inputs: AdvantageInputs) -> Tensor:
        """``inputs.scores (B,)``, ``inputs.group_ids (B,)``, ``inputs.mask (B, T)`` ->
        advantages ``float (B, T)``, zero on padding and for unscorable (NaN) rows, which
        are also left out of their group's mean."""
        scores = inputs.scores.float()
        scorable = ~torch.isnan(scores)
        _, group = torch.unique(inputs.group_ids, return_inverse=True)
        n = int(group.max()) + 1 if group.numel() else 0
        filled = torch.where(scorable, scores, torch.zeros_like(scores))
        sums = torch.zeros(n, dtype=scores.dtype).index_add_(0, group, filled)
        counts = torch.zeros(n, dtype=scores.dtype).index_add_(0, group, scorable.to(scores.dtype))
        centred = filled - (sums / counts.clamp(min=1))[group]
        sign = torch.where(centred.abs() > self.options.dead_zone, torch.sign(centred), 0.0)
        sign = torch.where(scorable, sign, torch.zeros_like(sign))
        return masked_fill_zero(sign[:, None].expand(inputs.mask.shape), inputs.mask)


# --------------------------------------------------------------------------- hooks
@hookimpl
def register_reward_functions(register) -> None:
    register.add("length_penalty", LengthPenalty, options=LengthPenaltyOptions)


@hookimpl
def register_advantage_estimators(register) -> None:
    register.add("sign", SignAdvantage, options=SignOptions)
