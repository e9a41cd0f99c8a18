"""Exact match of the final answer of a written-out completion (``... ; Answer: 933``).

The reasoning tasks (:mod:`logra_lightning.data.chain_arithmetic`, :mod:`~logra_lightning.data.sorting`)
end their completions with ``Answer: <final answer>``. The reward reads the text after the
*last* marker and compares it, stripped of surrounding whitespace, to the reference: the
working before it is not graded, and an answer with anything after it (``933.``) is wrong.

Example::

    >>> AnswerMatchReward()(["347+586="] * 3, ["7+6=13; Answer: 933", "Answer: 933.", "933"], ["933"] * 3)
    [1.0, 0.0, 0.0]
"""

from __future__ import annotations

from logra_lightning.errors import ConfigError

MARKER = "Answer:"


def final_answer(completion: str, marker: str = MARKER) -> str | None:
    """The stripped text after the last ``marker`` in ``completion``, or ``None`` without a marker.

    >>> final_answer("3*7=21; Answer: (3*7)+25 "), final_answer("no marker")
    ('(3*7)+25', None)
    """
    at = completion.rfind(marker)
    return None if at < 0 else completion[at + len(marker) :].strip()


def answer_match_score(completion: str, answer: str, marker: str = MARKER) -> float:
    """1.0 when the final answer of ``completion`` equals ``answer`` (both stripped), else 0.0."""
    got = final_answer(completion, marker)
    return float(got is not None and got == answer.strip())


class AnswerMatchReward:
    """1.0 when the text after the last ``Answer:`` equals the reference answer, else 0.0.

    Args:
        marker: the text that introduces the final answer.

    Raises:
        ConfigError: an empty marker.

    In a config::

        model:
          reward: {class_path: logra_lightning.rewards.AnswerMatchReward}
    """

    def __init__(self, marker: str = MARKER) -> None:
        if not isinstance(marker, str) or not marker.strip():
            raise ConfigError(f"AnswerMatchReward.marker={marker!r}: must be a non-empty string")
        self.marker = marker

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return [answer_match_score(c, a, self.marker) for c, a in zip(completions, answers, strict=True)]
