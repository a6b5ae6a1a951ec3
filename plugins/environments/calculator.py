"""A safe arithmetic evaluator (no ``eval``): the built-in ``calculator`` tool.

The expression is parsed with :mod:`ast` and walked node by node; only numbers (int and
float literals), the binary operators ``+ - * / // % **``, unary ``+``/``-`` and
parentheses are accepted. Names, attributes, calls, subscripts, comparisons, strings
and every other node are refused with a :class:`CalculatorError` naming what was found.
Limits keep one call cheap: the expression's length, the exponent of ``**``, and the
size of every intermediate integer.
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["CalculatorError", "evaluate", "calculator", "MAX_EXPRESSION_CHARS", "MAX_EXPONENT", "MAX_INT_DIGITS"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # |b| in a ** b
MAX_INT_DIGITS = 100  # decimal digits of any intermediate integer

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_DIGITS} digits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} is out of range (|exponent| <= {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and base not in (0, 1, -1):
        # digits of base**exponent ~ exponent * log10|base|: refuse before computing it
        if exponent * math.log10(abs(base)) >= MAX_INT_DIGITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_DIGITS} digits)")
    try:
        result = base**exponent
    except OverflowError as exc:
        raise CalculatorError("result too large") from exc
    except ZeroDivisionError as exc:
        raise CalculatorError("division by zero (zero to a negative power)") from exc
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power has no real value")
    return result


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as exc:
            raise CalculatorError("division by zero") from exc
        except OverflowError as exc:
            raise CalculatorError("result too large") from exc
    what = type(node).__name__
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = type(node.op).__name__
    raise CalculatorError(
        f"unsupported element {what}: use numbers, + - * / // % **, unary minus and parentheses"
    )


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (Python's semantics: ``/`` is true
    division, ``//`` and ``%`` floor), or a :class:`CalculatorError`."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not a valid expression: {exc.msg}") from None
    return _eval(tree)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its exact value.

    Args:
        expression: The arithmetic expression, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 31".
    """
    value = evaluate(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)
