"""Several rewards with weights: the sample's reward is their weighted sum, each part logged as ``reward/<name>``.

:func:`as_reward` reads ``model.reward``: one reward (:func:`~logra_lightning.rewards.user.one_reward`)
or a list of them, summed here with weight 1 each.

TRL's ``reward_funcs`` / ``reward_weights``. Each part is scored on its own
(:meth:`~logra_lightning.rl.faults.FaultPolicy.score`), so a part that raises or returns ``None`` for a
sample costs that part of that sample (0, counted in ``reward/errors``), not the others.

In a config::

    model:
      reward:
        class_path: logra_lightning.rewards.WeightedRewards
        init_args:
          rewards: [my_reward.py:correct, my_reward.py:well_formatted]
          weights: [1.0, 0.2]

Example::

    >>> from logra_lightning.rewards import ExactMatchReward
    >>> both = WeightedRewards([ExactMatchReward(), lambda completions: [len(c) / 10 for c in completions]],
    ...                        weights=[1.0, 0.5], names=["exact", "length"])
    >>> [(name, w) for name, _, w in both.parts]
    [('exact', 1.0), ('length', 0.5)]
    >>> both(["1+1="], ["2"], ["2"])
    [1.05]
"""

from __future__ import annotations

from collections.abc import Callable

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.fields import call_reward, reward_name
from logra_lightning.rewards.user import one_reward

# keys the module logs itself under reward/
RESERVED = {"mean", "std", "accuracy", "errors"}


class WeightedRewards:
    """The weighted sum of several rewards.

    Args:
        rewards: reward callables or specs (``my_reward.py:fn``, ``module.fn``: :mod:`~logra_lightning.rewards.user`).
        weights: one per reward (default 1.0 each).
        names: the ``reward/<name>`` of each (default: the function or class names).

    Raises:
        ConfigError: no rewards, weights or names of another length, a name used twice or one the module
            logs itself (``mean``, ``std``, ``accuracy``, ``errors``), or a reward that does not load.
    """

    def __init__(
        self,
        rewards: list[str | Callable],
        weights: list[float] | None = None,
        names: list[str] | None = None,
    ) -> None:
        if not rewards:
            raise ConfigError("WeightedRewards.rewards: empty; give at least one reward")
        for key, values in (("weights", weights), ("names", names)):
            if values is not None and len(values) != len(rewards):
                raise ConfigError(
                    f"WeightedRewards.{key}: {len(values)} values for {len(rewards)} rewards; give one per reward"
                )
        fns = [one_reward(r) for r in rewards]
        names = list(names) if names is not None else [reward_name(f) for f in fns]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"WeightedRewards: the name(s) {twice} are used twice; set names: [...] to tell apart")
        reserved = sorted(set(names) & RESERVED)
        if reserved:
            raise ConfigError(
                f"WeightedRewards: reward/{reserved[0]} is logged by the module itself; set names: [...] to rename"
            )
        self.parts: list[tuple[str, Callable, float]] = [
            (n, f, float(w)) for n, f, w in zip(names, fns, weights or [1.0] * len(fns))
        ]

    def __call__(self, prompts, completions, answers, **fields) -> list[float]:
        total = [0.0] * len(completions)
        for _, fn, weight in self.parts:
            for i, value in enumerate(call_reward(fn, prompts, completions, answers, fields)):
                total[i] += weight * float(value)
        return total


def as_reward(reward: Callable | str | list | None) -> Callable:
    """``model.reward`` as one callable: ``None`` is exact match, a list is the sum of its rewards.

    Raises:
        ConfigError: a reward that does not load (see :func:`~logra_lightning.rewards.user.load_reward`).
    """
    if isinstance(reward, (list, tuple)):
        return WeightedRewards(list(reward))
    return one_reward(reward)
