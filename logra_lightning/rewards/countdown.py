"""The countdown reward: does the final expression reach the target, each given number used at most once?

The expression after the last ``Answer:`` is parsed with :func:`ast.parse` and evaluated by
walking the tree (:func:`evaluate`); ``eval`` is never called, so a completion cannot run code.
Allowed: non-negative integer literals, ``+ - * /`` and parentheses. Division is exact
(:class:`fractions.Fraction`); dividing by zero, any other syntax (names, calls, ``**``, unary
minus, floats, attributes), an expression longer than ``max_chars`` or nested deeper than
:data:`MAX_DEPTH` scores 0. The reference answer of a record states the problem, ``"46 from 7 25 3"``
(:mod:`logra_lightning.data.countdown`).

Example::

    >>> reward = CountdownReward()
    >>> reward(["q"] * 4, ["Answer: 25+(3*7)", "Answer: 25+21", "Answer: 7*7-3", "Answer: __import__('os')"],
    ...        ["46 from 7 25 3"] * 4)
    [1.0, 0.0, 0.0, 0.0]

(``21`` is not a given number; ``7*7-3`` uses the one 7 twice; a call is not arithmetic.)
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.answer import MARKER, final_answer

MAX_DEPTH = 32
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_PROBLEM_RE = re.compile(r"\s*(\d+)\s+from\s+(\d+(?:\s+\d+)*)\s*")


class ExpressionError(ValueError):
    """The text is not an arithmetic expression this reward accepts."""


def evaluate(expression: str, max_chars: int = 64) -> tuple[Fraction, list[int]]:
    """``(value, the integer literals used, in order)`` of an arithmetic expression, without ``eval``.

    Raises:
        ExpressionError: not an expression of integers, ``+ - * /`` and parentheses, too long, too
            deep, or a division by zero.

    Example::

        >>> evaluate("(10*5)-4")
        (Fraction(46, 1), [10, 5, 4])
    """
    if len(expression) > max_chars:
        raise ExpressionError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes
        raise ExpressionError(f"not an expression: {err}") from None
    numbers: list[int] = []

    def walk(node: ast.AST, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExpressionError(f"nested deeper than {MAX_DEPTH}")
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ExpressionError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ExpressionError(f"{type(node).__name__} is not allowed")

    return walk(tree.body, 0), numbers


def parse_problem(answer: str) -> tuple[int, list[int]]:
    """``"46 from 7 25 3"`` -> ``(46, [7, 25, 3])``.

    Raises:
        ValueError: ``answer`` is not in that form (the data source's ``answer`` field is wrong).
    """
    m = _PROBLEM_RE.fullmatch(answer)
    if m is None:
        raise ValueError(f"countdown answer {answer!r} is not '<target> from <n1> <n2> ...'")
    return int(m[1]), [int(n) for n in m[2].split()]


def countdown_score(completion: str, answer: str, marker: str = MARKER, max_chars: int = 64) -> float:
    """1.0 when the final expression equals the target and uses each given number at most once.

    >>> countdown_score("Answer: 7*7-3", "46 from 7 25 3"), countdown_score("Answer: 7*7-3", "46 from 7 7 3")
    (0.0, 1.0)
    """
    target, given = parse_problem(answer)
    expression = final_answer(completion, marker)
    if not expression:
        return 0.0
    try:
        value, used = evaluate(expression, max_chars)
    except ExpressionError:
        return 0.0
    return float(value == target and not Counter(used) - Counter(given))


class CountdownReward:
    """1.0 when the expression after ``Answer:`` reaches the target with the given numbers, else 0.0.

    Args:
        marker: the text that introduces the final answer.
        max_chars: longest expression accepted (longer ones score 0).

    Raises:
        ConfigError: an empty marker or a non-positive ``max_chars``.
        ValueError: (when called) a reference answer not of the form ``"46 from 7 25 3"``.

    In a config::

        model:
          reward: {class_path: logra_lightning.rewards.CountdownReward}
    """

    def __init__(self, marker: str = MARKER, max_chars: int = 64) -> None:
        if not isinstance(marker, str) or not marker.strip():
            raise ConfigError(f"CountdownReward.marker={marker!r}: must be a non-empty string")
        if not (isinstance(max_chars, int) and max_chars >= 1):
            raise ConfigError(f"CountdownReward.max_chars={max_chars!r}: must be an integer >= 1")
        self.marker, self.max_chars = marker, max_chars

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return [countdown_score(c, a, self.marker, self.max_chars) for c, a in zip(completions, answers, strict=True)]
