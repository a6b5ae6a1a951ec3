"""One rule for every reward value (issue 26, item 12): a finite real number or None; NaN,
infinities, strings (even ``"0.5"``) and integers too large for a float are a RunError
naming the function and the completion, or with ``reward_errors: none`` scored None and
counted. The ``remote`` reward's answers follow the same rule (tests/plugins)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo_core.errors import RunError
from grpo_core.train.actor import scoring
from grpo_core.train.actor.scoring import RewardFn, score

PROMPTS = ["What is 2+2?", "Name a prime."]
COMPLETIONS = ["4", "7"]


def _constant(value):
    def fn(prompts, completions, **kwargs):
        return [1.0, value][: len(completions)] if len(completions) == 2 else [value]
    return fn


def _score(value, on_error="raise"):
    return score([RewardFn.of("judge", 1.0, _constant(value))], PROMPTS, COMPLETIONS, {}, [[1], [2]], on_error)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (math.nan, "nan"),
        (np.float32("nan"), "nan"),
        (torch.tensor(float("nan")), "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        ("0.5", "str '0.5'"),
        (b"1", "bytes b'1'"),
        (10**400, "int too large for a float (10000000000000000000...)"),
        (1 + 2j, "complex (1+2j)"),
        ({"score": 1}, "dict {'score': 1}"),
    ],
)
def test_anything_but_a_finite_real_number_or_none_is_an_error_naming_the_function(value, shown):
    with pytest.raises(RunError) as raised:
        _score(value)
    message = str(raised.value)
    assert message.startswith(f"reward function 'judge' returned {shown} for completion 1 (prompt: 'Name a prime.'); "
                              "rewards must be finite real numbers, or None")
    assert "reward_errors: none" in message
    out = _score(value, on_error="none")  # scored None and counted, not silently dropped
    assert out.failed == 1 and out.total[0] == 1.0 and math.isnan(out.total[1])


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (0.25, 0.25), (3, 3.0), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5), (np.int64(2), 2.0),
     (np.bool_(True), 1.0), (torch.tensor(0.75), 0.75), (np.array(1.5), 1.5), (Fraction(1, 4), 0.25)],
)
def test_finite_real_numbers_of_any_kind_and_none_are_accepted(value, expected):
    assert scoring.reward_value(value) == expected
    out = _score(value)
    assert out.failed == 0
    assert math.isnan(out.per_function[1, 0]) if expected is None else out.per_function[1, 0] == expected


def test_a_step_score_follows_the_same_rule():
    def steps_fn(prompts, completions, steps, **kwargs):
        return [[0.5] * len(s) if i == 0 else [math.nan] * len(s) for i, s in enumerate(steps)]

    fns = [RewardFn.of("prm", 1.0, steps_fn)]
    with pytest.raises(RunError, match=r"reward function 'prm' returned nan for completion 1"):
        score(fns, PROMPTS, COMPLETIONS, {}, [[1], [2]], "raise", steps=[["a"], ["b"]])
    out = score(fns, PROMPTS, COMPLETIONS, {}, [[1], [2]], "none", steps=[["a"], ["b"]])
    assert out.failed == 1 and out.total[0] == 0.5 and math.isnan(out.total[1])


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_reward_value_is_the_float_when_finite_and_an_error_otherwise(x):
    if math.isfinite(x):
        assert scoring.reward_value(x) == x
    else:
        with pytest.raises(ValueError):
            scoring.reward_value(x)


@given(st.integers())
def test_reward_value_of_an_integer_is_the_float_or_an_error_when_too_large(n):
    try:
        expected = float(n)
    except OverflowError:
        with pytest.raises(ValueError, match="too large for a float"):
            scoring.reward_value(n)
    else:
        assert scoring.reward_value(n) == expected
