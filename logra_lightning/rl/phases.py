"""Named phases of a training step, announced to callbacks that care.

A LightningModule wraps the parts of its step in ``with announce_phase(self, "rollout"):``;
every callback of the trainer that defines ``on_phase_start(trainer, pl_module, name)``
/ ``on_phase_end(trainer, pl_module, name)`` is told. Callbacks that do not define
them are not touched, so any Lightning project can use the same callbacks with
or without announcing phases (``MemoryMonitor`` then falls back to the phases it
can see from standard hooks).

Phases used by :class:`~logra_lightning.rl.module.PolicyGradientModule`:
``rollout``, ``reference`` (with a KL penalty), ``pi_old`` (with ``ppo_epochs > 1``),
``forward_backward``, ``optimizer``, ``weight_sync`` (the last is announced by
:class:`~logra_lightning.callbacks.LowRankWeightSync`). Given a dict, ``announce_phase``
also adds the phase's wall time to it, under its name.

Example::

    >>> import lightning as L
    >>> class M(L.LightningModule):
    ...     def training_step(self, batch, batch_idx):
    ...         with announce_phase(self, "rollout"):
    ...             ...
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L

PHASES = ("rollout", "reference", "pi_old", "forward_backward", "optimizer", "weight_sync")


def _callbacks(pl_module: L.LightningModule) -> list:
    trainer = pl_module._trainer  # public `trainer` raises when detached; being detached just means "no one to tell"
    return list(trainer.callbacks) if trainer is not None else []


@contextmanager
def announce_phase(pl_module: L.LightningModule, name: str, seconds: dict[str, float] | None = None) -> Iterator[None]:
    """Tell the trainer's callbacks that phase ``name`` starts, run the body, tell them it ended.

    With ``seconds``, the body's wall time (callbacks' own time excluded) is added to ``seconds[name]``.
    """
    callbacks = _callbacks(pl_module)
    for cb in callbacks:
        if hasattr(cb, "on_phase_start"):
            cb.on_phase_start(pl_module.trainer, pl_module, name)
    start = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        for cb in callbacks:
            if hasattr(cb, "on_phase_end"):
                cb.on_phase_end(pl_module.trainer, pl_module, name)
