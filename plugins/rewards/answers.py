"""Reward function ``accuracy``: the final answer's correctness, checked with math-verify."""

from __future__ import annotations

import re
import threading
from typing import Any

from grpo_plugins.rewards.common import column
from pydantic import Field

from grpo_core import hookimpl
from grpo_core.contracts import completion_text
from grpo_core.options import Options, WholeSeconds

__all__ = ["AccuracyOptions", "AccuracyReward"]


class AccuracyOptions(Options):
    """Options of the ``accuracy`` reward."""

    answer_column: str = Field(
        "answer",
        min_length=1,
        description="Dataset column holding the gold answer of each prompt (a string or a "
        "number, e.g. '91' or '\\frac{1}{2}'); any non-empty column name.",
    )
    timeout: WholeSeconds = Field(
        5,
        ge=0,
        description="Seconds math-verify may spend parsing or comparing one answer (an "
        "integer >= 0). math-verify enforces it with SIGALRM, which only works on the main "
        "thread: 0 turns it off, and off the main thread it is always off.",
    )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class AccuracyReward:
    """Final-answer correctness checked with math-verify: 1.0 right, 0.0 wrong.

    The completion's answer is extracted by ``math_verify.parse`` (``\\boxed{}``, "the
    answer is X", LaTeX, else the last expression of the text) and compared with the gold
    answer by ``math_verify.verify`` (numeric and symbolic equality). When math-verify
    extracts nothing (it rejects, e.g., a bare parenthesised ``(19)``), or extracts an
    unevaluated expression while the gold is a plain number (the question restated, such
    as ``87 + 86 = ?``), the last number in the text is tried instead. A completion with no
    answer at all scores 0.0.

    Returns ``None`` (unscorable) when the *gold* answer itself cannot be parsed: that
    row says nothing about the policy, so it is left out of its group's statistics.
    """

    def __init__(self, options: AccuracyOptions | None = None):
        self.options = options or AccuracyOptions()
        self.__name__ = "accuracy"

    def __repr__(self) -> str:
        return f"accuracy(answer_column={self.options.answer_column!r})"

    @property
    def required_columns(self) -> list[str]:
        """Dataset columns this reward reads; the engine checks them before training."""
        return [self.options.answer_column]

    def _timeout(self) -> int | None:
        if self.options.timeout <= 0:
            return None
        if threading.current_thread() is not threading.main_thread():
            return None  # signal.alarm raises ValueError off the main thread
        return self.options.timeout

    def _parse(self, text: str) -> list:
        from math_verify import parse

        return parse(text, parsing_timeout=self._timeout())

    def _predicted(self, text: str, numeric_gold: bool) -> list:
        """The completion's answer. Against a plain-number gold the answer must itself be
        a number: math-verify would otherwise evaluate a restated problem ("87 + 86 = ?"
        parses as 87 + 86) and pay a policy for copying the question, which GRPO learns
        within a few dozen steps. Such text falls back to its last number."""
        parsed = self._parse(text)
        if parsed and (not numeric_gold or _NUMBER.fullmatch(str(parsed[-1]).strip())):
            return parsed
        numbers = _NUMBER.findall(text)
        return self._parse(numbers[-1].replace(",", "")) if numbers else []

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        from math_verify import verify

        golds = column(self.__name__, columns, self.options.answer_column, len(completions))
        parsed_golds: dict[str, list] = {}  # a prompt's gold repeats G times: parse it once
        rewards: list[float | None] = []
        for completion, gold in zip(completions, golds):
            gold_text = "" if gold is None else str(gold).strip()
            if gold_text not in parsed_golds:
                parsed_golds[gold_text] = self._parse(gold_text) if gold_text else []
            gold_parsed = parsed_golds[gold_text]
            if not gold_parsed:
                rewards.append(None)
                continue
            predicted = self._predicted(completion_text(completion), bool(_NUMBER.fullmatch(gold_text)))
            if not predicted:
                rewards.append(0.0)
                continue
            ok = verify(gold_parsed, predicted, timeout_seconds=self._timeout())
            rewards.append(1.0 if ok else 0.0)
        return rewards


@hookimpl
def register_reward_functions(register) -> None:
    register.add("accuracy", AccuracyReward, options=AccuracyOptions)
