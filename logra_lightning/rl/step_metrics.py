"""What one RL step logs: its stats, rewards, health counters, phase times and ``perf/mfu``.

:class:`StepMetrics` is a base of :class:`~logra_lightning.rl.module.PolicyGradientModule`; the metric
keys are listed in that module's docstring. Phase times come from the module's ``_seconds``, filled by
:func:`~logra_lightning.rl.phases.announce_phase`; ``perf/mfu`` divides the training phase's model
FLOPs (:class:`~logra_lightning.rl.throughput.ModelDims`) by its seconds and by the device's peak,
measured once at the first step unless ``peak_flops`` was given; on a CPU whose bf16 (or fp16) matmuls
are slower than its fp32 ones, a warning names the faster precision.

Example::

    >>> from logra_lightning.rl.module import PolicyGradientModule
    >>> issubclass(PolicyGradientModule, StepMetrics)
    True
"""

from __future__ import annotations

import time

import torch
from lightning.pytorch.utilities import rank_zero_warn

from logra_lightning.rl.throughput import low_precision_advice, measure_peak_flops, training_dtype
from logra_lightning.rl.trajectory import Trajectory
from logra_lightning.rollout import Rollout


class StepMetrics:
    """Logs a step's stats and rewards, the rollout's and faults' health metrics, phase times and MFU."""

    def _log_step(
        self, stats: dict[str, float], rewards: torch.Tensor, rollout: Rollout, start: float, batch_size: int
    ) -> None:
        self.log_dict(stats, batch_size=batch_size)
        self._log_health(rollout, start, batch_size)
        self.log_dict(
            {
                "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                "reward/errors": float(self.faults.reward_errors),
            },
            batch_size=batch_size,
        )
        self.log_dict(
            {
                "reward/mean": rewards.mean().item(),
                "reward/accuracy": (rewards >= self.hparams.correct_reward).float().mean().item(),
            },
            prog_bar=True,
            batch_size=batch_size,
        )

    def _log_health(self, rollout: Rollout, start: float, batch_size: int) -> None:
        times = {f"perf/time/{name}": s for name, s in self._seconds.items()}
        self.log_dict(
            {**rollout.metrics(time.perf_counter() - start), **times, **self.faults.metrics()}, batch_size=batch_size
        )

    def _log_mfu(self, traj: Trajectory, batch_size: int) -> None:
        """``perf/mfu``: the training phase's model FLOPs per second over the device's peak (:mod:`.throughput`)."""
        seconds = self._seconds.get("forward_backward")
        if not seconds:
            return
        if self._peak_flops is None:  # measured once, with the step's threads and precision
            dtype = training_dtype(self.trainer.precision, next(self.policy.parameters()).dtype)
            self._peak_flops = measure_peak_flops(dtype, self.device)
            if self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
                advice = low_precision_advice(dtype, self._peak_flops, measure_peak_flops(torch.float32))
                if advice:
                    rank_zero_warn(advice)
        lengths, completion = traj.seqs.lengths.tolist(), int(traj.seqs.mask.sum())
        flops = self.hparams.ppo_epochs * self._dims.training_flops(lengths, completion, self.adapter is None)
        self.log("perf/mfu", flops / seconds / self._peak_flops, prog_bar=True, batch_size=batch_size)
        self.log("perf/peak_tflops", self._peak_flops / 1e12, batch_size=batch_size)
