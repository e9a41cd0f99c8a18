"""What the reasoning tasks share: the answer marker and seeded, disjoint train/test draws.

The chain-of-thought arithmetic, countdown and sorting sources draw random problems rather
than enumerate them (the problem spaces are large). :func:`split_problems` makes the draw
deterministic and the splits disjoint: the first ``test_size`` distinct problems drawn from
``Random(seed)`` are the held-out split, the next ``train_size`` distinct ones the training split.

Example::

    >>> draw = lambda rng: rng.randint(0, 99)
    >>> test = split_problems(draw, seed=0, test_size=5, train_size=20, split="test", what="demo")
    >>> train = split_problems(draw, seed=0, test_size=5, train_size=20, split="train", what="demo")
    >>> len(train), set(test) & set(train)
    (20, set())
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from typing import Any

from logra_lightning.errors import ConfigError

SPLITS = ("train", "test")
ANSWER_PREFIX = "Answer: "  # every reasoning task ends its completion with "Answer: <final answer>"


def check_source_args(
    what: str, split: str, test_size: int, train_size: int, ranges: dict[str, tuple[Any, int, int]]
) -> None:
    """Raise a ``ConfigError`` naming ``what.key=value`` for a bad split, integer out of range or split size.

    ``ranges`` maps an argument's name to ``(value, low, high)`` (inclusive), checked in order.
    """
    if split not in SPLITS:
        raise ConfigError(f"{what}.split={split!r}: allowed values are {SPLITS}")
    for key, (value, low, high) in ranges.items():
        if not (isinstance(value, int) and low <= value <= high):
            raise ConfigError(f"{what}.{key}={value!r}: allowed range is {low}..{high}")
    for key, value in (("test_size", test_size), ("train_size", train_size)):
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{what}.{key}={value!r}: must be an integer >= 1")


def split_problems(
    draw: Callable[[random.Random], Any],
    seed: int,
    test_size: int,
    train_size: int,
    split: str,
    what: str,
    key: Callable[[Any], Hashable] = lambda p: p,
) -> list:
    """``test_size`` distinct problems from ``draw(rng)``, or the next ``train_size`` distinct ones not among them.

    Args:
        draw: one random problem (hashable) from the generator it is given.
        seed: seed of the generator (both splits must use the same one).
        test_size, train_size: sizes of the two splits.
        split: ``"train"`` or ``"test"``.
        what: the source's name, for the error message.
        key: what makes two problems the same (default: the problem itself); a problem whose key
            was drawn before is skipped.

    Raises:
        ConfigError: the problem space is too small for the sizes asked for.
    """
    rng, seen, chosen = random.Random(seed), set(), []
    want = test_size if split == "test" else test_size + train_size
    attempts = 0
    while len(seen) < want:
        problem = draw(rng)
        attempts += 1
        if attempts > 50 * want + 1000:
            raise ConfigError(
                f"{what}: only {len(seen)} distinct problems found for test_size + train_size = {want}; "
                "lower train_size or test_size, or widen the problem range"
            )
        if key(problem) in seen:
            continue
        seen.add(key(problem))
        if split == "test" or len(seen) > test_size:
            chosen.append(problem)
    return chosen
