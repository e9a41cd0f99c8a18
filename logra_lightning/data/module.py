"""The prompt data module: batches of ``{"prompt", "answer"}`` records for RL.

A *source* is any object with ``load() -> list[dict]`` whose dicts have ``prompt``
and ``answer`` strings (``ArithmeticSource``, ``JSONLSource``, the math sources in
``logra_lightning.data.math``); configs choose one by ``class_path``. Batches are
plain dicts of lists, ``{"prompt": [B str], "answer": [B str]}``: tokenization is
the module's job because it owns the tokenizer.

Example::

    >>> from logra_lightning.data import ArithmeticSource, PromptDataModule
    >>> dm = PromptDataModule(ArithmeticSource("train", max_digits=1, test_size=10),
    ...                       ArithmeticSource("test", max_digits=1, test_size=10), batch_size=4)
    >>> dm.setup("fit")
    >>> sorted(next(iter(dm.train_dataloader())))
    ['answer', 'prompt']
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from logra_lightning.data.source import PromptSource
from logra_lightning.errors import ConfigError


def collate_records(records: list[dict]) -> dict[str, list]:
    """``[{"prompt": p, "answer": a, ...}] -> {"prompt": [p...], "answer": [a...], ...}`` (keys of the first record)."""
    return {k: [r[k] for r in records] for k in records[0]}


class PromptDataModule(L.LightningDataModule):
    """Shuffled training prompts and held-out evaluation prompts.

    Args:
        train: source of training prompts.
        val: source of held-out prompts (``val/accuracy``); ``None`` to skip evaluation.
        batch_size: prompts per RL step (each is sampled ``group_size`` times by the module).
        val_batch_size: prompts per evaluation batch.
        seed: shuffle seed.

    Raises:
        ConfigError: a non-positive batch size.
    """

    def __init__(
        self,
        train: PromptSource,
        val: PromptSource | None = None,
        batch_size: int = 16,
        val_batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for key, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size)):
            if not (isinstance(value, int) and value > 0):
                raise ConfigError(f"data.{key}={value!r}: must be an integer >= 1")
        self.train_source, self.val_source = train, val
        self.batch_size, self.val_batch_size, self.seed = batch_size, val_batch_size, seed
        self.train_records: list[dict] = []
        self.val_records: list[dict] = []

    def setup(self, stage: str) -> None:
        if not self.train_records and stage == "fit":
            self.train_records = self.train_source.load()
        if not self.val_records and self.val_source is not None:
            self.val_records = self.val_source.load()

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_records, batch_size=self.batch_size, shuffle=True, generator=gen,
            collate_fn=collate_records, drop_last=True,
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_records:
            return []
        return DataLoader(self.val_records, batch_size=self.val_batch_size, collate_fn=collate_records)
