"""Held-out evaluation of the policy: greedy accuracy per batch, over the whole set, and the fit's summary.

:class:`HeldOutEvaluation` holds the hooks that
:class:`~logra_lightning.rl.module.PolicyGradientModule` evaluates with (it is the module's first
base), so the module itself keeps the RL step. It evaluates three ways, all through the rollout
engine with greedy decoding and the module's reward (a sample is correct when its reward is at
least ``correct_reward``):

* ``validation_step``: per validation batch (:func:`greedy_correct`), ``val/accuracy``;
* at the start and the end of ``fit``: the whole validation set at once (:func:`held_out_accuracy`),
  logged at that step to every logger (:func:`log_accuracy`);
* at the end of ``fit``: ``summary.json`` in the log directory and one printed line
  (:func:`write_fit_summary`): accuracy before and after, steps, seconds.

Example::

    >>> class Always:  # a stand-in "correct" function: every sample right
    ...     def __call__(self, prompts, answers): return torch.ones(len(prompts))
    >>> held_out_accuracy([{"prompt": "1+1=", "answer": "2"}] * 3, batch_size=2, correct=Always())
    1.0
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from logra_lightning.rollout import SamplingConfig


def greedy_correct(
    engine,
    tokenizer,
    score: Callable[..., torch.Tensor],
    prompts: list[str],
    answers: list[str],
    *,
    max_new_tokens: int,
    correct_reward: float,
) -> torch.Tensor:
    """``[B]``: 1.0 where the greedy completion of a prompt scores at least ``correct_reward``."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    out = engine.generate([tokenizer.encode(p) for p in prompts], n=1, sampling=sampling)
    return (score(prompts, out.texts, answers) >= correct_reward).float()


def held_out_accuracy(
    records: Sequence[dict[str, str]] | None, batch_size: int, correct: Callable[[list[str], list[str]], torch.Tensor]
) -> float | None:
    """Share of ``records`` (``{"prompt", "answer"}``) that ``correct`` marks right, in batches; ``None`` without records."""
    if not records:
        return None
    hits = [
        correct([r["prompt"] for r in records[i : i + batch_size]], [r["answer"] for r in records[i : i + batch_size]])
        for i in range(0, len(records), batch_size)
    ]
    return torch.cat(hits).mean().item()


def log_accuracy(loggers: Sequence[Any], accuracy: float, step: int) -> None:
    """``val/accuracy`` at ``step`` to every logger (outside a step, where ``self.log`` is not allowed)."""
    for logger in loggers:
        logger.log_metrics({"val/accuracy": accuracy}, step=step)


def write_fit_summary(
    history: Sequence[tuple[int, float]], steps: int, train_seconds: float, log_dir: str | None, is_global_zero: bool
) -> dict[str, Any]:
    """Write ``summary.json`` (rank zero, when there is a log directory), print the one-line result, return it.

    ``history`` is ``[(step, accuracy), ...]``: the first entry is before RL, the last after.
    """
    before, acc = history[0][1], history[-1][1]
    summary = {
        "accuracy_before": before,
        "accuracy_after": acc,
        "steps": steps,
        "train_seconds": train_seconds,
        "log_dir": log_dir,
    }
    if is_global_zero and log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    # print, not logging: vLLM reconfigures the logging module, which can silence Lightning's info logger
    rank_zero_only(print)(
        f"\nheld-out greedy accuracy: before RL {before:.1%} -> after {steps} RL steps {acc:.1%} "
        f"({'+' if acc >= before else ''}{100 * (acc - before):.1f} points, {train_seconds:.0f} s)\n"
        f"TensorBoard logs: {log_dir}   (view: tensorboard --logdir runs)",
        flush=True,
    )
    return summary


class HeldOutEvaluation:
    """The evaluation hooks of :class:`~logra_lightning.rl.module.PolicyGradientModule` (a mixin before ``LightningModule``).

    Uses the module's ``engine``, ``tokenizer``, ``_score``, ``hparams`` (``eval_max_new_tokens``,
    ``max_new_tokens``, ``correct_reward``), ``val_accuracy`` (a ``MeanMetric``) and
    ``accuracy_history`` (``[(step, accuracy)]``, checkpointed by the module).

    Logged metrics:
        ``val/accuracy``
    """

    @override
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        correct = self._greedy_correct(batch["prompt"], batch["answer"])
        self.val_accuracy.update(correct)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=len(correct))

    def _greedy_correct(self, prompts: list[str], answers: list[str]) -> torch.Tensor:
        hp = self.hparams
        return greedy_correct(
            self.engine,
            self.tokenizer,
            self._score,
            prompts,
            answers,
            max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens,
            correct_reward=hp.correct_reward,
        )

    def evaluate(self) -> float | None:
        """Greedy held-out accuracy over the datamodule's whole validation set (``None`` without one)."""
        dm = self.trainer.datamodule
        return held_out_accuracy(
            getattr(dm, "val_records", None), getattr(dm, "val_batch_size", 64), self._greedy_correct
        )

    @override
    def on_train_start(self) -> None:
        self._fit_started = time.perf_counter()
        acc = self.evaluate()
        if acc is not None:
            self.accuracy_history.append((self.global_step, acc))
            log_accuracy(self.loggers, acc, self.global_step)

    @override
    def on_fit_end(self) -> None:
        if not self.accuracy_history:
            return
        acc = self.evaluate()
        self.accuracy_history.append((self.global_step, acc))
        log_accuracy(self.loggers, acc, self.global_step)
        log_dir = self.trainer.log_dir  # a broadcast under DDP/FSDP: read it once, on every rank
        write_fit_summary(
            self.accuracy_history,
            self.global_step,
            time.perf_counter() - self._fit_started,
            log_dir,
            self.trainer.is_global_zero,
        )
