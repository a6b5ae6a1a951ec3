"""The ``format`` reward: search and fullmatch, DOTALL by default, literal substrings, and the
errors of a bad pattern or option."""

from __future__ import annotations

import re

import pytest
from grpo_plugins.rewards.format import FormatOptions, FormatReward
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from .conftest import chat


def test_format_search_and_fullmatch():
    pattern = r"<think>.*</think>\s*<answer>\d+</answer>"
    text = "<think>\n12 + 7\n</think>\n<answer>19</answer>"
    search = FormatReward(FormatOptions(pattern=pattern))
    full = FormatReward(FormatOptions(pattern=pattern, mode="fullmatch"))
    completions = [text, "preamble " + text, "<answer>19</answer>", chat(text)]
    assert search(["q"] * 4, completions) == [1.0, 1.0, 0.0, 1.0]
    assert full(["q"] * 4, completions) == [1.0, 0.0, 0.0, 1.0]


def test_format_dotall_is_the_default_and_can_be_turned_off():
    text = "<think>line one\nline two</think>"
    assert FormatReward(FormatOptions(pattern="<think>.*</think>"))(["q"], [text]) == [1.0]
    no_dotall = FormatReward(FormatOptions(pattern="<think>.*</think>", flags=[]))
    assert no_dotall(["q"], [text]) == [0.0]
    ignorecase = FormatReward(FormatOptions(pattern="ANSWER", flags=["IGNORECASE"]))
    assert ignorecase(["q", "q"], ["the answer", "nothing"]) == [1.0, 0.0]


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), needle=st.text(min_size=1, max_size=4))
def test_format_matches_literal_substrings_property(text, needle):
    search = FormatReward(FormatOptions(pattern=re.escape(needle)))
    full = FormatReward(FormatOptions(pattern=re.escape(needle), mode="fullmatch"))
    assert search(["q"], [text]) == [1.0 if needle in text else 0.0]
    assert full(["q"], [chat(text)]) == [1.0 if needle == text else 0.0]


def test_format_invalid_regex_names_the_pattern_and_the_re_error():
    with pytest.raises(ValidationError) as info:
        FormatOptions(pattern="<answer>(\\d+</answer>")
    message = str(info.value)
    assert "'<answer>(\\\\d+</answer>'" in message
    assert "not a valid Python regular expression" in message
    assert "missing ), unterminated subpattern" in message


def test_format_options_list_what_is_valid():
    with pytest.raises(ValidationError, match="Field required"):
        FormatOptions()
    with pytest.raises(ValidationError, match="'search' or 'fullmatch'"):
        FormatOptions(pattern="x", mode="match")
    with pytest.raises(ValidationError, match="'DOTALL', 'IGNORECASE', 'MULTILINE'"):
        FormatOptions(pattern="x", flags=["DOTAL"])
