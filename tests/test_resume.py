"""Exact resume: a run killed mid-training and resumed with ``--ckpt_path last`` equals an uninterrupted run.

The data position is tested on its own first (cheap, many stop points), then the whole stack:
model, LoGRA state (bases, moments, step counts; a basis refresh happens after the resume),
KLStepControl's calibration, the data position and the per-rollout sampling seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from logra_lightning.cli import run
from logra_lightning.data import ArithmeticSource, PromptDataModule

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "arithmetic_tiny_adamw.yaml"


# ------------------------------------------------------------ data position
class _RecordBatches(L.LightningModule):
    """Trains nothing; records the first prompt of every batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.automatic_optimization = False
        self.seen: list[str] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["prompt"][0])
        self.optimizers().step()

    def configure_optimizers(self):
        return torch.optim.SGD([self.w], lr=0.1)


class _Crash(Exception):
    pass


class _StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise _Crash  # the batch already fetched is lost, as in a crash


def _fit_batches(ckpt_dir: Path, max_steps: int, stop_at: int | None = None, ckpt_path: str | None = None) -> list[str]:
    dm = PromptDataModule(ArithmeticSource("train", max_digits=1, test_size=10), None, batch_size=30)  # 3 batches/epoch
    module = _RecordBatches()
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True, save_top_k=0)]
    callbacks += [_StopAt(stop_at)] if stop_at is not None else []
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    try:
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    except _Crash:
        pass
    return module.seen


@pytest.mark.parametrize("stop_at", [2, 3, 4])  # mid-epoch, at the epoch boundary, in the second epoch
def test_data_order_continues_exactly_after_resume(tmp_path, stop_at):
    full = _fit_batches(tmp_path / "full", 6)
    before = _fit_batches(tmp_path / "cut", 6, stop_at=stop_at)
    after = _fit_batches(tmp_path / "cut", 6, ckpt_path=str(tmp_path / "cut" / "last.ckpt"))
    assert len(before) == stop_at
    assert before + after == full  # no batch repeated or skipped, epochs reshuffled as in the full run
    assert full[:3] != full[3:6]  # the second epoch is a different permutation


# -------------------------------------------------------- kill and resume
def _scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _override(path: Path, save_dir: Path, kill_at: int | None) -> Path:
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"save_last": True, "every_n_train_steps": 1, "save_top_k": 0},
        },
        {
            "class_path": "logra_lightning.callbacks.KLStepControl",
            "init_args": {"target_kl": 1e-3, "sample_tokens": 32, "measure_every": 1},
        },
    ]
    if kill_at is not None:
        callbacks.append({"class_path": "fault_injection.ExitAtStep", "init_args": {"step": kill_at}})
    cfg = {
        "trainer": {
            "max_steps": 4,
            "callbacks": callbacks,
            "enable_progress_bar": False,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": str(save_dir), "name": "run"},
            },
        },
        "model": {
            "group_size": 4,
            "optimizer": {
                "class_path": "logra_lightning.optim.LoGRA",
                "init_args": {"lr": 1e-3, "rank": 4, "update_proj_gap": 3},
            },
        },
        "data": {"batch_size": 4, "val": None},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_killed_run_resumed_from_last_checkpoint_equals_uninterrupted_run(tmp_path, tiny_policy_path):
    kill_at = 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    killed = _override(tmp_path / "killed.yaml", tmp_path / "killed", kill_at)
    command = [sys.executable, "-m", "logra_lightning", "fit", "--config", str(CONFIG), "--config", str(killed)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-3000:]  # died inside step 2, after its backward
    last = tmp_path / "killed" / "run" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == kill_at

    resume_cfg = _override(tmp_path / "resume.yaml", tmp_path / "killed", None)
    resumed = run(["fit", "--config", str(CONFIG), "--config", str(resume_cfg), "--ckpt_path", "last"])
    assert resumed.trainer.ckpt_path == str(last)  # found in the killed run's version dir, not the new one
    full_cfg = _override(tmp_path / "full.yaml", tmp_path / "full", None)
    full = run(["fit", "--config", str(CONFIG), "--config", str(full_cfg)])

    assert resumed.trainer.global_step == full.trainer.global_step == 4
    a, b = _scalars(Path(full.trainer.log_dir)), _scalars(Path(resumed.trainer.log_dir))
    for tag in ("reward/mean", "reward/std", "loss/policy", "policy/entropy", "kl/step_scale", "kl/realized"):
        resumed_steps = {s: v for s, v in b[tag].items() if s >= kill_at}
        assert sorted(resumed_steps) == [2, 3], (tag, b[tag])
        assert resumed_steps == {s: a[tag][s] for s in resumed_steps}, tag  # bit-equal on CPU
    for (name, p), q in zip(full.model.policy.named_parameters(), resumed.model.policy.parameters()):
        assert torch.equal(p, q), name
    opt_a, opt_b = full.trainer.optimizers[0], resumed.trainer.optimizers[0]
    for p, q in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        assert set(opt_a.state[p]) == set(opt_b.state[q])
        for key, value in opt_a.state[p].items():  # basis, moments (full or factored), step, seed
            assert torch.equal(value, opt_b.state[q][key]), key
