"""Built-in step splitters (process supervision): ``newline``, ``blank-line``, ``regex``.

A component is a :class:`grpo_core.contracts.StepSplitter`: ``split(text)`` returns the
``(start, end)`` character spans of the steps of one completion's text, in order. Each
built-in cuts the text at the matches of a separator regular expression, strips the
blanks around every piece and drops empty pieces, so ``"a\\n\\nb\\n"`` has the steps
``"a"`` and ``"b"`` under ``newline``. Which completion token a step ends at is the
engine's job (:mod:`grpo_core.train.reasoning_steps`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from grpo_core import hookimpl
from grpo_core.options import Options

__all__ = ["split_on", "SeparatorSplitter", "RegexOptions"]

_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "ASCII": re.ASCII}


def split_on(separator: re.Pattern[str], text: str) -> list[tuple[int, int]]:
    """Spans of the non-blank pieces of ``text`` between matches of ``separator``, each
    with its surrounding whitespace left out."""
    spans, start = [], 0
    bounds = [(m.start(), m.end()) for m in separator.finditer(text) if m.end() > m.start()]
    for sep_start, sep_end in bounds + [(len(text), len(text))]:
        piece = text[start:sep_start]
        lead = len(piece) - len(piece.lstrip())
        trail = len(piece.rstrip())
        if trail > lead:
            spans.append((start + lead, start + trail))
        start = sep_end
    return spans


class SeparatorSplitter:
    """Steps are the non-blank pieces between matches of a separator regex."""

    def __init__(self, pattern: str, flags: int = 0, name: str = "regex"):
        self.pattern = re.compile(pattern, flags)
        self.__name__ = name

    def __repr__(self) -> str:
        return f"{self.__name__}(pattern={self.pattern.pattern!r})"

    def __call__(self, text: str) -> list[tuple[int, int]]:
        return split_on(self.pattern, text)


class RegexOptions(Options):
    """Options of the ``regex`` step splitter."""

    pattern: str = Field(
        description="Python regular expression matching the separator between two steps, "
        "e.g. '\\n(?=Step \\d+:)' (a newline before 'Step n:'); the separator is left out "
        "of the steps' texts. Empty matches are ignored.",
    )
    flags: tuple[Literal["IGNORECASE", "MULTILINE", "ASCII"], ...] = Field(
        (), description="re flags, any of IGNORECASE, MULTILINE, ASCII."
    )

    @model_validator(mode="after")
    def _compiles(self) -> RegexOptions:
        try:
            re.compile(self.pattern, self.flag_value)
        except re.error as exc:
            raise ValueError(
                f"pattern {self.pattern!r} is not a valid Python regular expression: {exc}"
            ) from None
        return self

    @property
    def flag_value(self) -> int:
        value = 0
        for name in self.flags:
            value |= _FLAGS[name]
        return value


def _regex(options: RegexOptions) -> SeparatorSplitter:
    return SeparatorSplitter(options.pattern, options.flag_value)


@hookimpl
def register_step_splitters(register) -> None:
    register.add(
        "newline",
        SeparatorSplitter(r"\n", name="newline"),
        description="one step per non-blank line",
    )
    register.add(
        "blank-line",
        SeparatorSplitter(r"\n[ \t\r\f\v]*\n", name="blank-line"),
        description="steps separated by blank lines (paragraphs)",
    )
    register.add(
        "regex",
        _regex,
        options=RegexOptions,
        description="steps separated by matches of a regular expression",
    )
