"""The countdown game: reach a target with given numbers, ``Make 46 from 7 25 3:`` -> ``... Answer: (3*7)+25``.

Each problem is made from a random expression ``(x op y) op z`` over three numbers in
``1..max_number`` with ops from ``ops`` (``+``, ``-``, ``*``), every intermediate value positive
and the target in ``1..max_target`` and not one of the numbers; the numbers are shown shuffled.
The reference completion writes the two steps, then the expression::

    Make 46 from 7 25 3:  3*7=21, 25+21=46; Answer: 25+(3*7)

Any expression reaching the target counts, not only the reference one:
:class:`~logra_lightning.rewards.CountdownReward` parses the answer with ``ast`` (never
``eval``) and checks that each given number is used at most once. The record's ``answer``
states the problem for the reward as ``"46 from 7 25 3"`` (target, then the numbers).

Example::

    >>> rec = make_record((3, "*", 7, "+", 25, True), order=(7, 25, 3))
    >>> rec["prompt"], rec["answer"], rec["solution"]
    ('Make 46 from 7 25 3:', '46 from 7 25 3', '3*7=21, 25+21=46; Answer: 25+(3*7)')
"""

from __future__ import annotations

import random

from logra_lightning.data.source import PromptSource
from logra_lightning.data.splits import ANSWER_PREFIX, check_source_args, split_problems
from logra_lightning.errors import ConfigError

OPS = "+-*"
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# A solution (x, op1, y, op2, z, z_first): the value (x op1 y) op2 z, or z op2 (x op1 y) when z_first.
Solution = tuple[int, str, int, str, int, bool]


def solve(sol: Solution) -> tuple[int, int]:
    """``(value of the first step, target)`` of a solution."""
    x, op1, y, op2, z, z_first = sol
    first = _APPLY[op1](x, y)
    return first, (_APPLY[op2](z, first) if z_first else _APPLY[op2](first, z))


def draw_solution(rng: random.Random, max_number: int, ops: str, max_target: int) -> Solution:
    """A random solution whose steps stay positive and whose target is in ``1..max_target``, not a given number."""
    while True:
        x, y, z = (rng.randint(1, max_number) for _ in range(3))
        op1, op2 = rng.choice(ops), rng.choice(ops)
        if op1 == "-" and x < y:
            x, y = y, x
        first = _APPLY[op1](x, y)
        z_first = op2 != "-" and rng.random() < 0.5 or (op2 == "-" and z > first)
        sol = (x, op1, y, op2, z, z_first)
        target = solve(sol)[1]
        if first >= 1 and 1 <= target <= max_target and target not in (x, y, z):
            return sol


def make_record(sol: Solution, order: tuple[int, int, int]) -> dict:
    """The record of a solution with its numbers shown in ``order``; ``slip_prone`` when it multiplies."""
    x, op1, y, op2, z, z_first = sol
    first, target = solve(sol)
    inner = f"({x}{op1}{y})"
    step2, expr = (f"{z}{op2}{first}", f"{z}{op2}{inner}") if z_first else (f"{first}{op2}{z}", f"{inner}{op2}{z}")
    shown = " ".join(map(str, order))
    return {
        "prompt": f"Make {target} from {shown}:",
        "answer": f"{target} from {shown}",
        "solution": f"{x}{op1}{y}={first}, {step2}={target}; {ANSWER_PREFIX}{expr}",
        "slip_prone": "*" in (op1, op2),
    }


class CountdownSource(PromptSource):
    """Prompt source for the countdown game with three numbers (a ``class_path`` target in configs).

    Args:
        split: ``"train"`` or ``"test"``.
        max_number: the numbers are drawn from ``1..max_number`` (2..99).
        ops: operations of the generating expression, any of ``"+-*"``.
        max_target: largest target (``1..999``).
        test_size: held-out problems.
        train_size: training problems (about 12,000 distinct problems exist with the defaults).
        seed: drawing seed (train and test must share it to stay disjoint).

    Raises:
        ConfigError: an argument out of range (the message names it).

    Example::

        >>> recs = CountdownSource("test", test_size=3).load()
        >>> [r["prompt"].startswith("Make ") for r in recs]
        [True, True, True]
    """

    def __init__(
        self,
        split: str = "train",
        max_number: int = 20,
        ops: str = OPS,
        max_target: int = 99,
        test_size: int = 256,
        train_size: int = 10000,
        seed: int = 0,
    ) -> None:
        check_source_args(
            "CountdownSource",
            split,
            test_size,
            train_size,
            {"max_number": (max_number, 2, 99), "max_target": (max_target, 1, 999)},
        )
        if not ops or any(op not in OPS for op in ops):
            raise ConfigError(f"CountdownSource.ops={ops!r}: use a non-empty string of {OPS!r}")
        self.split, self.max_number, self.ops, self.max_target = split, max_number, ops, max_target
        self.test_size, self.train_size, self.seed = test_size, train_size, seed

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], int, Solution]:
        sol = draw_solution(rng, self.max_number, self.ops, self.max_target)
        order = [sol[0], sol[2], sol[4]]
        rng.shuffle(order)
        return tuple(order), solve(sol)[1], sol

    def load(self) -> list[dict]:
        problems = split_problems(
            self._draw,
            self.seed,
            self.test_size,
            self.train_size,
            self.split,
            "CountdownSource",
            key=lambda p: (tuple(sorted(p[0])), p[1]),
        )
        return [make_record(sol, order) for order, _, sol in problems]
