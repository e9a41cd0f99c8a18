"""The RL step: :class:`PolicyGradientModule` and what it calls.

* :mod:`~logra_lightning.rl.module` — the ``LightningModule`` (rollout -> reward -> advantage -> loss -> step);
* :mod:`~logra_lightning.rl.policy_passes`, :mod:`~logra_lightning.rl.sampling`,
  :mod:`~logra_lightning.rl.step_metrics` — its bases: the passes over the policy (trajectory, PPO
  epochs, micro-batch plan, KL probe), seeded sampling and rewards, the step's metrics;
* :mod:`~logra_lightning.rl.trajectory` — the step's data (padded sequences, log-probs);
* :mod:`~logra_lightning.rl.loss` — advantages and the clipped token loss (pure functions);
* :mod:`~logra_lightning.rl.faults` — what a step does when something goes wrong;
* :mod:`~logra_lightning.rl.evaluation` — held-out greedy evaluation;
* :mod:`~logra_lightning.rl.phases` — named phases announced to callbacks.
"""

__all__ = ["PolicyGradientModule"]


def __getattr__(name: str):
    # Lazy, so that the pure functions of rl.loss and rl.trajectory import without Lightning.
    if name == "PolicyGradientModule":
        from logra_lightning.rl.module import PolicyGradientModule

        return PolicyGradientModule
    raise AttributeError(f"module 'logra_lightning.rl' has no attribute {name!r}")
