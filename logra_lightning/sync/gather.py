"""Gathering the recorded low-rank updates of a sharded optimizer into whole factors for the engine.

Under FSDP2 the left factor of a :class:`~logra_lightning.sync.wire.LowRankUpdate` holds this
rank's rows only (``[m_i, r]``; the right factor ``[r, n]`` is whole on every rank), so the
sync all-gathers those rows, ``r * m`` numbers per matrix, never the ``m * n`` weight. Tested
in ``tests/test_fsdp_lightning.py``.
"""

from __future__ import annotations

import torch

from logra_lightning.sync.wire import LowRankUpdate


def gather_update_factors(optimizer: torch.optim.Optimizer, updates: list[LowRankUpdate]) -> list[LowRankUpdate]:
    """The same updates with full-shape thin factors, from every rank's rows of the left factors.

    A collective under FSDP2: every rank calls it with its own list from
    ``optimizer.pop_applied_updates()`` (the same matrices in the same order on every rank,
    as LoGRA records them) and gets the full factors back, to send to its engine (or to
    the one rank that owns the engine). A no-op on one process. The optimizer owns its
    shard layout, so this is :meth:`LoGRA.gather_updates <logra_lightning.optim.LoGRA.gather_updates>`.

    Args:
        optimizer: the :class:`~logra_lightning.optim.LoGRA` that recorded ``updates``; a
            Lightning ``LightningOptimizer`` wrapping it works too.
        updates: one step's updates; ``left`` is ``[m_i, r]`` (this rank's rows), ``right`` ``[r, n]``.

    Returns:
        ``LowRankUpdate(name, c, left [m, r], right [r, n])`` per update, in the same order.

    Raises:
        KeyError: an update names no parameter of ``optimizer``.
        ValueError: a left factor does not hold this rank's rows of its matrix.
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
    return optimizer.gather_updates(updates)
