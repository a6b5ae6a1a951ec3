"""The calculator tool (grpo_plugins.environments.calculator): Python's arithmetic on what it accepts,
a refusal naming the culprit for everything else, and bounded work per call."""

from __future__ import annotations

import math
import time

import pytest
from grpo_plugins.environments.calculator import MAX_EXPONENT, CalculatorError, calculator, evaluate
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1234 * 5678", 7006652),
        ("(12 + 7) * 31", 589),
        ("-3 ** 2", -9),  # ** binds tighter than unary minus, as in Python
        ("(-3) ** 2", 9),
        ("7 / 2", 3.5),
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("2 ** -2", 0.25),
        ("+5 - -5", 10),
        ("1.5e3 + 0.25", 1500.25),
        ("  ((((1))))  ", 1),
    ],
)
def test_hand_cases(expression, value):
    assert evaluate(expression) == value


def test_the_tool_prints_integral_floats_as_integers():
    assert calculator("6 / 3") == "2"
    assert calculator("7 / 2") == "3.5"
    assert calculator("347 * 29") == "10063"


@pytest.mark.parametrize(
    ("expression", "culprit"),
    [
        ("__import__('os').system('true')", "Call"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("[1, 2][0]", "Subscript"),
        ("1 < 2", "Compare"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("1 if 1 else 2", "IfExp"),
        ("lambda: 1", "Lambda"),
        ("1 & 3", "BitAnd"),
        ("~1", "Invert"),
        ("1 +", "not a valid expression"),
        ("1; 2", "not a valid expression"),
    ],
)
def test_anything_but_arithmetic_is_refused_naming_it(expression, culprit):
    with pytest.raises(CalculatorError, match=culprit):
        evaluate(expression)


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("2 ** 1000", "out of range"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("99 ** 60", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "no real value"),
        ("1e308 * 10", "not a finite number"),
        ("1" + " + 1" * 200, "longer than"),
    ],
)
def test_limits_bound_the_work_of_one_call(expression, reason):
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - t0 < 1


# Bounded so that no intermediate value leaves the calculator's limits while the final one
# is within them (the calculator checks every intermediate value, Python only the last).
numbers = st.one_of(
    st.integers(-1000, 1000),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).filter(lambda x: x == 0 or abs(x) > 1e-6),
)


@st.composite
def expressions(draw, depth=3):
    """A random expression of safe inputs and its text (every subterm parenthesised)."""
    if depth == 0 or draw(st.booleans()):
        value = draw(numbers)
        return repr(value) if value >= 0 else f"({value!r})"
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%", "**"]))
    left, right = draw(expressions(depth=depth - 1)), draw(expressions(depth=depth - 1))
    if op == "**":
        right = str(draw(st.integers(0, 3)))
    if draw(st.booleans()):
        return f"-({left} {op} {right})"
    return f"({left} {op} {right})"


@settings(max_examples=300, deadline=None)
@given(expressions())
def test_agrees_with_python_arithmetic(expression):
    try:
        expected = eval(expression, {"__builtins__": {}}, {})  # the oracle, on generated arithmetic only
    except (ZeroDivisionError, OverflowError):
        with pytest.raises(CalculatorError):
            evaluate(expression)
        return
    if isinstance(expected, complex) or (isinstance(expected, float) and not math.isfinite(expected)):
        with pytest.raises(CalculatorError):
            evaluate(expression)
        return
    if isinstance(expected, int) and abs(expected) >= 10**100:
        with pytest.raises(CalculatorError):
            evaluate(expression)
        return
    got = evaluate(expression)
    assert type(got) is type(expected)
    assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_exponent_limit_is_inclusive():
    assert evaluate(f"1 ** {MAX_EXPONENT}") == 1
    with pytest.raises(CalculatorError, match="out of range"):
        evaluate(f"1 ** {MAX_EXPONENT + 1}")
