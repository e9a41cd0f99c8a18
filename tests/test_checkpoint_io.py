"""Checkpoint writes are atomic: a write that fails half-way leaves the previous checkpoint loadable."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import logra_lightning.io.checkpoint as cio
from logra_lightning.errors import CheckpointError
from logra_lightning.io.checkpoint import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[1]


def _disk_full_after(nbytes: int):
    """A ``torch.save`` that writes ``nbytes`` of the real payload, then fails like a full disk."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        import io

        buf = io.BytesIO()
        real(obj, buf)
        f.write(buf.getvalue()[:nbytes])
        raise OSError(28, "No space left on device")

    return save


def test_failed_write_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1, "w": torch.arange(1000.0)}, path)
    monkeypatch.setattr(cio.torch, "save", _disk_full_after(100))
    with pytest.raises(
        CheckpointError, match=r"last\.ckpt failed \(OSError: .*No space left.*checkpoint there is intact"
    ):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    loaded = io.load_checkpoint(path)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.arange(1000.0))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # the partial temporary file is gone


def test_plain_torch_io_would_have_lost_it(tmp_path, monkeypatch):
    """The failure mode the plugin prevents: writing straight to the target truncates the old checkpoint."""
    path = tmp_path / "last.ckpt"
    torch.save({"step": 1}, path)
    monkeypatch.setattr(torch, "save", _disk_full_after(10))
    with pytest.raises(OSError), open(path, "wb") as fh:
        torch.save({"step": 2}, fh)
    monkeypatch.undo()
    with pytest.raises(Exception):  # noqa: B017 - torch.load raises several types for a truncated file
        torch.load(path, weights_only=True)


def test_trainer_keeps_last_checkpoint_when_a_save_fails(tmp_path, monkeypatch):
    class FailSecondSave(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:
                monkeypatch.setattr(cio.torch, "save", _disk_full_after(64))

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=0)
    trainer = L.Trainer(
        max_steps=3,
        callbacks=[ckpt, FailSecondSave()],
        plugins=[AtomicCheckpointIO()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(CheckpointError, match="last.ckpt"):
        trainer.fit(BoringModel())
    monkeypatch.undo()
    state = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert state["global_step"] == 1  # step 1's checkpoint, whole
    resumed = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    resumed.fit(BoringModel(), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.global_step == 2


def test_cli_writes_checkpoints_atomically_by_default():
    from logra_lightning.cli.lightning_cli import LograCLI

    cli = LograCLI(args=["--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml")], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    ckpt = cli.trainer.checkpoint_callback
    assert ckpt.save_last and ckpt._every_n_train_steps == 50  # the config's resume settings
