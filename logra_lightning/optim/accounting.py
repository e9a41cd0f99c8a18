"""Exact byte accounting of parameters, live gradients and optimizer state.

Callbacks (:class:`~logra_lightning.callbacks.memory.MemoryMonitor`) and the
benchmarks report these numbers rather than estimates. Each function counts
what *this process* holds: for a DTensor (FSDP2) that is the local shard, so on
a sharded run the numbers are per rank.

Counting rules:

1. ``param_bytes`` / ``grad_bytes``: ``numel * element_size`` of each parameter
   (resp. its live ``.grad``), tied parameters once (``model.parameters()``
   already deduplicates them).
2. ``optimizer_state_bytes``: every tensor found in ``optimizer.state`` (nested
   dicts, lists and tuples included) counts by the bytes of its *storage*, each
   storage once. Two views of one buffer are one buffer; a view that keeps a
   larger buffer alive is charged the whole buffer, because that is what stays
   in memory. Candidate updates held between ``prepare_update`` and ``step`` are
   not state and are not counted.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(4, 3)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(2, 4)).sum().backward(); opt.step()
    >>> param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt)
    (60, 60, 128)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from logra_lightning._util import local


def _tensor_bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters held by this process (local shards for DTensors)."""
    return sum(_tensor_bytes(p) for p in model.parameters())


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the live ``.grad`` tensors of the model's parameters (local shards for DTensors)."""
    return sum(_tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of all tensors in ``optimizer.state``, each storage counted once (local shards for DTensors).

    Accepts a Lightning ``LightningOptimizer`` too (its wrapped optimizer is counted).
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _tensors(list(optimizer.state.values())):
        storage = local(t).untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
