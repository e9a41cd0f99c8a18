"""The prompt data module: batches of ``{"prompt", "answer"}`` records for RL, resumable mid-epoch.

A *source* is any object with ``load() -> list[dict]`` whose dicts have ``prompt``
and ``answer`` strings (``ArithmeticSource``, ``JSONLSource``, the math sources in
``logra_lightning.data.math``); configs choose one by ``class_path``. Batches are
plain dicts of lists, ``{"prompt": [B str], "answer": [B str]}``: tokenization is
the module's job because it owns the tokenizer.

Resuming (``logra fit --ckpt_path last``) continues the shuffle order exactly where the
checkpoint left it, also in the middle of an epoch:

1. The order of epoch ``e`` is a permutation drawn from ``seed + e`` (the same rule as
   ``DistributedSampler``), sharded over ranks by :class:`ResumableSampler`, which is a
   ``DistributedSampler`` so that Lightning does not replace it.
2. The position is counted where a batch is *consumed* (``on_before_batch_transfer`` of the
   training loop), not where the loader yields it: Lightning prefetches one batch, so a
   count of yielded batches would skip one on resume.
3. The position ``(epoch, batches consumed)`` is the data module's ``state_dict``, which
   Lightning saves in every checkpoint; on load, the next ``train_dataloader()`` starts at
   that epoch and skips the consumed batches without loading them.

Example::

    >>> from logra_lightning.data import ArithmeticSource, PromptDataModule
    >>> dm = PromptDataModule(ArithmeticSource("train", max_digits=1, test_size=10),
    ...                       ArithmeticSource("test", max_digits=1, test_size=10), batch_size=4)
    >>> dm.setup("fit")
    >>> sorted(next(iter(dm.train_dataloader())))
    ['answer', 'prompt']
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from logra_lightning.data.source import PromptSource
from logra_lightning.errors import ConfigError


def collate_records(records: list[dict]) -> dict[str, list]:
    """``[{"prompt": p, "answer": a, ...}] -> {"prompt": [p...], "answer": [a...], ...}`` (keys of the first record)."""
    return {k: [r[k] for r in records] for k in records[0]}


def record_fields(batch: dict[str, list]) -> dict[str, list]:
    """A batch's fields other than ``prompt`` and ``answer``: what a reward may ask for by name.

    >>> record_fields({"prompt": ["1+1="], "answer": ["2"], "level": [1]})
    {'level': [1]}
    """
    return {k: v for k, v in batch.items() if k not in ("prompt", "answer")}


def repeat_fields(fields: dict[str, list], n: int) -> dict[str, list]:
    """Each value ``n`` times in a row, as the prompts of a rollout with ``n`` samples per prompt.

    >>> repeat_fields({"level": [1, 2]}, 2)
    {'level': [1, 1, 2, 2]}
    """
    return {k: [x for x in v for _ in range(n)] for k, v in fields.items()}


class ResumableSampler(DistributedSampler):
    """A shuffling ``DistributedSampler`` that can start an epoch after its first ``skip`` indices.

    Args:
        records: the dataset (only its length is used).
        num_replicas, rank: data-parallel world size and this rank (1 and 0 on one process).
        seed: the order of epoch ``e`` is a permutation drawn from ``seed + e``.
        epoch: the epoch the next ``iter()`` serves.
        skip: indices of this rank's share of ``epoch`` already consumed (dropped from the
            next ``iter()`` of that epoch; ``len()`` stays the full share, so Lightning's
            restored batch counter ends the epoch where it would have ended).
    """

    def __init__(
        self, records: list, num_replicas: int = 1, rank: int = 0, seed: int = 0, epoch: int = 0, skip: int = 0
    ) -> None:
        super().__init__(records, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.epoch, self.skip = epoch, skip

    @override
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.skip = 0  # the skip belongs to the epoch it was saved in
        super().set_epoch(epoch)

    @override
    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)


class PromptDataModule(L.LightningDataModule):
    """Shuffled training prompts and held-out evaluation prompts.

    Args:
        train: source of training prompts.
        val: source of held-out prompts (``val/accuracy``, and ``test/accuracy`` under ``logra test``);
            ``None`` to skip evaluation.
        batch_size: prompts per RL step (each is sampled ``group_size`` times by the module).
        val_batch_size: prompts per evaluation batch.
        seed: shuffle seed (epoch ``e`` uses ``seed + e``).

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
        self.epoch, self.consumed = 0, 0  # training position: batches of `epoch` already trained on

    def setup(self, stage: str) -> None:
        if not self.train_records and stage == "fit":
            self.train_records = self.train_source.load()
            self._check_batch_fits()
        if not self.val_records and self.val_source is not None:
            self.val_records = self.val_source.load()

    def _check_batch_fits(self) -> None:
        """Each rank's share of the training set must hold one batch (batches are full: ``drop_last``)."""
        world = self.trainer.world_size if self.trainer is not None else 1
        n = len(self.train_records)
        if n // world < self.batch_size:
            per_rank = f", {n // world} per rank on {world} ranks" if world > 1 else ""
            raise ConfigError(
                f"data.batch_size={self.batch_size}: larger than the training set ({n} prompts{per_rank}), "
                f"so there would be no training batch; choose data.batch_size <= {max(n // world, 1)} "
                "or give more training data"
            )

    def use_tokenizer(self, tokenizer) -> bool:
        """Hand the policy's tokenizer to sources that render prompts with a chat template.

        Sources with a ``tokenizer`` attribute (the GSM8K/MATH sources) render each question
        with ``tokenizer.apply_chat_template`` when the tokenizer has a chat template; their
        records are loaded again so the prompts use it. Returns True if any source changed.
        """
        if not getattr(tokenizer, "chat_template", None):
            return False
        changed = False
        for source, attr in ((self.train_source, "train_records"), (self.val_source, "val_records")):
            if source is None or not hasattr(source, "tokenizer") or source.tokenizer is tokenizer:
                continue
            source.tokenizer = tokenizer
            if getattr(self, attr):
                setattr(self, attr, source.load())
            changed = True
        return changed

    def train_dataloader(self) -> DataLoader:
        world, rank = 1, 0
        if self.trainer is not None:
            world, rank = self.trainer.world_size, self.trainer.global_rank
        skip = self.consumed * self.batch_size  # this rank's indices of `epoch` already trained on
        sampler = ResumableSampler(self.train_records, world, rank, self.seed, self.epoch, skip)
        return DataLoader(
            self.train_records, batch_size=self.batch_size, sampler=sampler, collate_fn=collate_records, drop_last=True
        )

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_records:
            return []
        return DataLoader(self.val_records, batch_size=self.val_batch_size, collate_fn=collate_records)

    def test_dataloader(self) -> DataLoader | list:
        """The held-out prompts (``logra test`` evaluates a checkpoint on them, as ``validate`` does)."""
        return self.val_dataloader()

    # ---------------------------------------------------------------- position
    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer is not None and self.trainer.training:
            epoch = self.trainer.current_epoch
            self.consumed = self.consumed + 1 if epoch == self.epoch else 1
            self.epoch = epoch
        return batch

    @override
    def state_dict(self) -> dict[str, Any]:
        epoch, consumed = self.epoch, self.consumed
        if self.trainer is not None and consumed >= self.trainer.num_training_batches:
            epoch, consumed = epoch + 1, 0  # saved at the end of an epoch: resume at the next one
        return {"epoch": epoch, "consumed": consumed, "seed": self.seed, "batch_size": self.batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch, self.consumed = int(state_dict.get("epoch", 0)), int(state_dict.get("consumed", 0))
        if state_dict.get("batch_size", self.batch_size) != self.batch_size:
            self.consumed = self.consumed * state_dict["batch_size"] // self.batch_size  # same prompts, rounded down
