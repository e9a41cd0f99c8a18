"""The RL step's engine-facing side: seeded sampling, engine failures, and safe rewards.

:class:`EngineSampling` is a base of :class:`~logra_lightning.rl.module.PolicyGradientModule`. Each
rollout samples with a seed derived from ``(sampling_seed, rollout index, rank)`` (the module's
departure 3), so a run resumed from a checkpoint samples what the uninterrupted run sampled; an
engine that raises or returns the wrong number of completions stops training with a
:class:`~logra_lightning.errors.TrainingError` (:func:`~logra_lightning.rl.faults.engine_failure`);
rewards are scored through :class:`~logra_lightning.rl.faults.FaultPolicy`, which turns a failing or
non-finite reward into a zero and counts it.

It reads the module's ``sampling``, ``engine``, ``reward_fn``, ``faults``, ``global_rank``,
``global_step`` and the checkpointed ``_sampling_seed`` and ``_rollouts``.

Example::

    >>> from logra_lightning.rl.module import PolicyGradientModule
    >>> issubclass(PolicyGradientModule, EngineSampling)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from logra_lightning._util import mix_seed
from logra_lightning.rl.faults import engine_failure
from logra_lightning.rollout import Rollout, SamplingConfig


class EngineSampling:
    """Sampling seeds per rollout, the engine call with its failure check, and reward scoring."""

    def _next_sampling(self) -> SamplingConfig:
        """This rollout's sampling, seeded from ``(sampling_seed, rollout index, rank)``; advances the index."""
        sampling = self.sampling
        if sampling.seed is None:  # a subclass may set its own seed
            seed = mix_seed(self._sampling_seed or 0, self._rollouts, self.global_rank) % (2**31 - 1)
            sampling = dataclasses.replace(sampling, seed=seed)
        self._rollouts += 1
        return sampling

    def _checked(self, sample: Callable[[], Rollout], expected: int) -> Rollout:
        """``sample()``, with ``expected`` completions; a failing engine stops training."""
        try:
            rollout = sample()
            if len(rollout) != expected:
                raise RuntimeError(f"returned {len(rollout)} completions, expected {expected}")
        except Exception as err:
            raise engine_failure(err, self.engine, self.global_step, self._trainer) from err
        return rollout

    def _generate(self, prompt_ids: list[list[int]], n: int) -> Rollout:
        """Sample ``n`` completions per prompt with this rollout's seed; a failing engine stops training."""
        sampling = self._next_sampling()
        return self._checked(lambda: self.engine.generate(prompt_ids, n=n, sampling=sampling), len(prompt_ids) * n)

    def _score(
        self, prompts: list[str], completions: list[str], answers: list[str], fields: dict[str, list] | None = None
    ) -> torch.Tensor:
        return self.faults.score(self.reward_fn, prompts, completions, answers, self.global_step, fields)  # [N]
