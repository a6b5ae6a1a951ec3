"""Reward function ``format``: 1.0 when the completion text matches a regular expression."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.options import Options

__all__ = ["FormatOptions", "FormatReward"]


_FLAGS = {
    "DOTALL": re.DOTALL,
    "IGNORECASE": re.IGNORECASE,
    "MULTILINE": re.MULTILINE,
    "ASCII": re.ASCII,
    "VERBOSE": re.VERBOSE,
}


FlagName = Literal["DOTALL", "IGNORECASE", "MULTILINE", "ASCII", "VERBOSE"]


class FormatOptions(Options):
    """Options of the ``format`` reward."""

    pattern: str = Field(
        description="Python regular expression (``re`` syntax) the completion text must "
        "match, e.g. '<think>.*</think>\\s*<answer>.*</answer>'."
    )
    mode: Literal["search", "fullmatch"] = Field(
        "search",
        description="'search': the pattern may match anywhere in the completion; "
        "'fullmatch': it must match the whole completion.",
    )
    flags: tuple[FlagName, ...] = Field(
        ("DOTALL",),
        description="re flags, any of DOTALL, IGNORECASE, MULTILINE, ASCII, VERBOSE; "
        "DOTALL (the default) lets '.' cross newlines.",
    )

    @model_validator(mode="after")
    def _compiles(self) -> FormatOptions:
        try:
            self.compile()
        except re.error as exc:
            raise ValueError(
                f"pattern {self.pattern!r} is not a valid Python regular expression: {exc}"
            ) from None
        return self

    def compile(self) -> re.Pattern[str]:
        value = 0
        for name in self.flags:
            value |= _FLAGS[name]
        return re.compile(self.pattern, value)


class FormatReward:
    """1.0 when the completion text matches a regular expression, else 0.0."""

    def __init__(self, options: FormatOptions):
        self.options = options
        self.__name__ = "format"
        regex = options.compile()
        self._match = regex.fullmatch if options.mode == "fullmatch" else regex.search

    def __repr__(self) -> str:
        return f"format(pattern={self.options.pattern!r}, mode={self.options.mode!r})"

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float]:
        return [1.0 if self._match(completion_text(c)) else 0.0 for c in completions]


@hookimpl
def register_reward_functions(register) -> None:
    register.add("format", FormatReward, options=FormatOptions)
