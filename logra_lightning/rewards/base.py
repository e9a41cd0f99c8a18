"""Reward functions: the interface, the arithmetic exact-match reward, and the safe caller.

A reward function is any callable ``reward(prompts, completions, answers) -> list[float]``
(one float per completion); configs pick a class by ``class_path``. The module calls it
through :func:`safe_rewards`, so one sample that raises costs that sample (reward 0,
counted), not the run.

Example::

    >>> ExactMatchReward()(["1+1="], ["2"], ["2"])
    [1.0]
    >>> safe_rewards(lambda p, c, a: 1 / 0, ["q"], ["c"], ["a"])
    ([0.0], 1, 'ZeroDivisionError: division by zero')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class RewardFn(Protocol):
    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]: ...


class ExactMatchReward:
    """1.0 when the stripped completion equals the reference answer, else 0.0.

    Args:
        strip: strip whitespace on both sides before comparing.
    """

    def __init__(self, strip: bool = True) -> None:
        self.strip = strip

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        norm = (lambda s: s.strip()) if self.strip else (lambda s: s)
        return [float(norm(c) == norm(a)) for c, a in zip(completions, answers)]


def safe_rewards(
    reward_fn: Callable, prompts: list[str], completions: list[str], answers: list[str]
) -> tuple[list[float], int, str | None]:
    """Call ``reward_fn`` on the batch; if it raises, score sample by sample.

    Returns:
        ``(rewards, n_errors, first_error)``: samples whose scoring raised get 0.0;
        ``first_error`` is ``"ExcType: message"`` of the first failure, else ``None``.
    """
    try:
        out = [float(r) for r in reward_fn(prompts, completions, answers)]
        if len(out) == len(completions):
            return out, 0, None
        raise ValueError(f"reward function returned {len(out)} values for {len(completions)} completions")
    except Exception as batch_err:  # noqa: BLE001 - any failure of user code falls back to per-sample scoring
        first = f"{type(batch_err).__name__}: {batch_err}"
    rewards, errors = [], 0
    for p, c, a in zip(prompts, completions, answers):
        try:
            rewards.append(float(reward_fn([p], [c], [a])[0]))
        except Exception as err:  # noqa: BLE001
            rewards.append(0.0)
            errors += 1
            first = first if errors > 1 else f"{type(err).__name__}: {err}"
    return rewards, errors, first if errors else None
