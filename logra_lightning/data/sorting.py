"""Sorting a list of numbers: ``Sort 42 7 19 88 3:`` -> ``Answer: 3 7 19 42 88``.

Lists of ``length`` numbers drawn from ``0..max_value`` (repeats allowed); the answer is the
list in ascending order, numbers separated by one space, graded by exact match of the text
after ``Answer:`` (:class:`~logra_lightning.rewards.AnswerMatchReward`).

Example::

    >>> make_record((42, 7, 19, 88, 3))["solution"]
    'Answer: 3 7 19 42 88'
    >>> len(SortingSource("train", test_size=8, train_size=32).load())
    32
"""

from __future__ import annotations

from logra_lightning.data.source import PromptSource
from logra_lightning.data.splits import ANSWER_PREFIX, check_source_args, split_problems


def make_record(numbers: tuple[int, ...], small: int = 10) -> dict:
    """The record of a list; ``slip_prone`` when its smallest number is below ``small``."""
    answer = " ".join(map(str, sorted(numbers)))
    return {
        "prompt": f"Sort {' '.join(map(str, numbers))}:",
        "answer": answer,
        "solution": f"{ANSWER_PREFIX}{answer}",
        "slip_prone": min(numbers) < small,
    }


class SortingSource(PromptSource):
    """Prompt source for sorting short lists of numbers (a ``class_path`` target in configs).

    Args:
        split: ``"train"`` or ``"test"``.
        length: numbers per list (2..12).
        max_value: numbers are drawn from ``0..max_value`` (1..999).
        test_size: held-out lists.
        train_size: training lists.
        seed: drawing seed (train and test must share it to stay disjoint).

    Raises:
        ConfigError: an argument out of range (the message names it).
    """

    def __init__(
        self,
        split: str = "train",
        length: int = 5,
        max_value: int = 99,
        test_size: int = 256,
        train_size: int = 20000,
        seed: int = 0,
    ) -> None:
        check_source_args(
            "SortingSource", split, test_size, train_size, {"length": (length, 2, 12), "max_value": (max_value, 1, 999)}
        )
        self.split, self.length, self.max_value = split, length, max_value
        self.test_size, self.train_size, self.seed = test_size, train_size, seed

    def load(self) -> list[dict]:
        draw = lambda rng: tuple(rng.randint(0, self.max_value) for _ in range(self.length))  # noqa: E731
        problems = split_problems(draw, self.seed, self.test_size, self.train_size, self.split, "SortingSource")
        return [make_record(p) for p in problems]
