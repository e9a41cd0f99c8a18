"""The token subsample :class:`~logra_lightning.callbacks.KLStepControl` probes, and its cheap base logits.

The KL control asks the module for logits at a fixed subsample of the current batch's
completion tokens two or three times per optimizer step (current weights, weights moved
along the update, weights after the step). Two things keep that cheap:

1. **Few rows.** The subsample is whole completions taken in a seeded random order until
   ``max_tokens`` tokens are reached (the last one cut), so the probe's forward pass runs
   on about ``max_tokens / mean completion length`` rows, not on every row that happens to
   hold one sampled token.
2. **The base logits come for free.** The logits at the current weights are the ones the
   module already computes for ``pi_old`` right before the loss; :class:`ProbeCache` keeps
   the probed rows' logits from that pass, keyed by the parameters' in-place version
   counters, and hands them out while the weights are unchanged. Any in-place change of a
   parameter (an optimizer step, the control's ``+eps * Δ`` perturbation) bumps a counter and
   invalidates the entry.

Example::

    >>> import torch
    >>> mask = torch.tensor([[1., 1., 0.], [0., 1., 1.], [1., 0., 0.]])
    >>> rows, pos = probe_positions(mask, max_tokens=3, seed=0)
    >>> len(pos), bool((mask[rows[pos[:, 0]], pos[:, 1]] == 1).all())
    (3, True)
"""

from __future__ import annotations

import torch


def probe_positions(mask: torch.Tensor, max_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole rows of ``mask`` in a seeded random order until ``max_tokens`` masked tokens are taken.

    Args:
        mask: ``[N, T]`` 1 at the tokens that may be probed (completion tokens).
        max_tokens: most tokens to return.
        seed: seed of the row order (same seed and mask: same positions).

    Returns:
        ``(rows, pick)``: ``rows`` ``[R]`` sorted row indices to run forward, and ``pick``
        ``[M, 2]`` (``M <= max_tokens``) pairs ``(index into rows, position)``.
    """
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(mask.shape[0], generator=gen)  # [N]
    counts = mask.sum(dim=1).long().cpu()[order]  # [N] tokens per row, in probe order
    take = int((counts.cumsum(0) < max_tokens).sum()) + 1  # rows until the budget is reached
    rows = order[:take].sort().values  # [R]
    pos = mask[rows.to(mask.device)].nonzero().cpu()  # [M', 2] (index into rows, position)
    if len(pos) > max_tokens:  # cut the last probed row: keep the first max_tokens in probe order
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        keep = rank[rows[pos[:, 0]]].argsort(stable=True)[:max_tokens].sort().values
        pos = pos[keep]
    return rows, pos


def weights_version(module: torch.nn.Module) -> tuple[int, ...]:
    """In-place version counters of ``module``'s parameters (local shards under FSDP2)."""
    return tuple((p.to_local() if hasattr(p, "to_local") else p)._version for p in module.parameters())


class ProbeCache:
    """Logits at the probe positions, valid while the weights keep the version they were computed at.

    Example::

        >>> lin = torch.nn.Linear(2, 2)
        >>> cache = ProbeCache()
        >>> cache.put(lin, key=(0, 8), logits=torch.zeros(3, 2))
        >>> cache.get(lin, key=(0, 8)) is not None
        True
        >>> with torch.no_grad():
        ...     _ = lin.weight.add_(1.0)
        >>> cache.get(lin, key=(0, 8)) is None  # the weights moved
        True
    """

    def __init__(self) -> None:
        self._entry: tuple[tuple, tuple[int, ...], torch.Tensor] | None = None

    def put(self, module: torch.nn.Module, key: tuple, logits: torch.Tensor) -> None:
        self._entry = (key, weights_version(module), logits)

    def get(self, module: torch.nn.Module, key: tuple) -> torch.Tensor | None:
        if self._entry is None:
            return None
        k, version, logits = self._entry
        return logits if k == key and version == weights_version(module) else None

    def clear(self) -> None:
        self._entry = None
