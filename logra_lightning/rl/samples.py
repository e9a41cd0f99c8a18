"""One RL step's scored samples as plain rows: what :class:`~logra_lightning.callbacks.LogCompletions` shows.

:class:`~logra_lightning.rl.module.PolicyGradientModule` keeps the latest step's as ``last_samples``:
row ``i`` is sample ``i`` of the rollout (each prompt repeated once per sample of its group), with its
reward and, for a :class:`~logra_lightning.rewards.WeightedRewards`, the value of each part.

Example::

    >>> import torch
    >>> s = ScoredSamples.of(3, ["1+1="], ["2"], 2, ["2", "3"], torch.tensor([1.0, 0.0]), {"exact": [1.0, 0.0]})
    >>> s.rows(1)
    [{'step': 3, 'prompt': '1+1=', 'completion': '2', 'answer': '2', 'reward': 1.0, 'reward/exact': 1.0}]
    >>> s.part_means()
    {'exact': 0.5}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ScoredSamples:
    """The samples of one rollout with their rewards (row ``i`` is sample ``i``)."""

    step: int
    prompts: list[str]
    completions: list[str]
    answers: list[str]
    rewards: list[float]
    parts: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        step: int,
        prompts: list[str],
        answers: list[str],
        group_size: int,
        completions: list[str],
        rewards: torch.Tensor,
        parts: dict[str, list[float]],
    ) -> ScoredSamples:
        """From a batch's ``prompts``/``answers`` (one per prompt) and its ``group_size`` samples per prompt."""
        return cls(
            step,
            [p for p in prompts for _ in range(group_size)],
            list(completions),
            [a for a in answers for _ in range(group_size)],
            rewards.tolist(),  # [N]
            {k: list(v) for k, v in parts.items()},
        )

    def part_means(self) -> dict[str, float]:
        """``{name: mean}`` of each reward part (empty for a single reward)."""
        return {k: sum(v) / len(v) for k, v in self.parts.items() if v}

    def rows(self, n: int | None = None) -> list[dict]:
        """The first ``n`` samples (all: ``None``) as ``{step, prompt, completion, answer, reward, reward/<part>}``."""
        end = len(self.completions) if n is None else min(n, len(self.completions))
        return [
            {
                "step": self.step,
                "prompt": self.prompts[i],
                "completion": self.completions[i],
                "answer": self.answers[i],
                "reward": self.rewards[i],
                **{f"reward/{k}": v[i] for k, v in self.parts.items()},
            }
            for i in range(end)
        ]
