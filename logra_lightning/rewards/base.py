"""Reward functions: the interface, the arithmetic exact-match reward, and the safe caller.

A reward function is any callable ``reward(prompts, completions, answers) -> list[float]``
(one float per completion) that may also take the record's other fields by name
(:mod:`~logra_lightning.rewards.fields`); configs pick a class by ``class_path``, or a function by
``my_reward.py:fn`` (:mod:`~logra_lightning.rewards.user`). The module calls it through
:func:`safe_rewards`, so one sample that raises costs that sample (reward 0, counted), not the run.

Example::

    >>> ExactMatchReward()(["1+1="], ["2"], ["2"])
    [1.0]
    >>> safe_rewards(lambda p, c, a: 1 / 0, ["q"], ["c"], ["a"])
    ([0.0], 1, 'ZeroDivisionError: division by zero')
    >>> safe_rewards(lambda completions, level: [None if x > 1 else 1.0 for x in level], ["q"] * 2, ["c"] * 2,
    ...              ["a"] * 2, fields={"level": [1, 2]})
    ([1.0, nan], 0, None)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.fields import call_reward


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


def _as_float(value) -> float:
    return math.nan if value is None else float(value)


def safe_rewards(
    reward_fn: Callable,
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    fields: dict[str, list] | None = None,
) -> tuple[list[float], int, str | None]:
    """Call ``reward_fn`` on the batch (with the ``fields`` it asks for); if it raises, score sample by sample.

    Returns:
        ``(rewards, n_errors, first_error)``: samples whose scoring raised get 0.0, a ``None`` reward
        becomes NaN (a failed sample to :class:`~logra_lightning.rl.faults.FaultPolicy`);
        ``first_error`` is ``"ExcType: message"`` of the first failure, else ``None``.

    Raises:
        ConfigError: the function's signature cannot take these fields (no sample's fault).
    """
    fields = fields or {}
    try:
        out = [_as_float(r) for r in call_reward(reward_fn, prompts, completions, answers, fields)]
        if len(out) == len(completions):
            return out, 0, None
        raise ValueError(f"reward function returned {len(out)} values for {len(completions)} completions")
    except ConfigError:
        raise
    except Exception as batch_err:  # noqa: BLE001 - any failure of user code falls back to per-sample scoring
        first = f"{type(batch_err).__name__}: {batch_err}"
    rewards, errors = [], 0
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
        try:
            one = {k: v[i : i + 1] for k, v in fields.items()}
            rewards.append(_as_float(call_reward(reward_fn, [p], [c], [a], one)[0]))
        except Exception as err:  # noqa: BLE001
            rewards.append(0.0)
            errors += 1
            first = first if errors > 1 else f"{type(err).__name__}: {err}"
    return rewards, errors, first if errors else None
