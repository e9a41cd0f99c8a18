"""Refuse Lightning strategies that hand LoGRA flattened parameters (no silent dense fallback).

LoGRA sketches each weight ``W`` (``[m, n]``) as ``G @ Q`` or ``P.T @ G``; it needs the
matrix, or a block of its rows (FSDP2, see :mod:`~logra_lightning.optim.sharding`).
Strategies that flatten parameters into 1-D buffers before the optimizer sees them
leave no matrix to sketch: LoGRA would either fail deep inside with a shape error or,
with a name+shape split, put every weight in its dense AdamW group and quietly lose
the memory savings that are the point of using it. So they are refused up front:

- Lightning ``FSDPStrategy`` (FSDP1): the optimizer gets ``FlatParameter`` shards
  (``use_orig_params=False``) or 1-D views into them (``use_orig_params=True``).
- Lightning ``DeepSpeedStrategy`` (ZeRO): the optimizer steps flat fp32 partitions.

Call :func:`check_strategy_supported` from the LightningModule's ``setup`` (the strategy
is known then; the optimizer may still be a callable from the config).

Example::

    >>> from types import SimpleNamespace
    >>> from lightning.pytorch.strategies import FSDPStrategy
    >>> from logra_lightning.optim import LoGRA
    >>> check_strategy_supported(SimpleNamespace(strategy=FSDPStrategy()), LoGRA)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: LoGRA cannot run under Lightning's `FSDPStrategy` (FSDP1): ...
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import lightning as L
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from logra_lightning.errors import ConfigError

_FIX = (
    "Use `ModelParallelStrategy` (FSDP2) instead: it shards every weight by rows as a DTensor, "
    "which LoGRA supports (sketches stay local, sharded state is ~1/world per rank). For example "
    "`Trainer(strategy=ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1))`, "
    "with `fully_shard` applied per decoder layer in `configure_model`. Or pick a dense optimizer "
    "(e.g. `torch.optim.AdamW`) if you need this strategy."
)

_WHY = {
    FSDPStrategy: (
        "LoGRA cannot run under Lightning's `FSDPStrategy` (FSDP1): it hands the optimizer flattened "
        "1-D shards of the parameters, so no weight keeps its [out, in] matrix shape and there is "
        "nothing to sketch; LoGRA would fail or put every weight in its dense AdamW group and lose "
        "its memory savings. "
    ),
    DeepSpeedStrategy: (
        "LoGRA cannot run under Lightning's `DeepSpeedStrategy`: ZeRO steps the optimizer on flat "
        "fp32 partitions of the parameters, so no weight keeps its [out, in] matrix shape and there "
        "is nothing to sketch. "
    ),
}


def _optimizer_classes(optimizer: Any) -> list[type]:
    """The optimizer classes ``optimizer`` stands for: an instance, a ``LightningOptimizer``, a class,
    a ``functools.partial`` (what ``OptimizerCallable`` from a LightningCLI config is), or a list of these."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return [c for o in optimizer for c in _optimizer_classes(o)]
    if isinstance(optimizer, dict) and "optimizer" in optimizer:  # configure_optimizers' dict form
        return _optimizer_classes(optimizer["optimizer"])
    if inspect.isclass(optimizer):
        return [optimizer]
    if isinstance(optimizer, functools.partial):
        return _optimizer_classes(optimizer.func) + [a for a in optimizer.args if inspect.isclass(a)]
    wrapped = getattr(optimizer, "optimizer", None)  # LightningOptimizer
    return [type(wrapped if wrapped is not None else optimizer)]


def check_strategy_supported(trainer: L.Trainer, optimizer: Any) -> None:
    """Raise if ``trainer``'s strategy cannot give LoGRA matrix-shaped parameters.

    Args:
        trainer: the trainer (only ``trainer.strategy`` is read).
        optimizer: an optimizer, ``LightningOptimizer``, optimizer class, ``functools.partial`` /
            ``OptimizerCallable``, or a list of these. Anything that is not LoGRA passes.

    Raises:
        ConfigError: LoGRA under ``FSDPStrategy`` (FSDP1) or ``DeepSpeedStrategy``; the message says
            why and to use ``ModelParallelStrategy`` (FSDP2).
    """
    from logra_lightning.optim.logra import LoGRA

    if not any(issubclass(c, LoGRA) for c in _optimizer_classes(optimizer)):
        return
    for strategy_cls, why in _WHY.items():
        if isinstance(trainer.strategy, strategy_cls):
            raise ConfigError(why + _FIX)
