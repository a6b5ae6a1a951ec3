"""Reward function ``overlong``: DAPO's soft overlong punishment on the completion's length in
tokens (https://arxiv.org/abs/2503.14476)."""

from __future__ import annotations

from typing import Any

from grpo_plugins.rewards.common import column
from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.options import Options

__all__ = ["OverlongOptions", "OverlongReward", "overlong_punishment"]


class OverlongOptions(Options):
    """Options of the ``overlong`` reward."""

    max_length: int = Field(
        ge=1,
        description="L_max: the completion length (in tokens) that gets the full -1 "
        "punishment; normally the rollout's max_new_tokens. An integer >= 1.",
    )
    buffer: int | None = Field(
        None,
        ge=1,
        description="L_cache: length of the soft-punishment interval just below max_length, "
        "in tokens; an integer in 1..max_length. Unset: max_length // 5 (at least 1), "
        "DAPO's ratio (a 4,096-token buffer for 20,480 tokens).",
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongOptions:
        if self.buffer is not None and self.buffer > self.max_length:
            raise ValueError(
                f"buffer ({self.buffer}) must be at most max_length ({self.max_length}): "
                "the soft-punishment interval lies inside 0..max_length"
            )
        return self

    @property
    def effective_buffer(self) -> int:
        return self.buffer if self.buffer is not None else max(1, self.max_length // 5)


def overlong_punishment(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13).

    With ``L_max = max_length`` and ``L_cache = buffer``: 0 when ``|o| <= L_max - L_cache``;
    ``((L_max - L_cache) - |o|) / L_cache`` (from 0 down to -1) when
    ``L_max - L_cache < |o| <= L_max``; -1 beyond ``L_max``.
    """
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer
    return -1.0


class OverlongReward:
    """DAPO's soft overlong punishment on the completion's token count (0 to -1)."""

    def __init__(self, options: OverlongOptions):
        self.options = options
        self.max_length = options.max_length
        self.buffer = options.effective_buffer
        self.__name__ = "overlong"

    def __repr__(self) -> str:
        return f"overlong(max_length={self.max_length}, buffer={self.buffer})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        ids = column(self.__name__, columns, "completion_ids", len(completions))
        return [overlong_punishment(len(row), self.max_length, self.buffer) for row in ids]


@hookimpl
def register_reward_functions(register) -> None:
    register.add("overlong", OverlongReward, options=OverlongOptions)
