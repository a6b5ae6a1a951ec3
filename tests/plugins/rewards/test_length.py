"""The ``overlong`` reward: DAPO's piecewise punishment by hand and against the formula, counted in
tokens, its default buffer, and the errors."""

from __future__ import annotations

import pytest
from grpo_plugins.rewards.length import OverlongOptions, OverlongReward, overlong_punishment
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_core.errors import RunError

from .conftest import chat


@pytest.mark.parametrize(
    "length, expected",
    # L_max = 10, buffer = 4: free up to 6 tokens, then -1/4 per token, -1 beyond 10
    [(0, 0.0), (5, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (11, -1.0),
     (500, -1.0)],
)
def test_overlong_hand_values(length, expected):
    reward = OverlongReward(OverlongOptions(max_length=10, buffer=4))
    out = reward(["q"], ["text"], completion_ids=[list(range(length))])
    assert out == [pytest.approx(expected)]


def test_overlong_counts_tokens_not_characters():
    reward = OverlongReward(OverlongOptions(max_length=10, buffer=4))
    out = reward(["q", "q"], ["x" * 1000, chat("y")], completion_ids=[[1, 2], list(range(9))])
    assert out == [0.0, pytest.approx(-0.75)]


def test_overlong_default_buffer_is_a_fifth_of_max_length():
    assert OverlongReward(OverlongOptions(max_length=20480)).buffer == 4096  # DAPO's setting
    assert OverlongReward(OverlongOptions(max_length=256)).buffer == 51
    assert OverlongReward(OverlongOptions(max_length=3)).buffer == 1


def _reference_punishment(length: int, l_max: int, l_cache: int) -> float:
    # DAPO eq. 13, written out case by case
    if length <= l_max - l_cache:
        return 0.0
    if l_max - l_cache < length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@settings(max_examples=200, deadline=None)
@given(data=st.data(), l_max=st.integers(1, 4096))
def test_overlong_matches_the_piecewise_formula_property(data, l_max):
    buffer = data.draw(st.integers(1, l_max))
    length = data.draw(st.integers(0, 2 * l_max + 2))
    value = overlong_punishment(length, l_max, buffer)
    assert value == pytest.approx(_reference_punishment(length, l_max, buffer))
    assert -1.0 <= value <= 0.0
    # non-increasing in the length, continuous where the pieces meet
    assert overlong_punishment(length + 1, l_max, buffer) <= value
    assert overlong_punishment(l_max, l_max, buffer) == pytest.approx(-1.0)
    assert overlong_punishment(l_max - buffer, l_max, buffer) == 0.0


def test_overlong_needs_completion_ids():
    with pytest.raises(RunError, match="'overlong' needs the dataset column 'completion_ids'"):
        OverlongReward(OverlongOptions(max_length=8))(["q"], ["text"])


def test_overlong_options_say_what_is_valid():
    with pytest.raises(ValidationError, match=r"buffer \(9\) must be at most max_length \(8\)"):
        OverlongOptions(max_length=8, buffer=9)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        OverlongOptions(max_length=0)
    with pytest.raises(ValidationError, match="max_length\n  Field required"):
        OverlongOptions()
