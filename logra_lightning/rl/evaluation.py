"""Held-out evaluation of the policy: greedy accuracy per batch, over the whole set, and the fit's summary.

:class:`HeldOutEvaluation` holds the hooks that
:class:`~logra_lightning.rl.module.PolicyGradientModule` evaluates with (it is the module's first
base), so the module itself keeps the RL step. It evaluates three ways, all through the rollout
engine with greedy decoding and the module's reward (a sample is correct when its reward is at
least ``correct_reward``):

* ``validation_step``: per validation batch, ``val/accuracy``;
* at the start and the end of ``fit``: the whole validation set at once
  (:func:`~logra_lightning.rollout.greedy.greedy_accuracy`), logged to every logger (:func:`log_accuracy`)
  on the step axis of the training metrics (:func:`logged_step`);
* at the end of ``fit``: ``summary.json`` in the log directory and one printed line
  (:func:`write_fit_summary`): accuracy before and after, steps, seconds.

Example::

    >>> log_accuracy([], accuracy=0.5, step=3)  # no logger: nothing to do
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from logra_lightning._util import full
from logra_lightning.data.module import collate_records, record_fields
from logra_lightning.rollout.greedy import correct, greedy_accuracy, greedy_completions


def logged_step(trainer: Any) -> int:
    """The step the loggers put the next metrics at: Lightning's count of batches trained, which a batch skipped
    before scoring moves without an optimizer step. It equals ``global_step`` until a batch is skipped; logging an
    evaluation at ``global_step`` after skips would put it among earlier steps' metrics. Lightning keeps it in a
    private field, the one its logger connector reads; it has no public name."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def log_accuracy(loggers: Sequence[Any], accuracy: float, step: int) -> None:
    """``val/accuracy`` at ``step`` to every logger (outside a step, where ``self.log`` is not allowed)."""
    for logger in loggers:
        logger.log_metrics({"val/accuracy": accuracy}, step=step)


def logs_line(loggers: Sequence[Any], log_dir: str | None) -> str:
    """Where the run's logs went, naming each logger (the first one's directory holds ``summary.json``).

    Example::

        >>> logs_line([], "runs/x")
        'no logger (trainer.logger: false); summary.json in runs/x'
    """
    parts = []
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "TensorBoardLogger":
            parts.append(f"TensorBoard logs: {logger.log_dir}   (view: tensorboard --logdir {logger.save_dir})")
        elif kind == "CSVLogger":
            parts.append(f"CSV logs: {logger.log_dir}/metrics.csv")
        elif kind == "WandbLogger":
            parts.append(f"W&B run {logger.version} of project {logger.name}, local files under {logger.save_dir}")
        elif kind == "MLFlowLogger":
            parts.append(f"MLflow run {logger.run_id} (experiment {logger.name}) in {logger.save_dir}")
        else:
            parts.append(f"{kind} logs: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    return "; ".join(parts) if parts else f"no logger (trainer.logger: false); summary.json in {log_dir}"


def write_fit_summary(
    history: Sequence[tuple[int, float]],
    steps: int,
    train_seconds: float,
    log_dir: str | None,
    is_global_zero: bool,
    loggers: Sequence[Any] = (),
) -> dict[str, Any]:
    """Write ``summary.json`` (rank zero, when there is a log directory), print the one-line result, return it.

    ``history`` is ``[(step, accuracy), ...]``: the first entry is before RL, the last after; the line
    after it names the ``loggers`` and where their files are (:func:`logs_line`).
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
        f"{logs_line(loggers, log_dir)}",
        flush=True,
    )
    return summary


class HeldOutEvaluation:
    """The evaluation hooks of :class:`~logra_lightning.rl.module.PolicyGradientModule` (a mixin).

    Uses the module's ``engine``, ``tokenizer``, ``policy``, ``_score``, ``hparams`` (``eval_max_new_tokens``,
    ``max_new_tokens``, ``correct_reward``), ``val_accuracy`` and ``test_accuracy`` (``MeanMetric``) and
    ``accuracy_history`` (``[(step, accuracy)]``, checkpointed by the module). ``logra validate`` and
    ``logra test`` evaluate a checkpoint (``--ckpt_path``): an engine with its own copy of the weights
    (vLLM) is loaded with the checkpoint's weights first.

    Logged metrics:
        ``val/accuracy`` (fit and ``logra validate``), ``test/accuracy`` (``logra test``)
    """

    @override
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        correct = self._greedy_correct(batch)
        self.val_accuracy.update(correct)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=len(correct))

    @override
    def test_step(self, batch: dict[str, list], batch_idx: int) -> None:
        correct = self._greedy_correct(batch)
        self.test_accuracy.update(correct)
        self.log("test/accuracy", self.test_accuracy, prog_bar=True, batch_size=len(correct))

    @override
    def on_validation_start(self) -> None:
        if self.trainer.state.fn != "fit":  # during fit the weight-sync callback keeps the engine current
            self._engine_to_policy()

    @override
    def on_test_start(self) -> None:
        self._engine_to_policy()

    def _engine_to_policy(self) -> None:
        """Outside fit, an engine with its own weights evaluates the module's (a loaded checkpoint's): a full load."""
        if self.engine is None or getattr(self.engine, "shares_weights", False):
            return
        self.engine.load_weights([(name, full(p)) for name, p in self.policy.named_parameters()])

    def _greedy_correct(self, batch: dict[str, list]) -> torch.Tensor:
        hp, prompts = self.hparams, batch["prompt"]
        limit = hp.eval_max_new_tokens or hp.max_new_tokens
        texts = greedy_completions(self.engine, self.tokenizer, prompts, max_new_tokens=limit)
        score = partial(self._score, fields=record_fields(batch))  # the reward may ask for the records' fields
        return correct(score, prompts, texts, batch["answer"], hp.correct_reward)  # [B]

    def evaluate(self) -> float | None:
        """Greedy held-out accuracy over the datamodule's whole validation set (``None`` without one)."""
        dm, hp = self.trainer.datamodule, self.hparams
        records = getattr(dm, "val_records", None)
        if not records:
            return None
        return greedy_accuracy(
            self.engine,
            self.tokenizer,
            records,
            partial(self._score, fields=record_fields(collate_records(records))),
            max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens,
            batch_size=getattr(dm, "val_batch_size", 64),
            correct_reward=hp.correct_reward,
        )

    @override
    def on_train_start(self) -> None:
        self._fit_started = time.perf_counter()
        acc = self.evaluate()
        if acc is not None:
            self.accuracy_history.append((self.global_step, acc))
            log_accuracy(self.loggers, acc, logged_step(self.trainer))

    @override
    def on_fit_end(self) -> None:
        if not self.accuracy_history:
            return
        acc = self.evaluate()
        self.accuracy_history.append((self.global_step, acc))
        log_accuracy(self.loggers, acc, logged_step(self.trainer))
        log_dir = self.trainer.log_dir  # a broadcast under DDP/FSDP: read it once, on every rank
        write_fit_summary(
            self.accuracy_history,
            self.global_step,
            time.perf_counter() - self._fit_started,
            log_dir,
            self.trainer.is_global_zero,
            self.loggers,
        )
