"""Multi-digit addition and subtraction with a written chain of thought: ``347+586=`` -> ``... Answer: 933``.

The completion works column by column from the ones digit, carries and borrows written out,
then states the result after ``Answer:`` (graded by :class:`~logra_lightning.rewards.AnswerMatchReward`)::

    347+586=  7+6=13, 4+8+1=13, 3+5+1=9; Answer: 933
    586-347=  16-7=9, 7-4=3, 5-3=2; Answer: 239

In an addition column ``x+y+1`` means a carry came in; in a subtraction column ``16-7`` means
the top digit borrowed ten, and the next column's top digit is written already reduced by one
(``8`` became ``7``). Subtraction keeps ``a >= b``, so every answer is a natural number.

Problems are drawn from ``Random(seed)``: the first ``test_size`` distinct ones are the held-out
``test`` split, the next ``train_size`` distinct ones not in it the ``train`` split, so the splits
are disjoint by construction and the same on every machine for the same arguments. Records
carry ``prompt``, ``answer`` and ``solution`` (the full reference completion, used by the
supervised warm-up of :mod:`logra_lightning.builtin.reasoning`).

Example::

    >>> chain_of_thought(586, "-", 347)
    '16-7=9, 7-4=3, 5-3=2; Answer: 239'
    >>> test = ChainArithmeticSource("test", test_size=4).load()
    >>> test[0]["prompt"][-1], test[0]["solution"].endswith("Answer: " + test[0]["answer"])
    ('=', True)
"""

from __future__ import annotations

import random

from logra_lightning.data.source import PromptSource
from logra_lightning.data.splits import ANSWER_PREFIX, check_source_args, split_problems
from logra_lightning.errors import ConfigError

OPS = "+-"


def chain_of_thought(a: int, op: str, b: int) -> str:
    """The reference completion of ``a op b`` (``op`` in ``+-``; for ``-`` needs ``a >= b``)."""
    if op not in OPS or (op == "-" and a < b) or min(a, b) < 0:
        raise ValueError(f"chain_of_thought supports a+b and a-b with a >= b >= 0, got {a}{op}{b}")
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        if op == "+":
            total = x + y + carry
            steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
            carry = total // 10
        else:
            top = x - carry  # the borrow of the previous column, already taken
            carry = int(top < y)
            steps.append(f"{top + 10 * carry}-{y}={top + 10 * carry - y}")
    result = a + b if op == "+" else a - b
    return f"{', '.join(steps)}; {ANSWER_PREFIX}{result}"


def ones_carry(a: int, op: str, b: int) -> bool:
    """Whether the ones column of ``a op b`` carries (``+``) or borrows (``-``).

    >>> ones_carry(347, "+", 586), ones_carry(341, "+", 586), ones_carry(586, "-", 347)
    (True, False, True)
    """
    return (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)


def draw_problem(rng: random.Random, digits: int, ops: str) -> tuple[int, str, int]:
    """One ``(a, op, b)`` with ``digits``-digit operands (subtraction ordered so that ``a >= b``)."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(ops)
    return (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)


def make_record(a: int, op: str, b: int) -> dict:
    """``{"prompt": "a op b=", "answer": str(result), "solution": chain of thought, "slip_prone": ones carry}``."""
    result = a + b if op == "+" else a - b
    return {
        "prompt": f"{a}{op}{b}=",
        "answer": str(result),
        "solution": chain_of_thought(a, op, b),
        "slip_prone": ones_carry(a, op, b),
    }


class ChainArithmeticSource(PromptSource):
    """Prompt source for addition/subtraction with a written chain of thought (a ``class_path`` target).

    Args:
        split: ``"train"`` or ``"test"``.
        digits: operand length (1..4).
        ops: operations, any of ``"+-"``.
        test_size: held-out problems.
        train_size: training problems.
        seed: drawing seed (train and test must share it to stay disjoint).

    Raises:
        ConfigError: an argument out of range (the message names it).

    Example::

        >>> len(ChainArithmeticSource("train", digits=2, test_size=10, train_size=50).load())
        50
    """

    def __init__(
        self,
        split: str = "train",
        digits: int = 3,
        ops: str = OPS,
        test_size: int = 256,
        train_size: int = 20000,
        seed: int = 0,
    ) -> None:
        check_source_args("ChainArithmeticSource", split, test_size, train_size, {"digits": (digits, 1, 4)})
        if not ops or any(op not in OPS for op in ops):
            raise ConfigError(f"ChainArithmeticSource.ops={ops!r}: use a non-empty string of {OPS!r}")
        self.split, self.digits, self.ops = split, digits, ops
        self.test_size, self.train_size, self.seed = test_size, train_size, seed

    def load(self) -> list[dict]:
        problems = split_problems(
            lambda rng: draw_problem(rng, self.digits, self.ops),
            self.seed,
            self.test_size,
            self.train_size,
            self.split,
            "ChainArithmeticSource",
        )
        return [make_record(*p) for p in problems]
