"""The KL-probe protocol: the tokens :class:`~logra_lightning.callbacks.KLStepControl` probes, and cheap base logits.

:class:`KLProbe` is what :meth:`~logra_lightning.rl.module.PolicyGradientModule.kl_probe_logits`
delegates to.

The KL control asks the module for logits at a fixed subsample of the current batch's
completion tokens two or three times per optimizer step (current weights, weights moved
along the update, weights after the step). Two things keep that cheap:

1. **Few rows.** The subsample is whole completions taken in a seeded random order until
   ``max_tokens`` tokens are reached (the last one cut), so the probe's forward pass runs
   on about ``max_tokens / mean completion length`` rows, not on every row that happens to
   hold one sampled token.
2. **The base logits come for free.** The logits at the current weights are the ones the
   module already computes for the loss (or a separate ``pi_old`` pass); :class:`ProbeCache` keeps
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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from logra_lightning._util import local
from logra_lightning.kl.jvp import Tangent, logits_and_tangent

if TYPE_CHECKING:  # the batch type only: kl/ sits below rl/, which calls it
    from logra_lightning.rl.trajectory import PackedBatch

# (policy, rows of the batch, rows [M] into them, target positions [M]) -> fp32 logits [M, V]
PositionLogits = Callable[[torch.nn.Module, "PackedBatch", torch.Tensor, torch.Tensor], torch.Tensor]


def whole_logits_at(policy: torch.nn.Module, batch: PackedBatch, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The model's logits ``[M, V]`` (fp32) at target positions ``(rows, pos)``, via its whole ``[n, L, V]`` logits."""
    logits = policy(input_ids=batch.ids, attention_mask=batch.attention_mask).logits  # [R, L, V]
    return logits[rows, pos].float()


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
    return tuple(local(p)._version for p in module.parameters())


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


class KLProbe:
    """Probe positions, base-logit cache and probe forward pass of a policy-gradient module.

    The positions depend only on the batch, ``seed`` and the step, so every call within one
    step probes the same tokens. ``max_tokens`` is learned from the control's first call;
    from then on each step's first forward over the batch records the base logits (:meth:`base_recorder`).

    Args:
        seed: seed of the token subsample (the module's ``kl_probe_seed``).
        logits_at: how logits at target positions are computed (default: :func:`whole_logits_at`;
            the RL module passes its chunked LM head, :func:`~logra_lightning.rl.logprobs.position_logits`).

    Example::

        >>> probe = KLProbe(seed=0)
        >>> probe.base_recorder(None, step=0) is None  # nobody has asked for probe logits yet
        True
    """

    def __init__(self, seed: int, logits_at: PositionLogits | None = None) -> None:
        self.seed = seed
        self.logits_at = logits_at or whole_logits_at
        self.max_tokens: int | None = None  # KLStepControl's sample_tokens, learned from its first call
        self.cache = ProbeCache()

    def positions(self, seqs: PackedBatch, step: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`probe_positions` of ``seqs``' completion tokens at ``step``."""
        return probe_positions(seqs.mask, max_tokens, self.seed * 1_000_003 + step)

    @torch.no_grad()
    def logits(self, policy: torch.nn.Module, seqs: PackedBatch, step: int, max_tokens: int) -> torch.Tensor:
        """Logits ``[N, V]`` of ``policy`` at the probe positions: cached at unchanged weights, else a forward pass."""
        self.max_tokens = max_tokens  # the next batch's first forward keeps these positions' logits
        cached = self.cache.get(policy, (step, max_tokens))
        if cached is not None:
            return cached
        return self._forward(policy, seqs, step, max_tokens)()  # [N, V]

    def logits_and_tangent(
        self, policy: torch.nn.Module, seqs: PackedBatch, step: int, max_tokens: int, tangent: Tangent
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[N, V]`` at the probe positions and their derivative along ``tangent``.

        One forward-mode pass (:mod:`~logra_lightning.kl.jvp`) at the current weights, in the caller's autocast;
        the cache is not used.
        """
        return logits_and_tangent(self._forward(policy, seqs, step, max_tokens), policy, tangent)

    def _forward(self, policy: torch.nn.Module, seqs: PackedBatch, step: int, max_tokens: int):
        """The probe's forward pass over its rows of ``seqs``, returning the logits ``[N, V]`` at its positions."""
        rows, pick = self.positions(seqs, step, max_tokens)
        device = seqs.ids.device
        pick, batch = pick.to(device), seqs.rows(rows.to(device)).trimmed()
        return lambda: self.logits_at(policy, batch, pick[:, 0], pick[:, 1])

    def base_recorder(self, seqs: PackedBatch, step: int) -> _BaseRecorder | None:
        """A recorder of the probe positions' logits for a micro-batched forward over ``seqs`` at the current weights.

        ``None`` until :meth:`logits` has been called (no control is probing).
        """
        if self.max_tokens is None:
            return None
        rows, pick = self.positions(seqs, step, self.max_tokens)
        return _BaseRecorder(self.cache, (step, self.max_tokens), rows[pick[:, 0]], pick[:, 1], seqs.ids.device)


class _BaseRecorder:
    """Collects the probed positions' logits micro-batch by micro-batch, then caches them."""

    def __init__(self, cache: ProbeCache, key: tuple, rows: torch.Tensor, pos: torch.Tensor, device) -> None:
        self.cache, self.key = cache, key
        self.rows, self.pos = rows.to(device), pos.to(device)  # [M] ascending, [M]
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (indices into the probe order, logits)

    def add(self, rows: torch.Tensor, logits_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Take the probed positions among the batch's ``rows`` ``[n]`` (one micro-batch, in its order).

        ``logits_at(local_rows [m], pos [m])`` returns the logits ``[m, V]`` at rows of the micro-batch.
        """
        match = self.rows[:, None] == rows.to(self.rows.device)[None, :]  # [M, n]
        here = match.any(dim=1).nonzero()[:, 0]  # [m] indices into the probe order
        if len(here):
            local = match[here].int().argmax(dim=1)  # [m] rows of the micro-batch
            self.parts.append((here, logits_at(local, self.pos[here])))

    def save(self, policy: torch.nn.Module) -> None:
        """Cache the collected logits ``[M, V]`` (probe order), valid while ``policy``'s weights are unchanged."""
        index = torch.cat([i for i, _ in self.parts])
        self.cache.put(policy, self.key, torch.cat([v for _, v in self.parts])[index.argsort()])
