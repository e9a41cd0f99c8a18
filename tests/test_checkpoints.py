"""``--ckpt_path last|best`` from the run's checkpoint directory for any logger; the best-val/accuracy snippet;
the end-of-run line names the logger."""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_run  # tests/conftest.py
from safetensors.torch import load_file

from logra_lightning.cli import run as logra
from logra_lightning.cli.checkpoints import checkpoint_dirs, resolve_ckpt_keyword
from logra_lightning.errors import ConfigError


def test_csv_logger_resume_last_and_test_best(tmp_path, capsys, tiny_policy_path):
    csv = tmp_path / "csv.yaml"
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    csv.write_text(json.dumps({"trainer": {"logger": logger}}))
    common = ["--config", "arithmetic_tiny_adamw", "--config", str(csv), *tiny_run(tmp_path)]
    best_snippet = ["--trainer.callbacks+=model_checkpoint_best", "--trainer.val_check_interval", "1"]
    first = logra(["fit", *common, *best_snippet])
    assert "CSV logs: " in capsys.readouterr().out  # the end-of-run line names the logger used
    ckpts = Path(first.trainer.log_dir) / "checkpoints"
    (best_file,) = ckpts.glob("best-step=*-val_accuracy=*.ckpt")  # the "/" of val/accuracy is not a folder

    resumed = logra(["fit", *common, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    assert resumed.trainer.ckpt_path == str(ckpts / "last.ckpt") and resumed.trainer.global_step == 3

    tested = logra(["test", *common, "--ckpt_path", "best"])
    assert tested.trainer.ckpt_path == str(best_file)
    state = torch.load(best_file, weights_only=True)["callbacks"]
    (mc,) = [v for k, v in state.items() if k.startswith("ModelCheckpoint") and v["monitor"] == "val/accuracy"]
    assert mc["best_model_score"] == max(mc["best_k_models"].values())

    # logra export finds last / best the same way, from the fit's --config files
    configs = ["--config", "arithmetic_tiny_adamw", "--config", str(csv)]
    newest_last = Path(resumed.trainer.log_dir) / "checkpoints" / "last.ckpt"  # the resumed run's, at step 3
    for keyword, expected in (("best", best_file), ("last", newest_last)):
        out = tmp_path / f"export_{keyword}"
        assert logra(["export", "--ckpt_path", keyword, *configs, "--out", str(out)]) == 0
        assert json.loads((out / "logra_export.json").read_text())["checkpoint"] == str(expected)
        exported = load_file(out / "model.safetensors")
        saved = torch.load(expected, weights_only=True)["state_dict"]
        assert all(torch.equal(v, saved[f"policy.{k}"]) for k, v in exported.items())
    assert "--ckpt_path best: " in capsys.readouterr().err  # the one line naming what was found


def _fake_run(folder: Path, name: str, best: Path | None = None, score: float = 0.5) -> Path:
    """A checkpoint file as Lightning writes it, with the ModelCheckpoint state that names the best one."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {"monitor": "val/accuracy", "best_model_path": str(best or ""), "best_model_score": torch.tensor(score)}
    torch.save({"state_dict": {}, "callbacks": {"ModelCheckpoint{'monitor': 'val/accuracy'}": state}}, folder / name)
    return folder / name


@pytest.mark.parametrize(
    "logger, layout",
    [
        (
            {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {"project": "rl", "save_dir": "wb", "offline": True},
            },
            "wb/rl/{run}/checkpoints",
        ),
        (
            {
                "class_path": "lightning.pytorch.loggers.MLFlowLogger",
                "init_args": {"experiment_name": "rl", "tracking_uri": "file:./ml"},
            },
            "ml/{exp}/{run}/checkpoints",
        ),
        (
            {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "tb", "name": "rl"},
            },
            "tb/rl/{run}/checkpoints",
        ),
        (
            [
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "c", "name": ""}},
                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "tb"}},
            ],
            "c/{run}/checkpoints",
        ),
    ],
    ids=["wandb-offline", "mlflow-file-store", "tensorboard", "several-loggers-first-wins"],
)
def test_last_and_best_in_each_loggers_layout(logger, layout, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = {"logger": logger}
    old = Path(layout.format(exp="0", run="run-a"))
    best = _fake_run(old, "best-step=4-val_accuracy=0.9000.ckpt", score=0.9)
    _fake_run(old, "last.ckpt", best, 0.9)
    time.sleep(0.01)
    new = Path(layout.format(exp="0", run="run-b"))
    last = _fake_run(new, "last.ckpt", best, 0.9)  # a resumed run: still records the earlier best
    os.utime(last, (time.time() + 5, time.time() + 5))
    assert resolve_ckpt_keyword("last", "fit", cfg)[0] == str(last)
    assert resolve_ckpt_keyword("best", "test", cfg)[0] == str(best)


def test_no_checkpoint_to_evaluate_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}}}
    assert checkpoint_dirs(cfg) == [Path("runs/lightning_logs/*/checkpoints")]
    assert resolve_ckpt_keyword("last", "fit", cfg) == (None, "")  # fit: Lightning starts from scratch
    with pytest.raises(ConfigError, match=r"--ckpt_path last: no last\*.ckpt under runs/lightning_logs/\*/checkpoints"):
        resolve_ckpt_keyword("last", "test", cfg)
    _fake_run(tmp_path / "runs/lightning_logs/version_0/checkpoints", "last.ckpt")  # no best recorded
    with pytest.raises(ConfigError, match=r"--ckpt_path best: .*--trainer.callbacks\+=model_checkpoint_best"):
        resolve_ckpt_keyword("best", "test", cfg)


def _wandb_offline(tmp: Path) -> dict:
    init_args = {"project": "rl", "save_dir": str(tmp), "offline": True}
    return {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": init_args}


def _mlflow_file_store(tmp: Path) -> dict:
    init_args = {"experiment_name": "rl", "tracking_uri": f"file:{tmp / 'ml'}"}
    return {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": init_args}


@pytest.mark.parametrize(
    "package, make_logger, layout",
    [("wandb", _wandb_offline, "rl/*/checkpoints"), ("mlflow", _mlflow_file_store, "ml/*/*/checkpoints")],
    ids=["wandb-offline", "mlflow-file-store"],
)
def test_real_logger_resumes_last_and_tests_best(package, make_logger, layout, tmp_path, monkeypatch, capsys):
    """The logger packages themselves (``pip install wandb mlflow-skinny``): a 2-step fit keeping the best
    val/accuracy, ``--ckpt_path last`` resumes it, ``best`` evaluates the recorded best checkpoint."""
    module = pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.x refuses a file store without it
    (tmp_path / "logger.yaml").write_text(json.dumps({"trainer": {"logger": make_logger(tmp_path)}}))
    common = ["--config", "arithmetic_tiny_adamw", "--config", "logger.yaml", "--trainer.limit_val_batches", "1"]
    common += ["--data.batch_size", "4", "--model.group_size", "4", "--trainer.val_check_interval", "1"]

    def run(command: str, *argv: str):
        cli = logra([command, *common, *argv])  # the config files first: later arguments override them
        if package == "wandb":
            module.finish()  # one run per process, as from the command line (else the next fit reuses it)
        return cli

    first = run("fit", "--trainer.max_steps", "2", "--trainer.callbacks+=model_checkpoint_best")
    assert type(first.trainer.logger).__name__ == {"wandb": "WandbLogger", "mlflow": "MLFlowLogger"}[package]
    (ckpts,) = [Path(p) for p in glob.glob(str(tmp_path / layout))]  # the logger's own run directory
    (best,) = ckpts.glob("best-step=*-val_accuracy=*.ckpt")
    assert {"wandb": "W&B run ", "mlflow": "MLflow run "}[package] in capsys.readouterr().out  # the end-of-run line
    if package == "wandb":  # LogCompletions' W&B table, in the offline run's files (ckpts.parent: the run id)
        (table,) = tmp_path.glob(f"wandb/offline-run-*-{ckpts.parent.name}/files/media/table/completions_*.table.json")
        assert json.loads(table.read_text())["columns"][:5] == ["step", "prompt", "completion", "answer", "reward"]

    resumed = run("fit", "--trainer.max_steps", "3", "--ckpt_path", "last")
    assert resumed.trainer.ckpt_path == str(ckpts / "last.ckpt") and resumed.trainer.global_step == 3
    assert len(glob.glob(str(tmp_path / layout))) == 2  # the resumed run has a directory of its own

    tested = run("test", "--ckpt_path", "best")
    assert tested.trainer.ckpt_path == str(best)
    score = torch.load(best, weights_only=True)["callbacks"]
    (mc,) = [v for k, v in score.items() if k.startswith("ModelCheckpoint") and v["monitor"] == "val/accuracy"]
    assert mc["best_model_score"] == max(mc["best_k_models"].values())
