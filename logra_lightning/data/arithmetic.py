"""A synthetic arithmetic task: ``37+48=`` -> ``85``, generated from a seed.

Every problem ``a op b`` with operands of 1..``max_digits`` digits and an op from
``ops`` is enumerated once, shuffled with ``seed`` and cut into a held-out ``test``
split (the first ``test_size``) and a ``train`` split (the rest), so the splits are
disjoint by construction and identical on every machine for the same arguments.

Example::

    >>> train = ArithmeticSource(split="train", max_digits=1, ops="+", test_size=10).load()
    >>> test = ArithmeticSource(split="test", max_digits=1, ops="+", test_size=10).load()
    >>> len(train), len(test), test[0]["prompt"].endswith("=")
    (90, 10, True)
    >>> not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    True
"""

from __future__ import annotations

import random
import re

from logra_lightning.data.source import PromptSource
from logra_lightning.errors import ConfigError

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SPLITS = ("train", "test")


def enumerate_problems(max_digits: int, ops: str) -> list[tuple[int, str, int]]:
    """All ``(a, op, b)`` with ``0 <= a, b < 10**max_digits`` and ``op`` in ``ops``, in a fixed order."""
    top = 10**max_digits
    return [(a, op, b) for op in ops for a in range(top) for b in range(top)]


def format_problem(a: int, op: str, b: int) -> dict[str, str]:
    """``{"prompt": "a op b=", "answer": str(result)}``."""
    return {"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))}


def ones_carry(prompt: str) -> bool:
    """Whether the ones digits of ``"a op b="`` carry (``+``, ``*``: their result >= 10) or borrow (``-``).

    >>> ones_carry("37+48="), ones_carry("31+48="), ones_carry("31-48="), ones_carry("3*4=")
    (True, False, True, True)
    """
    m = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    a, op, b = int(m[1]) % 10, m[2], int(m[3]) % 10
    return a < b if op == "-" else _OPS[op](a, b) >= 10


class ArithmeticSource(PromptSource):
    """Prompt source for the arithmetic task (a ``class_path`` target in configs).

    Args:
        split: ``"train"`` or ``"test"``.
        max_digits: largest operand length (1..3).
        ops: operations to include, any of ``"+-*"``.
        test_size: number of held-out problems.
        seed: shuffle seed (train and test must share it to stay disjoint).

    Raises:
        ConfigError: an argument out of range (the message names it).
    """

    def __init__(self, split: str = "train", max_digits: int = 2, ops: str = "+", test_size: int = 256, seed: int = 0):
        if split not in SPLITS:
            raise ConfigError(f"ArithmeticSource.split={split!r}: allowed values are {SPLITS}")
        if not 1 <= max_digits <= 3:
            raise ConfigError(f"ArithmeticSource.max_digits={max_digits}: allowed range is 1..3")
        if not ops or any(op not in _OPS for op in ops):
            raise ConfigError(f"ArithmeticSource.ops={ops!r}: use a non-empty string of {''.join(_OPS)}")
        total = len(ops) * 100**max_digits
        if not 0 < test_size < total:
            raise ConfigError(f"ArithmeticSource.test_size={test_size}: allowed range is 1..{total - 1}")
        self.split, self.max_digits, self.ops, self.test_size, self.seed = split, max_digits, ops, test_size, seed

    def load(self) -> list[dict[str, str]]:
        problems = enumerate_problems(self.max_digits, self.ops)
        random.Random(self.seed).shuffle(problems)
        chosen = problems[: self.test_size] if self.split == "test" else problems[self.test_size :]
        return [format_problem(*p) for p in chosen]
