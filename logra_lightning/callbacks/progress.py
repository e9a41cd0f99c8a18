"""``StepProgressBar``: one bar over the whole run, counted in RL steps, with reward and accuracy.

Lightning's default bar counts batches of the current epoch and labels them ``Epoch 0/-2``
(``max_epochs=-1`` when a run is bounded by ``max_steps``) and shows the logger's version as
``v_num``. An RL run is bounded by ``max_steps`` and an epoch of prompts means little, so this
bar reads::

    RL step:  18%|█▊        | 37/200 [00:21<01:33, 1.75step/s, reward=0.620, accuracy=0.620, mfu=0.031, val=0.578]

``logra fit`` uses it unless the config names another progress bar or sets
``trainer.enable_progress_bar: false``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

# Shown names of the progress-bar metrics PolicyGradientModule logs (prog_bar=True); others keep their key.
SHORT_NAMES = {"reward/mean": "reward", "reward/accuracy": "accuracy", "val/accuracy": "val", "perf/mfu": "mfu"}


class StepProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` whose training bar counts global steps to ``max_steps`` across epochs.

    Args:
        refresh_rate: update the bar every this many steps.

    Logged metrics:
        None; shows ``reward/mean``, ``reward/accuracy``, ``perf/mfu`` and ``val/accuracy`` as ``reward``,
        ``accuracy``, ``mfu`` and ``val`` (and any other ``prog_bar=True`` metric under its own key), and
        drops ``v_num``.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(max_steps=200, callbacks=[StepProgressBar()])
    """

    def __init__(self, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=True)

    @staticmethod
    def _total(trainer: L.Trainer) -> int | None:
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        batches = trainer.num_training_batches
        epochs = trainer.max_epochs
        if isinstance(batches, int) and epochs and epochs > 0:
            return batches * epochs
        return None

    @override
    def on_train_start(self, trainer: L.Trainer, *_: Any) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=self._total(trainer))
        self.train_progress_bar.n = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.unit = "step"
        self.train_progress_bar.set_description("RL step")
        self.train_progress_bar.refresh()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        pass  # one bar for the whole run: nothing to reset per epoch

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        step = trainer.global_step
        if step % self.refresh_rate == 0 or step == bar.total:
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = {k: v for k, v in trainer.progress_bar_metrics.items()}
        return {SHORT_NAMES.get(k, k): v for k, v in metrics.items()}
