"""Every ``callbacks/*.yaml`` snippet, added with ``--trainer.callbacks+=`` to a LightningCLI that is not ours.

The foreign project is a plain next-token language model (a tiny Qwen2 learning addition strings)
with its own ``LightningCLI``, automatic optimization and LoGRA; it offers what the callbacks ask of
a module (``kl_probe_logits``, ``engine``, ``policy``, ``tokenizer``). Each snippet must build its
callback with the snippet's arguments and run two steps, logging the keys its file promises.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch.nn import functional as F

from logra_lightning import callbacks
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.optim import LoGRA
from logra_lightning.rollout import HFEngine

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = sorted((ROOT / "callbacks").glob("*.yaml"))


class AdditionLM(L.LightningModule):
    """Next-character loss on ``a+b=c`` strings: the user's own module, not logra's."""

    def __init__(self, model_path: str, lr: float = 1e-2, rank: int = 4) -> None:
        super().__init__()
        self.policy, self.tokenizer = load_policy(model_path)
        self.policy.train()
        self.engine = HFEngine(self.policy, self.tokenizer, copy_weights=True)  # a stand-in for a remote engine
        self.lr, self.rank = lr, rank
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def training_step(self, batch: list[str], batch_idx: int) -> torch.Tensor:
        enc = self.tokenizer([t + self.tokenizer.eos_token for t in batch], padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]  # [B, T]
        self.batch = (ids, mask)
        logits = self.policy(input_ids=ids, attention_mask=mask).logits[:, :-1]  # [B, T-1, V]
        targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)  # [B, T-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.log("train/loss", loss, batch_size=len(batch))
        return loss

    @torch.no_grad()
    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        ids, mask = self.batch
        rows = min(ids.shape[0], math.ceil(max_tokens / ids.shape[1]))
        logits = self.policy(input_ids=ids[:rows], attention_mask=mask[:rows]).logits  # [rows, T, V]
        return logits[mask[:rows].bool()][:max_tokens].float()  # [N, V]

    def configure_optimizers(self):
        return LoGRA(list(self.policy.named_parameters()), lr=self.lr, rank=self.rank, update_proj_gap=50)


class AdditionData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        rng = random.Random(0)
        texts = [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(64))]
        return torch.utils.data.DataLoader(texts, batch_size=self.batch_size, collate_fn=list)


class Recorder(L.Callback):
    """Every key logged during the fit."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.keys |= set(trainer.callback_metrics)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("foreign"), TinyModelConfig(num_layers=1))


def test_there_is_one_snippet_per_callback():
    classes = {yaml.safe_load(p.read_text())["class_path"].rsplit(".", 1)[1] for p in SNIPPETS}
    public = {name for name in callbacks.__all__ if isinstance(getattr(callbacks, name), type)}
    assert classes - {"ModelCheckpoint"} == public - {"SupportsKLProbe"}  # and Lightning's, set up for val/accuracy


# What each snippet's first comment lines promise it logs (or the file it writes).
PROMISED = {
    "memory_monitor.yaml": ["memory/params_gb", "memory/optimizer_state_gb"],
    "kl_step_control.yaml": ["kl/predicted", "kl/step_scale"],
    "low_rank_weight_sync.yaml": ["sync/bytes", "sync/full_syncs"],
    "export_policy.yaml": [],
    "step_progress_bar.yaml": [],
    "log_completions.yaml": [],  # no scalars; tests/test_completions.py reads what it writes
}
# Snippets that need logra's module: run by their own tests instead.
OWN_TEST = {"model_checkpoint_best.yaml": "tests/test_checkpoints.py (monitors val/accuracy)"}


@pytest.mark.parametrize("snippet", [p for p in SNIPPETS if p.name not in OWN_TEST], ids=lambda p: p.name)
def test_snippet_runs_in_a_foreign_lightning_cli(snippet, model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ExportPolicy's default directory and the logs land here
    for key in PROMISED[snippet.name]:
        assert key in snippet.read_text(), f"{snippet.name} does not document {key}"
    args = [
        f"--model.model_path={model_path}",
        "--trainer.max_steps=2",
        "--trainer.logger=true",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_checkpointing=false",
        "--trainer.accelerator=cpu",
        f"--trainer.callbacks+={snippet}",
    ]
    recorder = Recorder()
    cli = LightningCLI(AdditionLM, AdditionData, args=args, run=False, trainer_defaults={"callbacks": [recorder]})
    wanted = yaml.safe_load(snippet.read_text())
    cls_name = wanted["class_path"].rsplit(".", 1)[1]
    (built,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == cls_name]
    for key, value in (wanted.get("init_args") or {}).items():
        assert getattr(built, key) == value, f"{snippet.name}: {key}"
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 2
    missing = [k for k in PROMISED[snippet.name] if not any(m.startswith(k) for m in recorder.keys)]
    assert not missing, f"{snippet.name}: {missing} not logged (got {sorted(recorder.keys)})"
    if cls_name == "ExportPolicy":
        assert (Path(cli.trainer.log_dir) / "export" / "model.safetensors").is_file()
    if cls_name == "LowRankWeightSync":  # the engine holds the trained weights
        engine = dict(cli.model.engine.model.named_parameters())
        for name, p in cli.model.policy.named_parameters():
            torch.testing.assert_close(engine[name], p, rtol=0, atol=1e-5)


def test_a_snippet_value_is_overridden_after_it(model_path, tmp_path):
    args = [
        f"--model.model_path={model_path}",
        f"--trainer.callbacks+={ROOT / 'callbacks' / 'kl_step_control.yaml'}",
        "--trainer.callbacks.target_kl=0.002",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    cli = LightningCLI(AdditionLM, AdditionData, args=args, run=False)
    (kl,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, callbacks.KLStepControl)]
    assert kl.target_kl == 0.002 and kl.sample_tokens == 64
