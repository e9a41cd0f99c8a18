"""Lightning features that read or write ``.grad``, with LoGRA (the audit in docs/strategies.md).

Each runs a few automatic-optimization steps of the tiny LM of ``tests/lightning_strategies.py``
on one process and checks a number: equal weights to the plain run where the feature should not
change the step, a logged value or an averaged weight where it should.

Run: ``.venv/bin/python -m pytest tests/test_grad_features.py -q``
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateMonitor, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from lightning_strategies import TinyLM
from torch.utils.data import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's small-dataloader tips


def fit(module: TinyLM, steps: int = 4, batches: int | None = None, **kwargs) -> dict[str, torch.Tensor]:
    kwargs.setdefault("logger", False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, DataLoader(list(range(batches or steps * module.accumulate)), batch_size=1))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def tiny(accumulate: int = 1, cls=TinyLM) -> TinyLM:
    module = cls("logra", manual=False, accumulate=accumulate, clip=None)
    module.out_dir = None
    module.on_fit_end = lambda: None  # no weight files here
    return module


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.fixture(scope="module")
def plain() -> dict[str, torch.Tensor]:
    return fit(tiny())


def test_accumulate_grad_batches_equals_one_batch(plain):
    """Two micro-batches (sketches added in the hooks) take the step of the whole batch."""
    assert max_diff(fit(tiny(accumulate=2), accumulate_grad_batches=2), plain) <= 1e-5


def test_gradient_accumulation_scheduler(plain):
    module = tiny(accumulate=2)
    scheduler = GradientAccumulationScheduler(scheduling={0: 2})
    assert max_diff(fit(module, callbacks=[scheduler]), plain) <= 1e-5


class KeepGrads(TinyLM):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)  # dense grads zeroed in place, sketches dropped


def test_zero_grad_set_to_none_false(plain):
    assert max_diff(fit(tiny(cls=KeepGrads)), plain) == 0.0


def test_learning_rate_monitor_logs_logra_groups(tmp_path):
    logger = CSVLogger(tmp_path, name="lr")
    fit(tiny(), logger=logger, callbacks=[LearningRateMonitor()], log_every_n_steps=1)
    header = (tmp_path / "lr" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    lr_keys = [k for k in header.split(",") if k.startswith("lr-LoGRA")]
    assert lr_keys, header  # one per param group (low-rank and dense)


def test_stochastic_weight_averaging_averages_logra_weights():
    """SWA averages the weights at the start of each epoch from ``swa_epoch_start`` (1-based) through the last
    one, i.e. here the ends of epochs 0 and 1, and puts the mean into the model when training ends."""
    ends: list[dict[str, torch.Tensor]] = []

    class Snapshots(TinyLM):
        def on_train_epoch_end(self) -> None:
            ends.append({n: p.detach().clone() for n, p in self.named_parameters()})

    module = tiny(cls=Snapshots)
    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2, annealing_epochs=1)
    final = fit(module, steps=-1, batches=2, max_epochs=3, callbacks=[swa])
    mean = {n: torch.stack([e[n] for e in ends[:2]]).mean(0) for n in final}
    assert max_diff(final, mean) <= 1e-6
    assert max_diff(ends[1], ends[0]) > 1e-3  # the weights moved between the two, so the mean is not trivial
