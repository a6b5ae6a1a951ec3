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
        (1e300, "1e+300, beyond the float32 range of rewards (|r| <= 3.403e+38)"),
        (-1e39, "-1e+39, beyond the float32 range of rewards (|r| <= 3.403e+38)"),
        (10**39, "1e+39, beyond the float32 range of rewards (|r| <= 3.403e+38)"),
        (np.float64(1e300), "1e+300, beyond the float32 range of rewards (|r| <= 3.403e+38)"),
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


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_reward_value_is_the_float_when_finite_in_float32_and_an_error_otherwise(x):
    if math.isfinite(x) and abs(x) <= FLOAT32_MAX:
        assert scoring.reward_value(x) == x
    else:
        with pytest.raises(ValueError):
            scoring.reward_value(x)


@given(st.integers() | st.integers(min_value=10**38, max_value=10**39))
def test_reward_value_of_an_integer_is_the_float_or_an_error_when_too_large(n):
    try:
        expected = float(n)
    except OverflowError:
        with pytest.raises(ValueError, match="too large for a float"):
            scoring.reward_value(n)
    else:
        if abs(expected) <= FLOAT32_MAX:
            assert scoring.reward_value(n) == expected
        else:
            with pytest.raises(ValueError, match="beyond the float32 range of rewards"):
                scoring.reward_value(n)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_accepted_value_enters_the_float32_score_table(x):
    """Whatever reward_value accepts, the scores' float32 table holds without overflow (1e300
    is finite in Python, not in float32, and stopped the run with torch's "value cannot be
    converted to type float without overflow", naming no function: issue 47, item 11)."""
    try:
        value = scoring.reward_value(x)
    except ValueError:
        return
    out = score([RewardFn.of("judge", 1.0, _constant(value))], PROMPTS, COMPLETIONS, {}, [[1], [2]])
    assert math.isfinite(out.per_function[1, 0])


HUGE = """
from grpo_core import hookimpl

calls = {"n": 0}

def huge(prompts, completions, **kwargs):  # finite in Python, not in float32, on step 3
    calls["n"] += 1
    return [1e300 if calls["n"] == 3 and i == 1 else float(i % 2) for i in range(len(completions))]

@hookimpl
def register_reward_functions(register):
    register.add("huge", huge)
"""


def test_a_run_whose_reward_leaves_float32_stops_naming_it_with_its_steps_checkpointed(tmp_path, write_spec, capsys):
    from grpo_core import checkpoint as ckpt
    from grpo_core.cli import main

    (tmp_path / "huge.py").write_text(HUGE)
    spec = write_spec(tmp_path, plugins=["huge.py"], rewards=[{"name": "huge"}])
    assert main([str(spec)]) == 1
    err = capsys.readouterr().err
    assert ("grpo-run: error: reward function 'huge' returned 1e+300, beyond the float32 range of rewards "
            "(|r| <= 3.403e+38) for completion 1 (prompt: ") in err
    assert "rewards must be finite real numbers, or None" in err and "train.reward_errors: none" in err
    assert "step 3 failed before its update; checkpoint of step 2" in err
    assert [f.name for f in ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")] == [f"{ckpt.PREFIX}000002"]


def test_a_weighted_sum_beyond_float32_is_an_error_naming_the_rewards_and_weights():
    """Each reward within float32's range, their weighted sum not: an error, never an
    infinite score (which would make the group's advantages NaN)."""
    fns = [RewardFn.of("big", 2.0, _constant(3e38)), RewardFn.of("small", 1.0, _constant(1.0))]
    for on_error in ("raise", "none"):
        with pytest.raises(RunError, match=r"the weighted sum of the rewards of completion 1 \(prompt: 'Name a "
                           r"prime.'\) is beyond float32's range \(\|r\| <= 3.4e38\): 'big' 3e\+38 x weight 2, "
                           r"'small' 1 x weight 1; scale the rewards or their weights down"):
            score(fns, PROMPTS, COMPLETIONS, {}, [[1], [2]], on_error)
